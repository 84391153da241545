"""Issue 33: step time of a small MLP under each strategy, and the per-step cost of the loss rule read from the record.

Two measurements in one run, on the CPU:

1. **Step time of a small MLP** (Linear(32, 64)-ReLU-Linear(64, 64)-ReLU-Linear(64, 10), ``F.cross_entropy`` written
   in ``training_step``, ``self.log("train_loss", loss)``, Adam, float32, batches of 64 random samples: the same
   batches, in the same order, for every run) under ``strategy="parallel_criterion"`` and ``strategy="dp"`` with
   ``accelerator="cpu", devices=2`` against Lightning's default strategy with ``devices=1``. Trainers keep their
   defaults (progress bar, model summary, checkpointing, logger, under a temporary ``default_root_dir``); the same
   three runs are repeated with the progress bar off. A callback records, for every training batch, the time from one
   ``on_train_batch_start`` to the next (**interval**: everything a user waits on per step: fetching the batch, the
   step, backward, the optimizer, logging and the bar) and from ``on_train_batch_start`` to ``on_train_batch_end``
   (**hooks**); the first ``--warmup`` steps are discarded. Rounds alternate the order of the runs so machine noise
   hits them alike; a run's figure is its median step, a configuration's the median over rounds, and each ratio
   divides two figures of this same run (also given: the median over rounds of the per-round ratio). On CPU virtual
   devices the two replicas run one after another on the same core(s): the compute equals one device's on the whole
   batch, so the ratio is the host overhead of the strategy (splitting, replicas, reading and combining the loss,
   logging), not a multi-device speed-up.
2. **The per-step cost of the loss rule** on BERT pre-training's loss (MLM over masked tokens + NSP over sequences)
   from a tiny ``transformers.BertForPreTraining`` (built from a ``BertConfig``, nothing downloaded): the batch is
   split into 2 and 3 shards with ``torch.tensor_split``, each shard runs forward with ``labels`` and
   ``next_sentence_label``; then timed: ``read_loss`` on every shard plus ``combine_losses_by_record`` (what
   ``parallel_criterion`` does every training step). Each repetition runs a fresh forward (combining registers
   gradient pre-hooks on the graph's nodes), which is not timed. ``coupling(loss, shard_size)`` (run once per shape
   of the loss's graph in training) is timed separately. Correctness: the combined loss against the whole batch's loss
   in float32 and float64, and the parameters' gradients after backward of the combined loss against the whole
   batch's in float64.

    OMP_NUM_THREADS=1 python benchmarks/loss_rule.py     # writes benchmarks/results/loss_rule_cpu.{json,md}
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as L
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu  # noqa: F401 - registers "parallel_criterion" and "dp"
from lightning_mgpu.parallel.loss_combine import combine_losses_by_record
from lightning_mgpu.parallel.loss_coupling import coupling
from lightning_mgpu.parallel.loss_graph import read_loss

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = [("auto", 1), ("parallel_criterion", 2), ("dp", 2)]  # (strategy, devices)


# ----------------------------------------------------------------------------------------------- 1. MLP step time
class StepTimer(L.Callback):
    """Per training batch: start-to-start interval and start-to-end hook time, after ``warmup`` batches."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.starts: list[float] = []
        self.cpu_starts: list[float] = []
        self.hooks: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.thread_time())

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.hooks.append(time.perf_counter() - self.starts[-1])

    def intervals(self) -> list[float]:
        return [b - a for a, b in zip(self.starts[self.warmup : -1], self.starts[self.warmup + 1 :], strict=True)]

    def cpu_intervals(self) -> list[float]:
        return [
            b - a for a, b in zip(self.cpu_starts[self.warmup : -1], self.cpu_starts[self.warmup + 1 :], strict=True)
        ]

    def hook_times(self) -> list[float]:
        return self.hooks[self.warmup :]


class MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def run_mlp(strategy: str, devices: int, bar: bool, data: TensorDataset, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    model = MLP()
    timer = StepTimer(args.warmup)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=devices,
            max_steps=args.warmup + args.steps + 1,
            default_root_dir=root,
            enable_progress_bar=bar,
            callbacks=[timer],
        )
        trainer.fit(model, DataLoader(data, batch_size=args.batch_size, shuffle=False))
        loss = float(trainer.callback_metrics["train_loss"])
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {
        "interval": statistics.median(timer.intervals()),
        "hooks": statistics.median(timer.hook_times()),
        "cpu": statistics.median(timer.cpu_intervals()),
        "steps_timed": len(timer.intervals()),
        "last_train_loss": loss,
        "params": params,
    }


def part_mlp(args: argparse.Namespace) -> dict[str, Any]:
    n = args.batch_size * (args.warmup + args.steps + 1)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    runs = [(s, d, bar) for bar in args.bars for s, d in CONFIGS]
    keys = [f"{s}|{d}|{'bar' if bar else 'nobar'}" for s, d, bar in runs]
    medians: dict[str, dict[str, list[float]]] = {k: {"interval": [], "hooks": [], "cpu": []} for k in keys}
    last: dict[str, dict[str, Any]] = {}
    for round_index in range(args.rounds):
        # rotate and alternate the order: every configuration runs first, last and in between over the rounds
        shift = round_index % len(runs)
        order = list(range(len(runs)))[shift:] + list(range(len(runs)))[:shift]
        if round_index % 2:
            order = order[::-1]
        for i in order:
            result = run_mlp(*runs[i], data, args)
            medians[keys[i]]["interval"].append(result["interval"])
            medians[keys[i]]["hooks"].append(result["hooks"])
            medians[keys[i]]["cpu"].append(result["cpu"])
            last[keys[i]] = result
        print(f"MLP round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    rows = []
    for (strategy, devices, bar), key in zip(runs, keys, strict=True):
        base_key = f"auto|1|{'bar' if bar else 'nobar'}"
        row: dict[str, Any] = {"strategy": strategy, "devices": devices, "progress_bar": bar}
        for what in ("interval", "hooks", "cpu"):
            mine, base = medians[key][what], medians[base_key][what]
            row[f"{what}_ms"] = round(statistics.median(mine) * 1e3, 4)
            row[f"{what}_ratio"] = round(statistics.median(mine) / statistics.median(base), 4)
            row[f"{what}_paired_ratio"] = round(statistics.median(m / b for m, b in zip(mine, base, strict=True)), 4)
            row[f"{what}_round_medians_ms"] = [round(m * 1e3, 4) for m in mine]
        row["steps_timed_per_run"] = last[key]["steps_timed"]
        row["last_train_loss"] = round(last[key]["last_train_loss"], 6)
        row["max_param_diff_vs_default"] = float((last[key]["params"] - last[base_key]["params"]).abs().max())
        rows.append(row)
    return {"rows": rows}


# ------------------------------------------------------------------------------------- 2. the loss rule per step
def bert_batch(args: argparse.Namespace, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    b, s = args.bert_batch, args.seq
    ids = torch.randint(5, vocab, (b, s), generator=g)
    masked = torch.rand(b, s, generator=g) < 0.15
    masked[:, 1] = True  # every sequence has a masked token, so every shard's MLM mean is over something
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    inputs = torch.where(masked, torch.full_like(ids, 4), ids)  # 4: [MASK]
    types = (torch.arange(s) >= s // 2).long().expand(b, s).contiguous()
    return {
        "input_ids": inputs,
        "token_type_ids": types,
        "attention_mask": torch.ones(b, s, dtype=torch.long),
        "labels": labels,
        "next_sentence_label": torch.randint(0, 2, (b,), generator=g),
    }


def shard_losses(model: nn.Module, batch: dict[str, torch.Tensor], shards: int) -> list[torch.Tensor]:
    parts = {k: torch.tensor_split(v, shards) for k, v in batch.items()}
    return [model(**{k: v[i] for k, v in parts.items()}).loss for i in range(shards)]


def check_rule(model: nn.Module, batch: dict[str, torch.Tensor], shards: int) -> dict[str, Any]:
    """The combined loss against the whole batch's, and (float64) the gradients after backward of each."""
    sizes = [len(t) for t in torch.tensor_split(batch["input_ids"], shards)]
    out: dict[str, Any] = {"shards": shards, "sizes": sizes}
    for dtype in (torch.float32, torch.float64):
        model.to(dtype)
        model.zero_grad(set_to_none=True)
        whole = model(**batch).loss
        whole.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)
        losses = shard_losses(model, batch, shards)
        records = [read_loss(loss) for loss in losses]
        combined = combine_losses_by_record(losses, records, sizes, torch.device("cpu"))
        name = str(dtype).removeprefix("torch.")
        if combined is None:
            out[name] = {"read": False}
            continue
        combined.loss.backward()
        grad_diff = max(
            float((p.grad - g).abs().max())
            for p, g in zip([p for p in model.parameters() if p.grad is not None], grads, strict=True)
        )
        loss_diff = abs(float(combined.loss) - float(whole))
        plain_mean = float(torch.stack([loss.detach() for loss in losses]).mean())
        out[name] = {
            "read": True,
            "terms": list(records[0].signature()),
            "weights": [[float(w) if w is not None else None for w in term] for term in combined.weights],
            "whole_batch_loss": float(whole),
            "combined_loss": float(combined.loss),
            "abs_diff": loss_diff,
            "max_grad_abs_diff": grad_diff,
            "plain_mean_of_shard_losses_abs_diff": abs(plain_mean - float(whole)),
        }
    model.to(torch.float32)
    model.zero_grad(set_to_none=True)
    out["passed"] = bool(
        out["float32"].get("read")
        and out["float64"].get("read")
        and out["float32"]["abs_diff"] <= 1e-6 * max(1.0, abs(out["float32"]["whole_batch_loss"]))
        and out["float64"]["abs_diff"] <= 1e-10
        and out["float64"]["max_grad_abs_diff"] <= 1e-10
    )
    return out


def time_rule(model: nn.Module, batch: dict[str, torch.Tensor], shards: int, reps: int) -> dict[str, Any]:
    sizes = [len(t) for t in torch.tensor_split(batch["input_ids"], shards)]
    device = torch.device("cpu")
    read_t, combine_t, total_t, coupling_t, cpu_t = [], [], [], [], []
    for _ in range(reps):
        losses = shard_losses(model, batch, shards)  # a fresh graph: not timed
        c0, t0 = time.thread_time(), time.perf_counter()
        records = [read_loss(loss) for loss in losses]
        t1 = time.perf_counter()
        combined = combine_losses_by_record(losses, records, sizes, device)
        t2, c2 = time.perf_counter(), time.thread_time()
        found = coupling(losses[0], sizes[0])
        t3 = time.perf_counter()
        assert combined is not None and found is None, (combined, found)
        read_t.append(t1 - t0)
        combine_t.append(t2 - t1)
        total_t.append(t2 - t0)
        cpu_t.append(c2 - c0)
        coupling_t.append(t3 - t2)
        del losses, records, combined
    loss = shard_losses(model, batch, shards)[0]  # kept alive while its graph is walked
    stack, seen, visited = [loss.grad_fn], set(), []
    while stack:  # the size of one shard's graph, for the coupling figure
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        visited.append(node)  # held, so no id is reused by another node's wrapper
        stack.extend(child for child, _ in node.next_functions)
    nodes = len(visited)

    def us(values: list[float], q: float = 0.5) -> float:
        return round(statistics.quantiles(values, n=100)[int(q * 100) - 1] * 1e6, 2)

    return {
        "shards": shards,
        "sizes": sizes,
        "repetitions": reps,
        "read_loss_all_shards_us": us(read_t),
        "combine_us": us(combine_t),
        "read_plus_combine_us": us(total_t),
        "read_plus_combine_p90_us": us(total_t, 0.9),
        "read_plus_combine_cpu_us": us(cpu_t),
        "coupling_us": us(coupling_t),
        "graph_nodes_per_shard": nodes,
    }


def part_bert(args: argparse.Namespace) -> dict[str, Any]:
    transformers.logging.set_verbosity_error()
    config = transformers.BertConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=args.seq,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = transformers.BertForPreTraining(config).train()  # training mode, as in a training step (no dropout)
    batch = bert_batch(args, config.vocab_size)
    checks = [check_rule(model, batch, shards) for shards in args.shards]
    timings = []
    for shards in args.shards:
        shard_losses(model, batch, shards)  # warm-up
        timings.append(time_rule(model, batch, shards, args.reps))
        print(f"BERT loss rule, {shards} shards done", file=sys.stderr, flush=True)
    return {
        "config": {
            "vocab_size": 1000,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 128,
            "seq": args.seq,
            "batch": args.bert_batch,
            "dropout": 0.0,
        },
        "checks": checks,
        "timings": timings,
    }


# ---------------------------------------------------------------------------------------------------- report
def git_head() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        return head.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def markdown(report: dict[str, Any]) -> str:
    mlp, bert, cfg = report["mlp"], report["bert"], report["config"]
    lines = [
        "# Loss rule and strategy step time (issue 33), CPU",
        "",
        f"Command: `{report['command']}` ({report['wall_s']:.0f} s)  ",
        f"Machine: {report['device']}, {report['cpu_count']} CPUs shared with other work, load average before "
        f"{report['load_before']} after {report['load_after']}; torch threads {report['torch_threads']}, "
        f"OMP_NUM_THREADS={report['omp_num_threads']}  ",
        f"torch {report['versions']['torch']}, lightning {report['versions']['lightning']}, transformers "
        f"{report['versions']['transformers']}, Python {report['versions']['python']}; lightning_mgpu at "
        f"{report['git_head']}",
        "",
        "## 1. Step time of a small MLP",
        "",
        f"Linear(32,64)-ReLU-Linear(64,64)-ReLU-Linear(64,10), `F.cross_entropy` in `training_step`, "
        f"`self.log('train_loss', loss)`, Adam, float32; batch {cfg['batch_size']}, the same batches for every run. "
        f"Default Trainer otherwise (model summary, checkpointing, logger), progress bar on and off. "
        f"{cfg['rounds']} rounds (order rotated and alternated), each run {cfg['warmup']} warm-up + "
        f"{cfg['steps']} timed steps; a run's figure is its median step, the table's the median over rounds.",
        "",
        "**interval** = one `on_train_batch_start` to the next (what a user waits on per step, bar and data fetch "
        "included); **hooks** = `on_train_batch_start` to `on_train_batch_end`; **CPU** = the main thread's CPU "
        "time (`time.thread_time()`) over the interval: the work done, far less sensitive than wall time to other "
        "processes taking the shared cores (everything here runs on the main thread: sequential replicas, no "
        "loader workers). Ratio = median over the default strategy's median of the same bar setting in this run; "
        "paired = median over rounds of each round's ratio.",
        "",
        "CPU virtual devices: the two replicas run one after another on the same core(s), so the work equals one "
        "device's on the whole batch and the ratio measures the strategy's host overhead on top of the same compute "
        "(splitting, replicas, reading/combining the loss, logging), not a multi-device speed-up.",
        "",
        "| strategy | devices | bar | interval ms | **ratio** | paired | hooks ms | ratio | paired | CPU ms | ratio | "
        "paired | max param diff vs default |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in mlp["rows"]:
        lines.append(
            f"| {r['strategy']} | {r['devices']} | {'on' if r['progress_bar'] else 'off'} | {r['interval_ms']:.3f} "
            f"| **{r['interval_ratio']:.2f}x** | {r['interval_paired_ratio']:.2f}x | {r['hooks_ms']:.3f} "
            f"| {r['hooks_ratio']:.2f}x | {r['hooks_paired_ratio']:.2f}x | {r['cpu_ms']:.3f} | {r['cpu_ratio']:.2f}x "
            f"| {r['cpu_paired_ratio']:.2f}x | {r['max_param_diff_vs_default']:.1e} |"
        )
    lines += [
        "",
        "Issue 33's baseline: parallel_criterion 2.3x, dp 1.3x the default; target parallel_criterion <= 1.3x.",
    ]
    if not bert["timings"]:  # --parts mlp
        return "\n".join(lines) + "\n"
    lines += [
        "",
        "## 2. The loss rule per step: BERT pre-training's loss",
        "",
        "Tiny `BertForPreTraining` (vocab 1000, hidden 64, 2 layers, 2 heads, intermediate 128, dropout 0, training "
        f"mode), batch {bert['config']['batch']} x seq {bert['config']['seq']}, split with `torch.tensor_split`; "
        "loss = MLM (mean over masked tokens, -100 elsewhere) + NSP (mean over sequences). Timed per repetition on a "
        "fresh forward (not timed): `read_loss` on every shard + `combine_losses_by_record` (every training step "
        "under parallel_criterion); `coupling(loss, shard_size)` separately (once per shape of the loss's graph).",
        "",
        "| shards | sizes | reps | read_loss, all shards µs | combine µs | **read + combine µs** (p90) | "
        "read + combine, thread CPU µs | coupling µs | graph nodes per shard |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in bert["timings"]:
        lines.append(
            f"| {t['shards']} | {t['sizes']} | {t['repetitions']} | {t['read_loss_all_shards_us']:.1f} "
            f"| {t['combine_us']:.1f} | **{t['read_plus_combine_us']:.1f}** ({t['read_plus_combine_p90_us']:.1f}) "
            f"| {t['read_plus_combine_cpu_us']:.1f} | {t['coupling_us']:.1f} | {t['graph_nodes_per_shard']} |"
        )
    lines += [
        "",
        "Target: read + combine <= 50 µs a step (medians).",
        "",
        "Correctness (the combined loss against one forward on the whole batch; gradients after backward of each):",
        "",
        "| shards | dtype | terms | weights per term | whole-batch loss | abs diff | max grad diff | "
        "plain mean's diff | passed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in bert["checks"]:
        for name in ("float32", "float64"):
            d = c[name]
            if not d.get("read"):
                lines.append(f"| {c['shards']} | {name} | not read | | | | | | {c['passed']} |")
                continue
            lines.append(
                f"| {c['shards']} | {name} | {', '.join(d['terms'])} | {d['weights']} | {d['whole_batch_loss']:.6f} "
                f"| {d['abs_diff']:.1e} | {d['max_grad_abs_diff']:.1e} "
                f"| {d['plain_mean_of_shard_losses_abs_diff']:.1e} | {c['passed']} |"
            )
    lines += [
        "",
        "Pass: float32 loss within 1e-6 (relative to the loss when it exceeds 1), float64 loss and gradients within "
        "1e-10. 'plain mean's diff' is what an unweighted mean of the shards' losses would be off by.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=150, help="timed steps per MLP run")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--bars", type=int, nargs="+", default=[1, 0], help="progress bar: 1 on, 0 off")
    parser.add_argument("--bert-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--shards", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--reps", type=int, default=400, help="repetitions of the loss-rule timing per shard count")
    parser.add_argument("--parts", nargs="+", default=["mlp", "bert"], choices=["mlp", "bert"])
    parser.add_argument("--out", type=Path, default=RESULTS / "loss_rule_cpu.json")
    args = parser.parse_args(argv)
    args.bars = [bool(b) for b in args.bars]
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_mgpu"):
        logging.getLogger(name).setLevel(logging.ERROR)
    load_before = [round(x, 2) for x in os.getloadavg()]
    start = time.perf_counter()
    mlp = part_mlp(args) if "mlp" in args.parts else {"rows": []}
    gc.collect()
    bert = part_bert(args) if "bert" in args.parts else {"config": {}, "checks": [], "timings": []}
    report = {
        "benchmark": "loss_rule",
        "issue": 33,
        "command": "OMP_NUM_THREADS="
        + os.environ.get("OMP_NUM_THREADS", "<unset>")
        + " python "
        + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "device": f"{platform.machine()} CPU ({platform.processor() or 'cpu'})",
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "<unset>"),
        "load_before": load_before,
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(time.perf_counter() - start, 1),
        "git_head": git_head(),
        "versions": {
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "virtual_devices_note": "devices=2 on the CPU are virtual devices: the replicas run one after another on the "
        "same cores, so a ratio is the strategy's host overhead on top of the same compute, not a speed-up",
        "targets": {"parallel_criterion_vs_default": "<= 1.3x", "read_plus_combine_us": "<= 50"},
        "mlp": mlp,
        "bert": bert,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return report


if __name__ == "__main__":
    main()
