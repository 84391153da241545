"""Trace of one steady-state training step: which of the package's functions run, how often, and how the step moves
between the package's modules.

A small LightningModule (Linear(32, 64)-ReLU-Linear(64, 10), ``F.cross_entropy`` in ``training_step``,
``self.log("train_loss", loss, prog_bar=True)``, SGD) trains on a ``DataLoader`` over a ``TensorDataset`` of random
data (batch 16) under ``Trainer(strategy=..., accelerator="cpu", devices=2)`` with the default callbacks (progress
bar on, model summary, checkpointing, logger in a temporary directory), for ``strategy="parallel_criterion"`` and
``strategy="dp"``. A callback turns ``sys.setprofile`` on for batch ``--batch-index`` (default 5: steady state) over
one of two windows:

- **period** (the headline): from the callback's ``on_train_batch_end`` of the previous batch to its
  ``on_train_batch_end`` of this one: exactly one iteration of the training loop, so everything the package does per
  step (the rest of the previous batch's end hooks, fetching the batch, ``batch_to_device``, the batch-start hooks,
  the strategy's ``optimizer_step`` with the closure's ``training_step`` and ``backward``, the optimizer, logging,
  properties such as ``root_device`` that Lightning reads);
- **optimizer_step**: the strategy's ``optimizer_step`` call alone (it runs the closure: ``training_step``,
  ``backward``, then the optimizer's step).

Counted, over Python ``call`` events whose code file lies inside the ``lightning_mgpu`` package: (a) **package
calls**; (b) distinct package functions (code objects); (c) distinct package modules; (d) **moves between modules**:
package calls, in call order, whose module differs from the previous package call's; (e) of those moves, the ones
that go to a module already left earlier in the window (**returns**). ``sys.setprofile`` traces the calling thread
only: on CPU devices both strategies run their replicas one after another on it (execution mode "auto" =
sequential), so the trace is the whole step. A generator's resumption is a ``call`` event too (counted; their number
is given). ::

    OMP_NUM_THREADS=1 python benchmarks/step_trace.py        # writes benchmarks/results/step_trace.md
"""

from __future__ import annotations

import argparse
import collections
import datetime
import dis
import importlib.metadata
import inspect
import json
import logging
import os
import platform
import shlex
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

# Run as a script: measure the checkout this file is in (not an installed copy), and import its sibling benchmark
# as benchmarks.host_overhead.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_mgpu  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PACKAGE_DIR = str(Path(lightning_mgpu.__file__).resolve().parent)
PACKAGE_PARENT = Path(PACKAGE_DIR).parent
GENERATOR_FLAGS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
RESUME = dis.opmap.get("RESUME", -1)
COMPREHENSIONS = ("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>")
STRATEGIES = ("parallel_criterion", "dp")
WINDOWS = ("period", "optimizer_step")
# An earlier version of the package, measured by the issue (one step under parallel_criterion).
HISTORICAL = {"package_calls": 288, "functions": 127, "modules": 16, "moves": 163, "returns": 147}


class MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Tracer:
    """``sys.setprofile`` function: keeps the package's call events, in order (code, and whether the event resumes a
    suspended generator rather than starting a call), and counts all Python call events."""

    def __init__(self) -> None:
        self.package_events: list[tuple[Any, bool]] = []
        self.all_calls = 0
        self._inside: dict[Any, bool] = {}

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        self.all_calls += 1
        code = frame.f_code
        inside = self._inside.get(code)
        if inside is None:
            inside = self._inside[code] = os.path.abspath(code.co_filename).startswith(PACKAGE_DIR + os.sep)
        if inside:
            self.package_events.append((code, bool(code.co_flags & GENERATOR_FLAGS) and resumes(frame)))

    def start(self) -> None:
        sys.setprofile(self)

    @staticmethod
    def stop() -> None:
        sys.setprofile(None)


def resumes(frame: Any) -> bool:
    """Whether a generator frame's ``call`` event resumes it after a ``yield``/``await`` (CPython >= 3.11: the frame
    stands at a ``RESUME`` whose argument is not 0); False where that cannot be told."""
    code, at = frame.f_code.co_code, frame.f_lasti
    return 0 <= at < len(code) - 1 and code[at] == RESUME and code[at + 1] != 0


class StepTrace(L.Callback):
    """Traces batch ``index`` over ``window`` (see the module's docstring)."""

    def __init__(self, index: int, window: str) -> None:
        self.index = index
        self.window = window
        self.tracer = Tracer()
        self.done = False

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if self.window != "optimizer_step" or idx != self.index:
            return
        strategy = trainer.strategy
        original = strategy.optimizer_step
        tracer = self.tracer

        def traced(*args: Any, **kwargs: Any) -> Any:
            tracer.start()
            try:
                return original(*args, **kwargs)
            finally:
                tracer.stop()
                del strategy.optimizer_step  # back to the class's method
                self.done = True

        strategy.optimizer_step = traced

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.window != "period":
            return
        idx = args[-1]
        if idx == self.index:
            self.tracer.stop()
            self.done = True
        elif idx == self.index - 1:
            self.tracer.start()


def module_of(code: Any) -> str:
    path = Path(os.path.abspath(code.co_filename)).relative_to(PACKAGE_PARENT).with_suffix("")
    parts = list(path.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def analyse(calls: list[tuple[str, str]], top: int = 15) -> dict[str, Any]:
    """Counts over package calls given in call order as ``(module, function)`` pairs."""
    moves = returns = 0
    left: set[str] = set()
    previous: str | None = None
    for module, _ in calls:
        if previous is not None and module != previous:
            moves += 1
            left.add(previous)
            if module in left:
                returns += 1
        previous = module
    per_function = collections.Counter(f"{m}.{f}" for m, f in calls)
    per_module = collections.Counter(m for m, _ in calls)
    return {
        "package_calls": len(calls),
        "functions": len(set(calls)),
        "modules": len(per_module),
        "moves": moves,
        "returns": returns,
        "top_functions": per_function.most_common(top),
        "calls_per_module": per_module.most_common(),
    }


def trace_step(strategy: str, window: str, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    steps = args.batch_index + 2
    g = torch.Generator().manual_seed(0)
    n = args.batch_size * steps
    data = TensorDataset(torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    trace = StepTrace(args.batch_index, window)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=2,
            max_steps=steps,
            default_root_dir=root,
            callbacks=[trace],
            enable_progress_bar=True,
        )
        trainer.fit(MLP(), DataLoader(data, batch_size=args.batch_size))
    Tracer.stop()
    if not trace.done:
        raise RuntimeError(f"{strategy}/{window}: batch {args.batch_index} was never traced")
    events = trace.tracer.package_events
    calls = [(module_of(c), c.co_qualname) for c, _ in events]
    result = analyse(calls, args.top)
    result["all_python_calls"] = trace.tracer.all_calls
    result["generator_resumptions"] = sum(1 for _, resumed in events if resumed)
    # Function calls proper: no generator resumptions, no comprehension frames (list/dict/set comprehensions are
    # frames of their own up to Python 3.11 and inlined from 3.12, PEP 709): comparable across Python versions.
    proper = [(module_of(c), c.co_qualname) for c, resumed in events if not resumed and c.co_name not in COMPREHENSIONS]
    result["function_calls_only"] = {k: v for k, v in analyse(proper, 0).items() if k != "top_functions"}
    result["strategy_class"] = type(trainer.strategy).__name__
    return result


def markdown(report: dict[str, Any]) -> str:
    env, cfg = report["environment"], report["config"]
    h = HISTORICAL
    lines = [
        "# Trace of one training step: the package's calls and moves between its modules",
        "",
        f"Command: `{report['command']}` ({report['wall_s']:.0f} s)  ",
        f"Date: {report['date']}  ",
        f"Machine: {env['cpu_model']}, {env['cpus']} CPUs of a shared virtual machine (counts do not depend on load)  ",
        f"torch {env['torch']}, lightning {env['lightning']}, Python {env['python']}; lightning_mgpu "
        f"{env['lightning_mgpu']} at {env['git']}",
        "",
        f"`Trainer(strategy=..., accelerator='cpu', devices=2)`, default callbacks, progress bar on; "
        "Linear(32, 64)-ReLU-Linear(64, 10), `F.cross_entropy`, `self.log('train_loss', loss, prog_bar=True)`, SGD; "
        f"batch {cfg['batch_size']} of random data; traced batch index {cfg['batch_index']} (steady state). "
        "`sys.setprofile`, `call` events of the main thread (CPU replicas run sequentially on it). **period** = one "
        "iteration of the training loop (the trace callback's `on_train_batch_end` of the previous batch to its "
        "`on_train_batch_end` of this one): everything the package does per step. **optimizer_step** = the "
        "strategy's `optimizer_step` call alone (closure: training_step + backward, then the optimizer).",
        "",
        "Moves = package calls in call order whose module differs from the previous package call's; returns = "
        "moves to a module already left earlier in the window.",
        "",
        "| strategy | window | **package calls** | functions | modules | **moves** | returns to a module already "
        "left | all Python calls | package share | of the package calls: generator resumptions |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| parallel_criterion (earlier version, historical reference) | one step | **{h['package_calls']}** | "
        f"{h['functions']} | {h['modules']} | **{h['moves']}** | {h['returns']} | - | - | - |",
    ]
    for key, r in report["traces"].items():
        strategy, window = key.split("/")
        lines.append(
            f"| {strategy} | {window} | **{r['package_calls']}** | {r['functions']} | {r['modules']} | "
            f"**{r['moves']}** | {r['returns']} | {r['all_python_calls']:,} | "
            f"{r['package_calls'] / max(r['all_python_calls'], 1):.1%} | {r['generator_resumptions']} |"
        )
    lines += [
        "",
        f"The historical reference: an earlier version of the package measured {h['package_calls']} package calls "
        f"through {h['functions']} functions in {h['modules']} modules, {h['moves']} moves of which {h['returns']} "
        "returned to a module already left (its window and Python version are not recorded; compare with care).",
        "",
        "The same counts over function calls proper: without generator resumptions (a `call` event for each "
        "`next()` of a suspended generator) and without comprehension / generator-expression frames (list, dict "
        "and set comprehensions are frames of their own up to Python 3.11, inlined from 3.12):",
        "",
        "| strategy | window | package calls | functions | modules | moves | returns |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, r in report["traces"].items():
        strategy, window = key.split("/")
        p = r["function_calls_only"]
        lines.append(
            f"| {strategy} | {window} | {p['package_calls']} | {p['functions']} | {p['modules']} | {p['moves']} | "
            f"{p['returns']} |"
        )
    for key, r in report["traces"].items():
        if not key.endswith("/period"):
            continue
        lines += [
            "",
            f"## {key.split('/')[0]}: top {len(r['top_functions'])} functions by calls (period window)",
            "",
            "| calls | function |",
            "|---|---|",
        ]
        lines += [f"| {count} | `{name}` |" for name, count in r["top_functions"]]
        lines += ["", "Calls per module: " + ", ".join(f"`{m}` {c}" for m, c in r["calls_per_module"]) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks.host_overhead import git_state, machine_info  # after ROOT is on sys.path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--windows", nargs="+", choices=WINDOWS, default=list(WINDOWS))
    parser.add_argument("--batch-index", type=int, default=5, help="the traced batch (>= 1)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--top", type=int, default=15, help="functions listed by call count")
    parser.add_argument("--out", type=Path, default=RESULTS / "step_trace.md", help="the markdown page")
    parser.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")
    parser.add_argument("--no-write", dest="write", action="store_false", help="print only")
    args = parser.parse_args(argv)
    if args.batch_index < 1:
        parser.error("--batch-index must be >= 1 (the period window starts at the previous batch)")
    torch.set_num_threads(1)
    lightning_logger = logging.getLogger("lightning.pytorch")
    level = lightning_logger.level
    lightning_logger.setLevel(logging.WARNING)  # quiet runs; restored after (main() also runs inside the tests)
    start = time.perf_counter()
    traces = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for strategy in args.strategies:
                for window in args.windows:
                    traces[f"{strategy}/{window}"] = trace_step(strategy, window, args)
    finally:
        lightning_logger.setLevel(level)
    report = {
        "command": "OMP_NUM_THREADS={} python benchmarks/step_trace.py{}".format(
            os.environ.get("OMP_NUM_THREADS", "<unset>"),
            "".join(" " + shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)),
        ),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "wall_s": time.perf_counter() - start,
        "config": {"batch_index": args.batch_index, "batch_size": args.batch_size, "devices": 2},
        "environment": {
            "cpu_model": machine_info()["cpu_model"],
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "lightning": importlib.metadata.version("lightning"),
            "lightning_mgpu": lightning_mgpu.__version__,
            "git": git_state(),
        },
        "historical_reference": HISTORICAL,
        "traces": traces,
    }
    text = markdown(report)
    print(text)
    if args.write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
