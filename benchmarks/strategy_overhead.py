"""Step-time overhead of ``parallel_criterion`` and ``dp`` against Lightning's default strategy, in one run.

Every configuration trains the same model on the same data with a Lightning ``Trainer``; a callback times each
training batch (``on_train_batch_start`` to ``on_train_batch_end``, synchronising CUDA). Configurations are
interleaved over several rounds so machine noise hits them alike; the figure is the median step time, and each
ratio divides two medians from this same run. Virtual devices (``--replicas 2`` on one device) share one physical
device: their ratio shows the cost of splitting, not a multi-GPU speed-up.

    python benchmarks/strategy_overhead.py                       # CPU
    python benchmarks/strategy_overhead.py --accelerator gpu     # one GPU, plus two replicas on it
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu

RESULTS = Path(__file__).resolve().parent / "results"


class StepTimer(L.Callback):
    """Wall time of every training batch, after a warm-up."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self._start = 0.0

    def _sync(self, trainer: L.Trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._sync(trainer)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._sync(trainer)
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._start)


class MLPClassifier(L.LightningModule):
    def __init__(self, width: int, depth: int, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def _strategy(name: str, replicas: int, device: torch.device) -> Any:
    if name in ("auto", "control"):
        return "auto"
    cls = (
        lightning_mgpu.ParallelCriterionStrategy
        if name == "parallel_criterion"
        else lightning_mgpu.DataParallelStrategy
    )
    return cls(parallel_devices=[device] * replicas)


def run_config(name: str, replicas: int, args: argparse.Namespace, data: TensorDataset) -> list[float]:
    device = torch.device("cuda", 0) if args.accelerator == "gpu" else torch.device("cpu")
    torch.manual_seed(0)
    model = MLPClassifier(args.width, args.depth)
    timer = StepTimer(args.warmup)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=1,
        strategy=_strategy(name, replicas, device),
        max_steps=args.steps + args.warmup,
        precision=args.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(model, DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True))
    return timer.times


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per round and configuration")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: results/strategy_overhead_<dev>)")
    args = parser.parse_args(argv)
    torch.set_float32_matmul_precision("high")

    n = args.batch_size * (args.steps + args.warmup + 1)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, args.width, generator=g), torch.randint(0, 10, (n,), generator=g))
    configs = [("auto", 1), ("control", 1), ("parallel_criterion", 1), ("dp", 1), ("parallel_criterion", 2), ("dp", 2)]
    times: dict[str, list[float]] = {f"{name}x{r}": [] for name, r in configs}
    for round_index in range(args.rounds):
        order = configs if round_index % 2 == 0 else configs[::-1]
        for name, replicas in order:
            step_times = run_config(name, replicas, args, data)
            times[f"{name}x{replicas}"].append(statistics.median(step_times))
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    baseline = statistics.median(times["autox1"])
    device_name = torch.cuda.get_device_name(0) if args.accelerator == "gpu" else platform.processor() or "cpu"
    rows = []
    for key, medians in times.items():
        name, replicas = key.rsplit("x", 1)
        median = statistics.median(medians)
        rows.append(
            {
                "strategy": {"auto": "auto (Lightning default)", "control": "auto again (A/A control)"}.get(name, name),
                "replicas": int(replicas),
                "median_step_ms": round(median * 1e3, 4),
                "ratio_vs_default": round(median / baseline, 4),
                "median_paired_ratio": round(
                    statistics.median(m / b for m, b in zip(medians, times["autox1"], strict=True)), 4
                ),
                "round_medians_ms": [round(m * 1e3, 4) for m in medians],
            }
        )
    report = {
        "benchmark": "strategy_overhead",
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "device": device_name,
        "accelerator": args.accelerator,
        "cpu_threads": torch.get_num_threads(),
        "virtual_devices_note": "replicas > 1 run on ONE physical device (virtual devices): a cost of splitting, "
        "not a multi-GPU speed-up",
        "versions": {
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "python": platform.python_version(),
        },
        "config": vars(args) | {"out": str(args.out) if args.out else None},
        "rows": rows,
        "target": "devices=1: parallel_criterion and dp <= 1.03x the default strategy",
    }
    out = args.out or RESULTS / f"strategy_overhead_{args.accelerator}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# Strategy overhead ({device_name}, {args.accelerator})",
        "",
        f"Command: `{report['command']}`  ",
        f"torch {torch.__version__}, lightning {lightning.__version__}. Medians of {args.rounds} interleaved rounds "
        f"of {args.steps} timed steps; MLP {args.depth}x{args.width}, batch {args.batch_size}, {args.precision}.  ",
        "Replicas > 1 are virtual devices on ONE physical device: the ratio is the cost of splitting the batch.",
        "",
        "Paired ratio: each round's median over the default strategy's median in the same round, then the median of",
        "those ratios (it cancels the machine's drift between rounds). The control row runs the default strategy again",
        "as if it were another configuration: its distance from 1.000 is the noise floor of this run.",
        "",
        "| strategy | replicas | median step (ms) | ratio of medians | median paired ratio |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['strategy']} | {r['replicas']} | {r['median_step_ms']:.3f} | {r['ratio_vs_default']:.3f} "
        f"| {r['median_paired_ratio']:.3f} |"
        for r in rows
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return report


if __name__ == "__main__":
    main()
