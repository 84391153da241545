"""Host time of the per-step replica sync and gradient reduction inside real training steps, and its floor.

Issue 18's target: sync + reduction < 1 ms of host time per step for PyramidNet-272 (997 parameter tensors, 1,086
buffers, 728 modules) at N = 8. The synthetic figure of ``replica_overhead.py`` part 5 (meta device, caches evicted by
Python code) is one model of "in a step"; this script times the same calls inside real steps:

1. **In real steps.** ``DataParallelModel`` + ``DataParallelCriterion`` training steps of PyramidNet-272 on N virtual
   CPU devices (``execution_mode="threads"``, the path distinct GPUs take), tiny images so that the step is quick, and
   by default with the widening factor ``--alpha 8`` instead of 200: the same 728 modules, 997 parameter tensors and
   1,086 buffers, so the same host work, but little data, so that the reduction's additions (on a GPU, kernels that
   the host only launches) do not swamp the host time on this CPU. The
   strategy's own calls are timed where they run: ``ReplicaSet.execution_mode`` + ``prepare`` (the sync, before the
   forward) and ``ReplicaParameters.reduce`` (after the backward pass), so the forward and backward passes between
   them leave the CPU caches as a real step leaves them. ``ReplicaSet.watch`` (right after the forward: the second
   half of the check for parameters changed in place, and the gradient hooks) counts with the sync.
2. **The floor.** The checks the sync must make read every module's attribute dicts, every parameter and every buffer
   once per step (a structural change, a rebound attribute, an optimizer replacing tensors, ``requires_grad`` flips,
   in-place changes). One C-level pass over each set, timed right after a real step (cold caches) and back to back
   (warm), is the least any such check costs in Python.

    python benchmarks/sync_in_step.py [--replicas 8] [--steps 12] [--out benchmarks/results/sync_in_step_cpu]
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.replica_overhead import cpu_model  # noqa: E402
from lightning_mgpu import DataParallelCriterion, DataParallelModel  # noqa: E402
from lightning_mgpu.parallel import replicas  # noqa: E402
from recipes.pyramidnet.model import PYRAMIDNET_CONFIGS, PyramidNet  # noqa: E402

MODEL = "pyramidnet272_bottleneck_a200"


class Timers:
    """Wraps methods of a class so that each call's wall-clock time is recorded under a phase name."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {}

    def wrap(self, cls: type, name: str, phase: str) -> None:
        original = getattr(cls, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.current[phase] = self.current.get(phase, 0.0) + time.perf_counter() - start

        setattr(cls, name, timed)


def in_real_steps(n: int, steps: int, warmup: int, alpha: int) -> dict[str, Any]:
    torch.manual_seed(0)
    net = PyramidNet(**{**PYRAMIDNET_CONFIGS[MODEL].kwargs(), "alpha": alpha})
    model = DataParallelModel(net, ["cpu"] * n, execution_mode="threads")
    criterion = DataParallelCriterion(nn.CrossEntropyLoss(), ["cpu"] * n)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(2 * n, 3, 8, 8)
    y = torch.randint(0, 10, (2 * n,))
    timers = Timers()
    timers.wrap(replicas.ReplicaSet, "execution_mode", "sync")
    timers.wrap(replicas.ReplicaSet, "prepare", "sync")
    timers.wrap(replicas.ReplicaSet, "watch", "sync")  # the in-place check's second half, after the forward
    timers.wrap(replicas.ReplicaParameters, "reduce", "reduce")
    rows = []
    for step in range(warmup + steps):
        timers.current = {}
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        total = time.perf_counter() - start
        if step >= warmup:
            rows.append({**timers.current, "step": total})
    floor = pass_floor(model, net, x, y, criterion, optimizer)
    median = {key: statistics.median(row[key] for row in rows) * 1e6 for key in rows[0]}
    return {
        "replicas": n,
        "alpha": alpha,
        "parameters": sum(p.numel() for p in net.parameters()),
        "modules": sum(1 for _ in net.modules()),
        "parameter_tensors": sum(1 for _ in net.parameters()),
        "buffer_tensors": sum(1 for _ in net.buffers()),
        "median_us": median,
        "sync_plus_reduce_us": [(row["sync"] + row["reduce"]) * 1e6 for row in rows],
        "floor_us": floor,
    }


def pass_floor(model: Any, net: nn.Module, x: Any, y: Any, criterion: Any, optimizer: Any) -> dict[str, Any]:
    """One C-level pass over each set a complete check must read, right after a real step and back to back."""
    modules = list(net.modules())
    dicts = [d for m in modules for d in (m.__dict__, m._parameters, m._buffers, m._modules)]
    saved = [d.copy() for d in dicts]
    params = list(net.parameters())
    buffers = list(net.buffers())
    version = operator.attrgetter("_version")
    passes = {
        "module dicts (==)": lambda: dicts == saved,
        "parameters (_version)": lambda: sum(map(version, params)),
        "buffers (_version)": lambda: sum(map(version, buffers)),
    }
    result: dict[str, Any] = {}
    for name, fn in passes.items():
        cold, warm = [], []
        for _ in range(5):
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
            start = time.perf_counter()
            fn()
            cold.append(time.perf_counter() - start)
            for _ in range(3):
                start = time.perf_counter()
                fn()
                warm.append(time.perf_counter() - start)
        result[name] = {"cold": statistics.median(cold) * 1e6, "warm": statistics.median(warm) * 1e6}
    return result


def markdown(report: dict[str, Any]) -> str:
    r = report["result"]
    m = r["median_us"]
    lines = [
        "# Replica sync + gradient reduction inside real steps (issue 18), CPU",
        "",
        f"- machine: {report['machine']}; torch {report['torch']}, Python {report['python']}, OMP_NUM_THREADS=1",
        f"- command: `{report['command']}` ({report['seconds']:.0f} s); code: {report['revision']}",
        f"- model: {MODEL} with alpha={r['alpha']} ({r['parameters']:,} parameters), {r['modules']} modules, "
        f"{r['parameter_tensors']} parameter tensors, "
        f"{r['buffer_tensors']} buffers; {r['replicas']} replicas on virtual CPU devices (one CPU runs them all), "
        "`execution_mode='threads'`, images 3x8x8, 2 per replica, SGD with momentum.",
        "",
        "## 1. In real steps (medians over steps, µs)",
        "",
        "| step (wall) | sync: execution_mode + prepare + watch | reduce | **sync + reduce** |",
        "|---|---|---|---|",
        f"| {m['step']:,.0f} | {m['sync']:,.0f} | {m['reduce']:,.0f} | "
        f"**{statistics.median(r['sync_plus_reduce_us']):,.0f}** |",
        "",
        "Target < 1,000 µs. Per step (µs): " + ", ".join(f"{v:,.0f}" for v in r["sync_plus_reduce_us"]),
        "",
        "## 2. The floor: one C-level pass over each set a complete check reads (µs, medians)",
        "",
        "| pass | right after a real step | back to back |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {v['cold']:,.0f} | {v['warm']:,.0f} |" for name, v in r["floor_us"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--alpha", type=int, default=8, help="widening factor (the named model's is 200)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/sync_in_step_cpu"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    result = in_real_steps(args.replicas, args.steps, args.warmup, args.alpha)
    import subprocess

    revision = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    report = {
        "machine": f"{cpu_model()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": "python " + " ".join(["benchmarks/sync_in_step.py", *sys.argv[1:]]),
        "revision": revision,
        "seconds": time.perf_counter() - start,
        "result": result,
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
