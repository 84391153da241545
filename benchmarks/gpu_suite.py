"""One command for a machine with a GPU: the CUDA tests, then replica throughput, host/device time and memory.

    python benchmarks/gpu_suite.py                 # on a GPU machine (stops starting stages after --budget-s 510)
    python benchmarks/gpu_suite.py --no-compile    # about 2.5 minutes on one H200 (compiling PyramidNet takes 2)
    python benchmarks/gpu_suite.py --smoke --device cpu   # the same protocol, tiny, on the CPU (tests run this)

It runs, in order, and writes what it found to ``benchmarks/results/gpu_suite_<device>.{json,md}`` with the device,
the versions and the command, after every stage (a run cut short keeps what it measured):

1. ``pytest -m cuda`` (every test that needs a GPU; skipped tests are counted, not hidden);
2. training throughput of one device, of N shards run one after another on it without a wrapper (the ceiling for
   N virtual replicas on one device), and of N virtual replicas (``DataParallelModel`` + ``DataParallelCriterion``
   on the one device repeated, threads mode), N = 2 and 4, eager and ``torch.compile``-d, on the seed PyramidNet
   and the recipe's small BERT (masked LM over full logits);
3. per configuration, host time against device time per step: host time is the step's wall time with 2 samples
   per replica (the device's work is then negligible; timing the host at the real batch measures the device, since
   the host waits once the launch queue is full), device time the CUDA-event time of the step at the real batch;
4. per configuration, the device's peak allocated memory.

Steps are timed in windows (the device synchronised at window boundaries only); each figure is the median window.
A stage that would overrun ``--budget-s`` is skipped and listed as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: make `lightning_mgpu` and `recipes` importable
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from lightning_mgpu.parallel import DataParallelCriterion, DataParallelModel  # noqa: E402


# --- models -----------------------------------------------------------------------------------------------------------
class BertMLM(nn.Module):
    """The recipe's BERT with its MLM head over every position: one tensor out, so any criterion takes it."""

    def __init__(self, **config: Any) -> None:
        super().__init__()
        from recipes.bert.model import BertPretrainingModel

        self.model = BertPretrainingModel(full_logits=True, dropout=0.0, attention_dropout=0.0, **config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids).mlm_logits


class TokenCrossEntropy(nn.CrossEntropyLoss):
    """Cross-entropy over ``(batch, seq, vocab)`` logits; its ``ignore_index`` tells the criterion how to weigh."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(logits.flatten(0, 1), labels.flatten())


def workload(
    name: str, smoke: bool, device: torch.device, batch: int | None = None
) -> tuple[nn.Module, nn.Module, Any, int]:
    """(model, criterion, one batch (inputs, targets) on ``device``, samples per batch); ``batch`` overrides the
    workload's own batch size."""
    g = torch.Generator().manual_seed(0)
    if name == "pyramidnet":
        from recipes.pyramidnet.model import build_pyramidnet

        batch = batch or (8 if smoke else 128)
        model = build_pyramidnet("tiny" if smoke else "seed")
        data = (torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g))
        criterion: nn.Module = nn.CrossEntropyLoss()
    else:
        seq = 16 if smoke else 128
        batch = batch or (8 if smoke else 128)
        config = dict(vocab_size=512, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64) if smoke else {}
        model = BertMLM(**config)
        vocab = model.model.config.vocab_size
        tokens = torch.randint(1, vocab, (batch, seq), generator=g)
        labels = torch.where(torch.rand(batch, seq, generator=g) < 0.15, tokens, torch.full_like(tokens, -100))
        data = (tokens, labels)
        criterion = TokenCrossEntropy()
    return model.to(device), criterion, tuple(t.to(device) for t in data), batch


# --- timing -----------------------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


KINDS = {
    "one device": "the plain module on the whole batch",
    "shards": "the plain module run on the N shards one after another in one step, no wrapper: the least work N "
    "virtual replicas on one device can do (the ceiling for the replicas' throughput there)",
    "replicas": "DataParallelModel + DataParallelCriterion on the one device repeated N times, threads mode",
}


def _step_function(
    kind: str, replicas: int, compiled: bool, name: str, smoke: bool, device: torch.device, batch: int | None
) -> tuple[Any, int]:
    """A training step of ``kind`` (see ``KINDS``) and its samples per step."""
    torch.manual_seed(0)
    model, criterion, (x, y), samples = workload(name, smoke, device, batch)
    model.train()
    if compiled:
        model.compile()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if kind == "replicas":
        devices = [device] * replicas
        net = DataParallelModel(model, devices, execution_mode="threads")
        loss_fn = DataParallelCriterion(criterion, devices, execution_mode="threads", weight_fn=lambda o, t: len(t[0]))
    shards = list(zip(x.chunk(replicas), y.chunk(replicas), strict=True))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        if kind == "replicas":
            loss_fn(net(x), y).backward()
        elif kind == "shards":
            for xs, ys in shards:
                (criterion(model(xs), ys) * (len(xs) / samples)).backward()
        else:
            criterion(model(x), y).backward()
        optimizer.step()

    return step, samples


def _timed_windows(step: Any, device: torch.device, windows: int, steps: int) -> tuple[list[float], list[float]]:
    """Wall seconds per step of each window (the device synchronised at window boundaries only) and CUDA-event
    seconds of every step (empty on the CPU)."""
    for _ in range(3):  # warm-up (and compilation)
        step()
    _sync(device)
    walls, device_time = [], []
    for _ in range(windows):
        _sync(device)
        events = []
        window_start = time.perf_counter()
        for _ in range(steps):
            if device.type == "cuda":
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            step()
            if device.type == "cuda":
                end.record()
                events.append((begin, end))
        _sync(device)
        walls.append((time.perf_counter() - window_start) / steps)
        device_time += [begin.elapsed_time(end) / 1e3 for begin, end in events]
    return walls, device_time


def measure(
    name: str, kind: str, replicas: int, compiled: bool, device: torch.device, smoke: bool, windows: int, steps: int
) -> dict[str, Any]:
    """Throughput, host and device time per step and peak memory of one configuration.

    Host time is the wall time of the same step with 2 samples per replica: the device's work is then negligible
    and the step waits on the host's launches alone (at the real batch the launch queue fills and the host waits on
    the device, so timing the host there measures the device). Device time is the CUDA-event time at the real batch
    (on the CPU: wall time)."""
    cuda = device.type == "cuda"
    started = time.perf_counter()
    step, batch = _step_function(kind, replicas, compiled, name, smoke, device, None)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    walls, device_time = _timed_windows(step, device, windows, steps)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
    del step
    probe, _ = _step_function(kind, replicas, compiled, name, smoke, device, 2 * replicas)
    host, _ = _timed_windows(probe, device, windows, steps)
    del probe
    device_ms = statistics.median(device_time if cuda else walls) * 1e3
    host_ms = statistics.median(host) * 1e3
    return {
        "model": name,
        "kind": kind,
        "replicas": replicas,
        "compiled": compiled,
        "samples_per_s": batch / statistics.median(walls),
        "host_ms_per_step": host_ms,
        "device_ms_per_step": device_ms,
        "host_to_device": host_ms / device_ms,
        "peak_allocated_mb": peak,
        "seconds": time.perf_counter() - started,
    }


# --- stages -----------------------------------------------------------------------------------------------------------
def run_cuda_tests(smoke: bool, timeout_s: float, log: Path) -> dict[str, Any]:
    """``pytest -m cuda`` in a subprocess, its whole output kept in ``log``; with ``--smoke`` only its collection
    (nothing to run without a GPU)."""
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-n", "0", "-m", "cuda", "-p", "no:cacheprovider"]
    command += ["--co", "tests/parallel/test_cuda.py"] if smoke else ["tests"]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # keep carried packages
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        partial = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else err.stdout or ""
        code, output = None, f"timed out after {timeout_s:.0f} s\n{partial}"
    log.write_text(output)
    lines = [line for line in output.splitlines() if line.strip()]
    return {
        "command": " ".join(shlex.quote(c) for c in command),
        "returncode": code,
        "summary": lines[-1] if lines else "",
        "tail": lines[-30:],
        "seconds": time.perf_counter() - started,
        "log": log.name,
    }


def versions(device: torch.device) -> dict[str, Any]:
    import lightning

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "cuda": torch.version.cuda,
        "commit": _git(["rev-parse", "--short", "HEAD"]),
        "uncommitted": bool(_git(["status", "--porcelain", "lightning_mgpu"])),
    }
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["driver_capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    else:
        info["device_name"] = platform.processor() or platform.machine()
        info["cpu_count"] = os.cpu_count()
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


def _git(args: list[str]) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""


def markdown(report: dict[str, Any]) -> str:
    v = report["versions"]
    lines = [
        f"# GPU suite: {v['device_name']} ({report['device']})",
        "",
        f"- command: `{report['command']}` ({report['seconds']:.0f} s)",
        f"- torch {v['torch']}, Lightning {v['lightning']}, transformers {v['transformers']}, CUDA {v['cuda']}, "
        f"Python {v['python']}, commit {v['commit']}{' (uncommitted changes)' if v['uncommitted'] else ''}",
        "",
    ]
    tests = report.get("cuda_tests")
    if tests:
        lines += ["## 1. `pytest -m cuda`", "", f"`{tests['command']}`: {tests['summary']}", ""]
    rows = report.get("runs", [])
    if rows:
        lines += [
            "## 2-4. Throughput, host vs device time, peak memory",
            "",
            *(f"- **{kind}**: {text}" for kind, text in KINDS.items()),
            "- ratios: samples/s against one device, and against the N shards, of the same model and compile setting;",
            "- host ms: the step's wall time with 2 samples per replica (the device's work negligible, the step waits "
            "on the host's launches); device ms: CUDA-event time of the step at the real batch (CPU: wall time); "
            "host/device below 1/3 means one process can feed the devices with room to spare;",
            "- peak MiB: the device's peak allocated memory during the timed steps.",
            "",
            "| model | compiled | kind | N | samples/s | ratio to 1 device | ratio to N shards | host ms/step | "
            "device ms/step | host/device | peak MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        by = {(r["model"], r["compiled"], r["kind"], r["replicas"]): r for r in rows}
        for r in rows:
            one = by.get((r["model"], r["compiled"], "one device", 1))
            shards = by.get((r["model"], r["compiled"], "shards", r["replicas"]))
            to_one = f"{r['samples_per_s'] / one['samples_per_s']:.3f}" if one else "-"
            to_shards = f"{r['samples_per_s'] / shards['samples_per_s']:.3f}" if shards else "-"
            peak = r["peak_allocated_mb"]
            lines.append(
                f"| {r['model']} | {r['compiled']} | {r['kind']} | {r['replicas']} | {r['samples_per_s']:.1f} | "
                f"{to_one} | {to_shards} | {r['host_ms_per_step']:.2f} | {r['device_ms_per_step']:.2f} | "
                f"{r['host_to_device']:.2f} | {'-' if peak is None else f'{peak:.0f}'} |"
            )
    if report.get("skipped"):
        lines += ["", "Skipped (time budget): " + ", ".join(report["skipped"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny models and few steps (checks the protocol)")
    parser.add_argument("--models", nargs="+", default=["pyramidnet", "bert"], choices=["pyramidnet", "bert"])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--no-tests", dest="tests", action="store_false")
    parser.add_argument("--windows", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="steps per window")
    parser.add_argument("--budget-s", type=float, default=510.0, help="skip stages that would start after this")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    windows = args.windows or (2 if args.smoke else 5)
    steps = args.steps or (2 if args.smoke else 10)
    started = time.perf_counter()
    out = args.out or ROOT / "benchmarks" / "results" / f"gpu_suite_{'smoke_' if args.smoke else ''}{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "benchmark": "gpu_suite",
        "device": str(device),
        "smoke": args.smoke,
        "command": "python " + " ".join(shlex.quote(a) for a in (sys.argv if argv is None else ["gpu_suite", *argv])),
        "versions": versions(device),
        "runs": [],
        "skipped": [],
    }

    def save() -> None:
        report["seconds"] = time.perf_counter() - started
        out.write_text(json.dumps(report, indent=2) + "\n")
        out.with_suffix(".md").write_text(markdown(report))

    if args.tests:
        report["cuda_tests"] = run_cuda_tests(args.smoke, max(60.0, args.budget_s / 2), out.with_suffix(".pytest.log"))
        save()
    for compiled in [False, True] if args.compile else [False]:
        for name in args.models:
            configurations = [("one device", 1)] if 1 in args.replicas else []
            configurations += [(kind, n) for n in args.replicas if n > 1 for kind in ("shards", "replicas")]
            for kind, n in configurations:
                label = f"{name} {kind} N={n}{' compiled' if compiled else ''}"
                if time.perf_counter() - started > args.budget_s:
                    report["skipped"].append(label)
                    continue
                report["runs"].append(measure(name, kind, n, compiled, device, args.smoke, windows, steps))
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # the next configuration's peak starts from its own allocations
                print(json.dumps(report["runs"][-1]), flush=True)
                save()
    save()
    print(markdown(report))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return report


if __name__ == "__main__":
    main()
