"""Memory and speed of the small-BERT recipe's masked-only MLM head, measured in one run.

Parts (``--parts``, default all):

1. ``head``: peak memory of the MLM loss alone (transform + tied decoder + cross-entropy, forward and backward) at the
   seed article's size (batch 64, sequence 163, vocab 30522, hidden 256): logits at the ~15% masked positions only
   versus at every position (``BertForPreTraining``'s way). The encoder output is a leaf tensor, so only the head
   counts. CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was allocated
   before, after one warm-up run. CPU: each variant in a fresh subprocess, peak resident set size (``ru_maxrss``)
   minus the resident size just before the loss; a fresh process keeps earlier allocations from hiding the peak,
   and PyTorch's large CPU tensors are ``mmap``-ed, so they enter and leave the RSS when allocated and freed.
2. ``strategies``: a few Lightning training steps of the whole model under ``dp`` and ``parallel_criterion`` with
   ``--replicas`` replicas, for both heads; each run in a fresh subprocess. Reported: the root device's peak
   (CUDA: ``max_memory_allocated(root)``; CPU: the process's peak RSS minus its RSS before ``fit``) and the bytes each
   strategy moves to the root device per step, computed from output sizes (``dp`` gathers the replicas' model
   outputs; ``parallel_criterion`` moves scalar losses), beside what the benchmark's ``TransferProbe`` counts from
   the step's outputs and the module's size. With fewer GPUs than replicas, the replicas share GPU 0 (virtual
   devices): then the "root" peak holds every replica.
3. ``throughput``: training tokens/s (forward, backward, AdamW) of this recipe's model against ``transformers``'
   ``BertForPreTraining`` (full logits) on the same config and precision: the median of interleaved rounds, plus the
   GPU's kernel time per step from ``torch.profiler`` (the speed-up the head gives when the GPU, not the CPU launching
   kernels, is the bottleneck). CUDA only; skipped with a note on CPU.

Results: ``benchmarks/results/bert_memory_<tag>.json`` and ``.md`` (tag: the device type unless ``--tag``), with the
device name, library versions and the exact command; a summary table is printed last.

    python benchmarks/bert_memory.py --device cpu
    python benchmarks/bert_memory.py --device cuda --precision bf16-mixed
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python benchmarks/bert_memory.py` from anywhere finds recipes/ and the package

import torch  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
RESULT_PREFIX = "BERT_MEMORY_RESULT "
MiB = 2**20


# ------------------------------------------------------------------------------------------------------ helpers
def _rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _max_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@contextlib.contextmanager
def autocast(device: torch.device, precision: str) -> Iterator[None]:
    """Lightning's precision names as autocast contexts."""
    if precision in ("bf16-mixed", "16-mixed"):
        dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
        with torch.autocast(device.type, dtype=dtype):
            yield
    elif precision in ("32-true", "32"):
        yield
    else:
        raise ValueError(f"unsupported precision {precision!r}: use 32-true, bf16-mixed or 16-mixed")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _random_labels(batch: int, seq: int, vocab: int, mask_prob: float, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    selected = torch.rand(batch, seq, generator=g) < mask_prob
    targets = torch.randint(5, vocab, (batch, seq), generator=g)
    return torch.where(selected, targets, torch.full_like(targets, -100)).to(device)


def _random_batch(batch: int, seq: int, vocab: int, mask_prob: float, device: torch.device, seed: int) -> dict:
    """A full-length (no padding) pretraining batch with ~mask_prob of the tokens selected for MLM."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, vocab, (batch, seq), generator=g)
    input_ids[:, 0] = 2
    token_type_ids = torch.zeros(batch, seq, dtype=torch.long)
    token_type_ids[:, seq // 2 :] = 1
    return {
        "input_ids": input_ids.to(device),
        "token_type_ids": token_type_ids.to(device),
        "attention_mask": torch.ones(batch, seq, dtype=torch.long, device=device),
        "labels": _random_labels(batch, seq, vocab, mask_prob, device, seed + 1),
        "next_sentence_label": torch.randint(0, 2, (batch,), generator=g).to(device),
    }


def _run_worker(argv: list[str]) -> dict[str, Any]:
    """Run this script as a fresh subprocess worker and return its JSON result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    return {"error": f"worker failed (exit {proc.returncode}): {proc.stderr[-2000:]}"}


def _emit(result: dict[str, Any]) -> None:
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# ------------------------------------------------------------------------------------------------------ part 1
def head_memory(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Peak memory of the MLM loss (head + CE, forward + backward) for ``variant`` in {masked, full}."""
    from torch import nn

    from recipes.bert.model import MaskedLMHead, masked_lm_loss

    device = torch.device(args.device)
    torch.manual_seed(0)
    word_embeddings = nn.Parameter(torch.randn(args.vocab, args.hidden, device=device) * 0.02)
    head = MaskedLMHead(args.hidden, args.vocab).to(device)
    head.decoder.weight = word_embeddings  # tied, as in the recipe
    hidden = torch.randn(args.batch, args.seq, args.hidden, device=device, requires_grad=True)
    labels = _random_labels(args.batch, args.seq, args.vocab, args.mask_prob, device, seed=1)
    n_masked = int((labels != -100).sum())

    def run(rows: int | None = None) -> tuple[float, int]:
        x, y = (hidden, labels) if rows is None else (hidden[:1, :rows], labels[:1, :rows])
        with autocast(device, args.precision):
            if variant == "masked":
                selected = y != -100
                logits = head(x[selected])
                loss, _ = masked_lm_loss(logits, y[selected])
            else:
                logits = head(x)
                loss, _ = masked_lm_loss(logits, y)
            logits_bytes = logits.numel() * logits.element_size()
        loss.backward()
        value = float(loss.detach())
        hidden.grad = None
        head.zero_grad(set_to_none=True)
        return value, logits_bytes

    # Warm-up on a few rows: loads the kernels' code pages (CPU RSS) and cuBLAS workspaces (CUDA) without raising
    # the high-water mark by more than a few rows' worth, so the measured peak is the loss's own memory.
    run(rows=min(args.seq, 16))
    if device.type == "cuda":
        run()  # full-size warm-up too: the caching allocator's first blocks
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        loss, logits_bytes = run()
        _sync(device)
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(device) - before
        method = "cuda max_memory_allocated - allocated before (after a warm-up run)"
    else:
        before = _rss_bytes()
        high_water_before = _max_rss_bytes()
        t0 = time.perf_counter()
        loss, logits_bytes = run()
        seconds = time.perf_counter() - t0
        peak = _max_rss_bytes() - before
        method = "fresh process: peak RSS (ru_maxrss) - RSS before the loss"
        if _max_rss_bytes() <= high_water_before:
            method += " [WARNING: the loss did not raise the process's earlier peak; figure is an upper bound]"
    rows = n_masked if variant == "masked" else args.batch * args.seq
    return {
        "variant": variant,
        "peak_bytes": int(peak),
        "logits_rows": rows,
        "logits_bytes": int(logits_bytes),
        "n_masked": n_masked,
        "loss": loss,
        "seconds": seconds,
        "method": method,
    }


def run_head_part(args: argparse.Namespace) -> dict[str, Any]:
    results = {}
    for variant in ("masked", "full"):
        if args.device == "cpu":
            results[variant] = _run_worker(["--worker", "head", "--variant", variant, *_shared_argv(args)])
        else:
            results[variant] = head_memory(variant, args)
    masked, full = results["masked"], results["full"]
    if "error" not in masked and "error" not in full:
        results["ratio_masked_over_full"] = masked["peak_bytes"] / full["peak_bytes"]
        results["target"] = "<= 0.25"
        results["loss_abs_diff"] = abs(masked["loss"] - full["loss"])
    return results


# ------------------------------------------------------------------------------------------------------ part 2
def _strategy_devices(device: torch.device, replicas: int) -> tuple[list[torch.device], bool]:
    """Distinct GPUs when there are enough, else ``replicas`` virtual copies of ``device``."""
    if device.type == "cuda" and torch.cuda.device_count() >= replicas:
        return [torch.device("cuda", i) for i in range(replicas)], False
    return [torch.device(device.type, 0) if device.type == "cuda" else device] * replicas, True


def strategy_memory(strategy: str, head: str, args: argparse.Namespace) -> dict[str, Any]:
    """A few Lightning steps of the whole model under ``strategy`` ({dp, parallel_criterion, single}); root peak."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, Dataset

    import lightning_mgpu
    from recipes.bert.module import BertPretrainingModule

    device = torch.device(args.device)
    devices, virtual = _strategy_devices(device, args.replicas)
    root = devices[0]

    class Batches(Dataset):
        """``steps`` fixed random batches, served one batch per item (the DataLoader adds no batching)."""

        def __init__(self) -> None:
            self.batches = [
                _random_batch(args.batch, args.seq, args.vocab, args.mask_prob, torch.device("cpu"), seed=s)
                for s in range(args.steps)
            ]

        def __len__(self) -> int:
            return len(self.batches)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return self.batches[i]

    loader = DataLoader(Batches(), batch_size=None, shuffle=False)
    torch.manual_seed(0)
    module = BertPretrainingModule(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        intermediate_size=4 * args.hidden,
        full_logits=head == "full",
        schedule="constant",
        warmup_steps=0,
        learning_rate=1e-4,
    )
    if strategy == "single":
        strategy_obj: Any = "auto"
        trainer_devices: Any = [root.index] if root.type == "cuda" else 1
    else:
        cls = {
            "dp": lightning_mgpu.DataParallelStrategy,
            "parallel_criterion": lightning_mgpu.ParallelCriterionStrategy,
        }
        strategy_obj = cls[strategy](parallel_devices=devices)
        trainer_devices = "auto"
    from benchmarks.compare.probes import TransferProbe

    transfer_probe = TransferProbe()
    trainer = pl.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=trainer_devices,
        strategy=strategy_obj,
        callbacks=[transfer_probe],
        max_steps=args.steps,
        precision=args.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    if device.type == "cuda":
        torch.cuda.init()
        torch.empty(0, device=root)  # the allocator must exist on the device before its stats can be reset
        torch.cuda.reset_peak_memory_stats(root)
    rss_before = _rss_bytes()
    t0 = time.perf_counter()
    trainer.fit(module, loader)
    _sync(root)
    seconds = time.perf_counter() - t0
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(root)
        method = "torch.cuda.max_memory_allocated(root) over fit (model, optimizer state and activations)"
    else:
        peak = _max_rss_bytes() - rss_before
        method = "process peak RSS - RSS before fit (model, optimizer state and activations)"

    # Bytes moved to the root per step, computed from output sizes (shards 1..N-1 live on the other replicas).
    transfer: dict[str, Any] = {}
    n = len(devices)
    if strategy == "dp":
        # The last training step's batch, so the figure can be compared with the strategy's own counter.
        batch = _random_batch(args.batch, args.seq, args.vocab, args.mask_prob, root, seed=args.steps - 1)
        shards = [{k: v.tensor_split(n)[i] for k, v in batch.items()} for i in range(n)]
        module.to(root).eval()
        total = 0
        with torch.no_grad(), autocast(root, args.precision):
            for shard in shards[1:]:
                out = module(shard["input_ids"], shard["attention_mask"], shard["token_type_ids"], shard["labels"])
                total += sum(t.numel() * t.element_size() for t in (out.mlm_logits, out.mlm_labels, out.nsp_logits))
        transfer["computed_output_bytes"] = total
        transfer["computed_from"] = "sizes of the model outputs (MLM logits + labels + NSP logits) of replicas 1..N-1"
    elif strategy == "parallel_criterion":
        transfer["computed_output_bytes"] = (n - 1) * 3 * 4
        transfer["computed_from"] = "per non-root replica: the loss and the two loss terms, fp32 scalars"
    else:
        transfer["computed_output_bytes"] = 0
        transfer["computed_from"] = "one device: nothing moves"
    if transfer_probe.last is not None:  # counted by the benchmark's probe from the step
        transfer["strategy_counter"] = {k: transfer_probe.last[k] for k in ("outputs", "parameters", "gradients")}
    return {
        "strategy": strategy,
        "head": head,
        "replicas": n if strategy != "single" else 1,
        "virtual_devices": virtual and strategy != "single",
        "root_peak_bytes": int(peak),
        "steps": args.steps,
        "seconds": seconds,
        "transfer_to_root_per_step": transfer,
        "method": method,
    }


def run_strategies_part(args: argparse.Namespace) -> dict[str, Any]:
    try:
        from lightning.pytorch.strategies import StrategyRegistry

        import lightning_mgpu  # noqa: F401
    except ImportError as err:  # pragma: no cover - the package is part of this repo
        return {"skipped": f"lightning_mgpu not importable: {err}"}
    missing = [s for s in args.strategies if s != "single" and s not in StrategyRegistry.available_strategies()]
    if missing:
        return {"skipped": f"strategies not registered yet: {missing}"}
    runs = []
    for head in args.strategy_heads:
        for strategy in args.strategies:
            runs.append(_run_worker(["--worker", "strategy", "--variant", f"{strategy}:{head}", *_shared_argv(args)]))
    return {"runs": runs}


# ------------------------------------------------------------------------------------------------------ part 3
THROUGHPUT_MODELS = ("ours-masked", "ours-full", "hf-full")


def build_training_step(kind: str, batch_size: int, args: argparse.Namespace) -> tuple[Any, list[dict], int]:
    """A closure running one training step (forward, backward, AdamW) of ``kind``, its batches and parameter count.

    ``ours-masked`` / ``ours-full``: this recipe's model with the masked-only / full-logits head; ``hf-full``:
    ``transformers``' ``BertForPreTraining`` (full logits, its own loss). Same config, attention (sdpa) and precision.
    """
    from transformers import BertConfig, BertForPreTraining

    from recipes.bert.model import BertPretrainingModel, pretraining_loss

    device = torch.device(args.device)
    torch.manual_seed(0)
    if kind == "hf-full":
        config = BertConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            intermediate_size=4 * args.hidden,
        )
        config._attn_implementation = "sdpa"
        model: torch.nn.Module = BertForPreTraining(config)
    else:
        model = BertPretrainingModel(
            args.vocab, args.hidden, args.layers, args.heads, 4 * args.hidden, full_logits=kind == "ours-full"
        )
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "16-mixed")
    batches = [_random_batch(batch_size, args.seq, args.vocab, args.mask_prob, device, seed=s) for s in range(4)]

    def step(b: dict[str, torch.Tensor]) -> None:
        with autocast(device, args.precision):
            if kind == "hf-full":
                loss = model(
                    input_ids=b["input_ids"],
                    attention_mask=b["attention_mask"],
                    token_type_ids=b["token_type_ids"],
                    labels=b["labels"],
                    next_sentence_label=b["next_sentence_label"],
                ).loss
            else:
                out = model(b["input_ids"], b["attention_mask"], b["token_type_ids"], labels=b["labels"])
                loss = pretraining_loss(out, b["next_sentence_label"])["loss"]
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    return step, batches, sum(p.numel() for p in model.parameters())


def throughput_comparison(batch_size: int, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Median training tokens/s of every model in ``THROUGHPUT_MODELS`` at ``batch_size``.

    All models are built first (each warmed up, its peak memory and GPU kernel time taken while it runs alone), then
    timed in ``--rounds`` interleaved rounds of ``--timed-steps`` steps, so drifts in clocks or load hit them alike.
    """
    device = torch.device(args.device)
    setups: dict[str, tuple[Any, list[dict]]] = {}
    rows: dict[str, dict[str, Any]] = {}
    for kind in THROUGHPUT_MODELS:
        allocated_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        step, batches, n_params = build_training_step(kind, batch_size, args)
        for i in range(args.warmup_steps):
            step(batches[i % len(batches)])
        _sync(device)
        row: dict[str, Any] = {"model": kind, "batch": batch_size, "parameters": n_params}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            for i in range(2):
                step(batches[i % len(batches)])
            _sync(device)
            row["peak_bytes"] = int(torch.cuda.max_memory_allocated(device) - allocated_before)
        row["gpu_kernel_ms_per_step"] = _gpu_kernel_ms_per_step(step, batches, device)
        setups[kind], rows[kind] = (step, batches), row
    times: dict[str, list[float]] = {kind: [] for kind in THROUGHPUT_MODELS}
    for _ in range(args.rounds):
        for kind, (step, batches) in setups.items():
            _sync(device)
            t0 = time.perf_counter()
            for i in range(args.timed_steps):
                step(batches[i % len(batches)])
            _sync(device)
            times[kind].append((time.perf_counter() - t0) / args.timed_steps)
    for kind, row in rows.items():
        seconds = statistics.median(times[kind])
        row["ms_per_step"] = 1000 * seconds
        row["ms_per_step_rounds"] = [round(1000 * t, 3) for t in times[kind]]
        row["tokens_per_s"] = batch_size * args.seq / seconds
    return rows


def _gpu_kernel_ms_per_step(step: Any, batches: list[dict], device: torch.device, steps: int = 3) -> float | None:
    """Sum of the CUDA kernels' durations per step (torch.profiler): the GPU's busy time, free of launch gaps."""
    if device.type != "cuda":
        return None
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(steps):
                step(batches[i % len(batches)])
            torch.cuda.synchronize(device)
        kernels = [e for e in prof.key_averages() if getattr(e, "device_type", None) == DeviceType.CUDA]
        return sum(e.self_device_time_total for e in kernels) / steps / 1000
    except Exception:  # the profiler is optional here: report None rather than fail the benchmark
        return None


def run_throughput_part(args: argparse.Namespace) -> dict[str, Any]:
    if args.device == "cpu" and not args.cpu_throughput:
        return {"skipped": "CPU run: throughput is compared on a GPU only (pass --cpu-throughput to force)"}
    runs = []
    for batch_size in args.throughput_batches:
        rows = throughput_comparison(batch_size, args)
        gc.collect()  # free these models before the next batch size's are built
        if args.device == "cuda":
            torch.cuda.empty_cache()
        hf = rows["hf-full"]
        for row in rows.values():
            row["speedup_vs_hf_full"] = row["tokens_per_s"] / hf["tokens_per_s"]
            if row.get("gpu_kernel_ms_per_step") and hf.get("gpu_kernel_ms_per_step"):
                row["kernel_speedup_vs_hf_full"] = hf["gpu_kernel_ms_per_step"] / row["gpu_kernel_ms_per_step"]
        runs.extend(rows.values())
    return {"runs": runs, "target": "ours-masked >= 1.5x hf-full tokens/s"}


# ------------------------------------------------------------------------------------------------------ reporting
def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} logical CPUs)"
    return platform.processor() or "cpu"


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "lightning", "torchmetrics", "lightning_mgpu"):
        try:
            versions[name] = __import__(name).__version__
        except Exception as err:  # report, don't fail
            versions[name] = f"unavailable ({type(err).__name__})"
    return versions


def _mib(n: float) -> str:
    return f"{n / MiB:,.1f}"


def markdown(results: dict[str, Any]) -> str:
    cfg = results["config"]
    lines = [
        f"# BERT MLM-head memory and speed ({results['device_type']}: {results['device']})",
        "",
        f"Command: `{results['command']}`  ",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()) + "  ",
        f"Config: batch {cfg['batch']}, sequence {cfg['seq']}, vocab {cfg['vocab']}, hidden {cfg['hidden']}, "
        f"{cfg['layers']} layers, {cfg['heads']} heads, precision {cfg['precision']}, "
        f"{cfg['mask_prob']:.0%} of tokens selected for MLM. Wall time {results['wall_seconds']:.0f} s.",
        "",
    ]
    head = results.get("head")
    if head:
        lines += [
            "## 1. MLM loss (head + cross-entropy, forward + backward): peak memory",
            "",
            "| head | logits rows | logits | peak | time (s) |",
            "|---|---|---|---|---|",
        ]
        for variant in ("masked", "full"):
            r = head[variant]
            if "error" in r:
                lines.append(f"| {variant} | error: {r['error'][:200]} | | | |")
                continue
            lines.append(
                f"| {variant} | {r['logits_rows']:,} | {_mib(r['logits_bytes'])} MiB | "
                f"{_mib(r['peak_bytes'])} MiB | {r['seconds']:.2f} |"
            )
        if "ratio_masked_over_full" in head:
            lines += [
                "",
                f"Masked-only / full peak: **{head['ratio_masked_over_full']:.3f}** "
                f"(target {head['target']});"
                f" |loss difference| {head['loss_abs_diff']:.2e}. Method: {head['masked']['method']}.",
                "",
            ]
    strategies = results.get("strategies")
    if strategies:
        lines += ["## 2. Root-device peak memory per strategy (whole model, Lightning steps)", ""]
        if "skipped" in strategies:
            lines += [f"Skipped: {strategies['skipped']}", ""]
        else:
            lines += [
                "| strategy | head | replicas | root peak | moved to root per step (computed) | "
                "strategy counter: outputs | s |",
                "|---|---|---|---|---|---|---|",
            ]
            for r in strategies["runs"]:
                if "error" in r:
                    lines.append(f"| error | {r['error'][:300]} | | | | | |")
                    continue
                t = r["transfer_to_root_per_step"]
                counter = t.get("strategy_counter", {}).get("outputs")
                counter_text = f"{counter:,} B" if isinstance(counter, int) else "n/a"
                virtual = " (virtual)" if r["virtual_devices"] else ""
                lines.append(
                    f"| {r['strategy']} | {r['head']} | {r['replicas']}{virtual} | "
                    f"{_mib(r['root_peak_bytes'])} MiB | {t['computed_output_bytes']:,} B | {counter_text} | "
                    f"{r['seconds']:.1f} |"
                )
            method = next((r["method"] for r in strategies["runs"] if "method" in r), "")
            lines += [
                "",
                f"Method: {method}. 'virtual': the replicas share one device, so the root's peak holds "
                "every replica's activations too.",
                "",
            ]
    throughput_part = results.get("throughput")
    if throughput_part:
        lines += ["## 3. Training throughput vs transformers' BertForPreTraining (full logits)", ""]
        if "skipped" in throughput_part:
            lines += [f"Skipped: {throughput_part['skipped']}", ""]
        else:
            lines += [
                "| model | batch | tokens/s | ms/step | speed-up vs hf-full | GPU kernel ms/step | "
                "kernel-time speed-up | peak |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for r in throughput_part["runs"]:
                peak = _mib(r["peak_bytes"]) + " MiB" if "peak_bytes" in r else "n/a"
                kernel = r.get("gpu_kernel_ms_per_step")
                kernel_text = f"{kernel:.2f}" if kernel else "n/a"
                kernel_speedup = r.get("kernel_speedup_vs_hf_full")
                kernel_speedup_text = f"{kernel_speedup:.2f}x" if kernel_speedup else "n/a"
                lines.append(
                    f"| {r['model']} | {r['batch']} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.2f} | "
                    f"{r['speedup_vs_hf_full']:.2f}x | {kernel_text} | {kernel_speedup_text} | {peak} |"
                )
            lines += [
                "",
                f"Target: {throughput_part['target']}. ms/step is wall time (what training sees); GPU "
                "kernel ms/step sums the kernels' durations (torch.profiler), i.e. the GPU's busy time. Where "
                "wall time exceeds kernel time by far, the step is bound by the CPU launching kernels (the "
                "same encoder code for both models), which hides the head's savings.",
                "",
            ]
    return "\n".join(lines) + "\n"


def summary(results: dict[str, Any]) -> str:
    rows = [("measure", "value")]
    head = results.get("head", {})
    if "ratio_masked_over_full" in head:
        rows.append(("MLM loss peak, masked-only", f"{_mib(head['masked']['peak_bytes'])} MiB"))
        rows.append(("MLM loss peak, full logits", f"{_mib(head['full']['peak_bytes'])} MiB"))
        rows.append(("ratio masked/full (target <= 0.25)", f"{head['ratio_masked_over_full']:.3f}"))
    for r in results.get("strategies", {}).get("runs", []):
        if "error" not in r:
            rows.append((f"root peak {r['strategy']} ({r['head']} head)", f"{_mib(r['root_peak_bytes'])} MiB"))
            rows.append(
                (
                    f"to root/step {r['strategy']} ({r['head']} head)",
                    f"{r['transfer_to_root_per_step']['computed_output_bytes']:,} B",
                )
            )
        else:
            rows.append(("strategy run", "error (see JSON)"))
    if "skipped" in results.get("strategies", {}):
        rows.append(("strategies", results["strategies"]["skipped"]))
    tp = results.get("throughput", {})
    for r in tp.get("runs", []):
        kernel = r.get("kernel_speedup_vs_hf_full")
        kernel_text = f"; GPU kernel time {kernel:.2f}x" if kernel else ""
        rows.append(
            (
                f"tokens/s {r['model']} (batch {r['batch']})",
                f"{r['tokens_per_s']:,.0f} ({r['speedup_vs_hf_full']:.2f}x hf{kernel_text})",
            )
        )
    if "skipped" in tp:
        rows.append(("throughput", tp["skipped"]))
    width = max(len(a) for a, _ in rows)
    return "\n".join(f"{a.ljust(width)} | {b}" for a, b in rows)


# ------------------------------------------------------------------------------------------------------ CLI
def _csv(kind: type) -> Any:
    return lambda text: [kind(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=163)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--mask-prob", type=float, default=0.15)
    p.add_argument(
        "--precision",
        default=None,
        help="32-true | bf16-mixed | 16-mixed (default: bf16-mixed on cuda, 32-true on cpu)",
    )
    p.add_argument("--steps", type=int, default=3, help="Lightning training steps per strategy run (part 2)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument(
        "--strategies",
        type=_csv(str),
        default=["dp", "parallel_criterion"],
        help="comma-separated, from dp, parallel_criterion, single",
    )
    p.add_argument("--strategy-heads", type=_csv(str), default=["full", "masked"])
    p.add_argument("--timed-steps", type=int, default=20, help="timed training steps per model and round (part 3)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds; the median is reported")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument(
        "--throughput-batches",
        type=_csv(int),
        default=None,
        help="batch sizes for part 3 (default: --batch and 4x --batch)",
    )
    p.add_argument("--cpu-throughput", action="store_true", help="run part 3 on the CPU anyway (slow)")
    p.add_argument("--parts", type=_csv(str), default=["head", "strategies", "throughput"])
    p.add_argument("--tag", default=None, help="results file suffix (default: the device type)")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--no-save", action="store_true", help="print only; write no result files")
    p.add_argument("--worker", choices=("head", "strategy"), help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.precision is None:
        args.precision = "bf16-mixed" if args.device == "cuda" else "32-true"
    if args.throughput_batches is None:
        args.throughput_batches = [args.batch, 4 * args.batch]
    unknown = set(args.parts) - {"head", "strategies", "throughput"}
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    return args


def _shared_argv(args: argparse.Namespace) -> list[str]:
    return [
        "--device",
        args.device,
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--vocab",
        str(args.vocab),
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--heads",
        str(args.heads),
        "--mask-prob",
        str(args.mask_prob),
        "--precision",
        args.precision,
        "--steps",
        str(args.steps),
        "--replicas",
        str(args.replicas),
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here downloads: the models are built from configs
    args = parse_args(argv)
    if args.worker == "head":
        _emit(head_memory(args.variant, args))
        return {}
    if args.worker == "strategy":
        strategy, head = args.variant.split(":")
        _emit(strategy_memory(strategy, head, args))
        return {}

    start = time.perf_counter()
    command = (
        "python " + shlex.join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
        if argv is None
        else ("python benchmarks/bert_memory.py " + shlex.join(argv))
    )
    results: dict[str, Any] = {
        "device_type": args.device,
        "device": _device_name(args.device),
        "versions": _versions(),
        "command": command,
        "config": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("worker", "variant")
        },
    }
    parts = {"head": run_head_part, "strategies": run_strategies_part, "throughput": run_throughput_part}
    results["part_seconds"] = {}
    for number, (name, run) in enumerate(parts.items(), start=1):
        if name in args.parts:
            print(f"part {number}: {name} ...", flush=True)
            t0 = time.perf_counter()
            results[name] = run(args)
            results["part_seconds"][name] = round(time.perf_counter() - t0, 1)
    results["wall_seconds"] = time.perf_counter() - start

    if not args.no_save:
        tag = args.tag or args.device
        args.out_dir.mkdir(parents=True, exist_ok=True)
        json_path = args.out_dir / f"bert_memory_{tag}.json"
        json_path.write_text(json.dumps(results, indent=2) + "\n")
        (args.out_dir / f"bert_memory_{tag}.md").write_text(markdown(results))
        print(f"wrote {json_path} and {json_path.with_suffix('.md')}")
    print(summary(results))
    return results


if __name__ == "__main__":
    main()
