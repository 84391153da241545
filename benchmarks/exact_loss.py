"""What ``ExactLoss`` costs within one process: training-batch time with and without the callback, in one run.

A token model (embedding, two layers, per-token logits) trains with a mean over non-ignored tokens, with gradient
accumulation (where the callback acts). A timer callback measures every training batch (``on_train_batch_start`` to
``on_train_batch_end``, which includes backward and, on a window's last batch, the optimizer step with the
callback's one gradient division). Configurations alternate over rounds so machine noise hits them alike; the
figures are medians, and the ratio divides two medians of this run. Also timed alone: reading one micro-batch's rule
from its loss (``read_rule``) and dividing the gradients (``scale_gradients``). Across processes the callback adds
one scalar all-reduce per optimizer step (counted by ``tests/callbacks/test_exact_loss.py``), not timed here.

    python benchmarks/exact_loss.py                 # CPU, writes benchmarks/results/exact_loss_cpu.{json,md}
    python benchmarks/exact_loss.py --accelerator gpu
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
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu.callbacks.exact_loss import ExactLoss, read_rule, scale_gradients

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its sibling scripts
from strategy_overhead import StepTimer

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = {  # name: (vocab, width, sequence length, batch size)
    "tiny": (64, 16, 16, 8),
    "small": (2000, 128, 64, 16),
}


class TimedExactLoss(ExactLoss):
    """``ExactLoss`` whose hooks time themselves: the callback's own cost, which the batch medians (noisy on a
    shared machine) bound only loosely. The pre-hooks it puts run inside backward and are not in these figures."""

    def __init__(self) -> None:
        super().__init__()
        self.hook_times: dict[str, list[float]] = {}

    def _timed(self, name: str, *args: Any) -> None:
        start = time.perf_counter()
        getattr(super(), name)(*args)
        self.hook_times.setdefault(name, []).append(time.perf_counter() - start)

    def on_train_batch_start(self, *args: Any) -> None:
        self._timed("on_train_batch_start", *args)

    def on_before_backward(self, *args: Any) -> None:
        self._timed("on_before_backward", *args)

    def on_before_optimizer_step(self, *args: Any) -> None:
        self._timed("on_before_optimizer_step", *args)


class TokenModel(L.LightningModule):
    """Embedding, two tanh layers, per-token logits; the loss is a mean over non-ignored tokens."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.net = nn.Sequential(
            nn.Embedding(vocab, width), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh()
        )
        self.head = nn.Linear(width, vocab)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self.head(self.net(tokens))
        loss = F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def token_data(vocab: int, length: int, n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (n, length), generator=g)
    targets = torch.randint(0, vocab, (n, length), generator=g)
    lengths = torch.randint(1, length + 1, (n,), generator=g)
    targets[torch.arange(length) >= lengths[:, None]] = -100
    return TensorDataset(tokens, targets)


def run_once(size: str, exact: bool, args: argparse.Namespace, hooks: dict[str, list[float]]) -> list[float]:
    """One fit; returns every timed batch's seconds and adds the callback's hook times to ``hooks``."""
    vocab, width, length, batch = SIZES[size]
    torch.manual_seed(0)
    timer = StepTimer(args.warmup)
    exact_loss = TimedExactLoss()
    steps = args.warmup + args.steps
    data = DataLoader(token_data(vocab, length, steps * args.accumulate * batch), batch_size=batch)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=args.accumulate,
        callbacks=[timer, *([exact_loss] if exact else [])],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TokenModel(vocab, width), data)
    for name, values in exact_loss.hook_times.items():
        hooks.setdefault(name, []).extend(values)
    return timer.times


def microbenchmarks(size: str, accumulate: int, device: torch.device, repeats: int = 200) -> dict[str, float]:
    """Median microseconds: reading one micro-batch's rule; dividing every gradient once."""
    vocab, width, length, batch = SIZES[size]
    model = TokenModel(vocab, width).to(device)
    tokens, targets = (t.to(device) for t in token_data(vocab, length, batch).tensors)
    logits = model.head(model.net(tokens))
    loss = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1)) / accumulate
    loss.backward(retain_graph=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scale = torch.tensor(0.5, dtype=torch.float64, device=device)
    figures = {}
    for name, work in (
        ("read_rule_us", lambda: read_rule(loss, batch)),
        ("scale_gradients_us", lambda: scale_gradients(optimizer, scale)),
    ):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            work()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        figures[name] = statistics.median(times) * 1e6
    return figures


def measure(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    device = torch.device("cuda" if args.accelerator == "gpu" else "cpu")
    for size in args.sizes:
        times: dict[str, list[float]] = {"lightning": [], "exact_loss": []}
        hooks: dict[str, list[float]] = {}
        for round_ in range(args.rounds):  # alternating: each round runs both, first one then the other first
            for name in list(times)[:: 1 if round_ % 2 == 0 else -1]:
                times[name] += run_once(size, name == "exact_loss", args, hooks)
        medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
        hook_us = {name: statistics.median(values) * 1e6 for name, values in hooks.items()}
        batches = len(hooks["on_train_batch_start"])
        results[size] = {
            "shape": dict(zip(("vocab", "width", "length", "batch"), SIZES[size], strict=True)),
            "batches_timed": {name: len(values) for name, values in times.items()},
            "median_batch_ms": medians,
            "ratio": medians["exact_loss"] / medians["lightning"],
            "added_us_per_batch": (medians["exact_loss"] - medians["lightning"]) * 1e3,
            "hook_median_us": hook_us,
            "hooks_us_per_batch": sum(sum(values) for values in hooks.values()) / batches * 1e6,
            **microbenchmarks(size, args.accumulate, device),
        }
    return results


def markdown(report: dict[str, Any]) -> str:
    setup = report["setup"]
    lines = [
        "# ExactLoss: training-batch time with and without the callback",
        "",
        f"`{setup['command']}` on {setup['machine']} ({setup['device']}), torch {setup['torch']}, Lightning "
        f"{setup['lightning']}; accumulate_grad_batches={setup['accumulate']}, {setup['rounds']} rounds (alternating "
        f"which runs first) of {setup['steps']} optimizer steps each (after {setup['warmup']} warm-up steps); "
        "medians of every training batch (forward, backward and, on a window's last batch, the optimizer step).",
        "",
        "| model (vocab, width, length, batch) | Lightning ms | with ExactLoss ms | ratio | added µs / batch "
        "| callback's hooks µs / batch | on_before_backward µs | on_before_optimizer_step µs | read_rule µs "
        "| scale_gradients µs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size, r in report["results"].items():
        shape = ", ".join(str(v) for v in r["shape"].values())
        m = r["median_batch_ms"]
        lines.append(
            f"| {size} ({shape}) | {m['lightning']:.3f} | {m['exact_loss']:.3f} | {r['ratio']:.3f} "
            f"| {r['added_us_per_batch']:.0f} | {r['hooks_us_per_batch']:.0f} "
            f"| {r['hook_median_us']['on_before_backward']:.0f} "
            f"| {r['hook_median_us']['on_before_optimizer_step']:.0f} "
            f"| {r['read_rule_us']:.0f} | {r['scale_gradients_us']:.0f} |"
        )
    lines += [
        "",
        "Within one process the callback adds the reader (`read_rule`, once per micro-batch), a node pre-hook per "
        "micro-batch and one gradient division per optimizer step (`scale_gradients`); across processes, one "
        "scalar all-reduce per optimizer step (plus one on the first micro-batch to agree on the rule). The batch "
        "medians carry the machine's noise (a shared 2-core machine moves them by several percent); the callback's "
        "own cost is the hooks' time, measured inside the same runs (medians per call; per batch: their total over "
        "the timed batches), beside the reader and the gradient division timed alone.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--output", type=Path, default=None, help="JSON path (default: results/exact_loss_<device>)")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    report = {
        "setup": {
            "command": " ".join(["python benchmarks/exact_loss.py", *(sys.argv[1:] if argv is None else argv)]),
            "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
            "device": torch.cuda.get_device_name() if args.accelerator == "gpu" else "cpu",
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            **{k: getattr(args, k) for k in ("accumulate", "steps", "warmup", "rounds")},
        },
        "results": measure(args),
    }
    output = args.output or RESULTS / f"exact_loss_{'cuda' if args.accelerator == 'gpu' else 'cpu'}.json"
    output.write_text(json.dumps(report, indent=2) + "\n")
    output.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
