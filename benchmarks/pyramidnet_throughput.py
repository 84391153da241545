"""Training throughput of the PyramidNet recipe: Lightning Trainer + recipe module vs a hand-written PyTorch loop.

Both run in the same process on the same model architecture, the same device-resident uint8 batches, the same
on-device augmentation (random crop + flip + normalisation, ``recipes/pyramidnet/augment.py``), precision, memory
format and optimizer (SGD, Nesterov momentum 0.9, wd 1e-4, MultiStepLR). Throughput is images per second over timed
windows of optimizer steps (the device is synchronised at window boundaries only). After one discarded run of each,
the loops run in ``--rounds`` rounds (each loop first in turn), each run reporting its median window; the overhead
figure is the median over rounds of the paired ratio Lightning / plain, so that drift of a shared machine cancels. A
third loop, ``lightning_no_log`` (the recipe with ``self.log`` a no-op), splits Lightning's per-step host overhead
into loop and logging. Results go to ``benchmarks/results/pyramidnet_throughput_<device>`` as JSON and markdown,
with the device, versions and the exact command.

    python benchmarks/pyramidnet_throughput.py                      # CPU: tiny model, small batch (minutes at most)
    python benchmarks/pyramidnet_throughput.py --device cuda --model seed --batch-size 256 --precision bf16-mixed
    python benchmarks/pyramidnet_throughput.py --device cuda --compile

The Lightning side also computes the recipe's train accuracy (torchmetrics) and logs loss and lr every step, as the
recipe does; the plain loop does only the training step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: make `recipes` importable
    sys.path.insert(0, str(ROOT))

import lightning  # noqa: E402
import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchmetrics  # noqa: E402

from recipes.pyramidnet.augment import transform_batch  # noqa: E402
from recipes.pyramidnet.model import build_pyramidnet, count_parameters  # noqa: E402
from recipes.pyramidnet.module import PyramidNetModule  # noqa: E402
from recipes.pyramidnet.sources import make_synthetic  # noqa: E402

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")


# --------------------------------------------------------------------------------------------------------------------
# Shared pieces


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    if precision == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "16-mixed":
        return torch.autocast(device.type, dtype=torch.float16)
    return contextlib.nullcontext()


def make_pool(batch_size: int, pool_batches: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Device-resident uint8 batches (synthetic CIFAR-shaped images), reused cyclically by both loops."""
    data = make_synthetic(batch_size * pool_batches, 1, seed=0)
    images = data.train_images.to(device).split(batch_size)
    labels = data.train_labels.to(device).split(batch_size)
    return list(zip(images, labels, strict=True))


class WindowTimer:
    """Wall time of consecutive windows of ``window`` steps after ``warmup`` steps; syncs only at boundaries."""

    def __init__(self, device: torch.device, warmup: int, window: int, windows: int, batch_size: int) -> None:
        self.device, self.warmup, self.window, self.windows = device, warmup, window, windows
        self.batch_size = batch_size
        self.seconds: list[float] = []
        self._t0 = 0.0

    @property
    def total_steps(self) -> int:
        return self.warmup + self.window * self.windows

    def step_done(self, step: int) -> None:
        """Call after optimizer step number ``step`` (1-based) has been issued."""
        if step == self.warmup:
            _sync(self.device)
            self._t0 = time.perf_counter()
        elif step > self.warmup and (step - self.warmup) % self.window == 0:
            _sync(self.device)
            now = time.perf_counter()
            self.seconds.append(now - self._t0)
            self._t0 = now

    def summary(self) -> dict[str, Any]:
        rates = [self.window * self.batch_size / s for s in self.seconds]
        return {
            "images_per_s_median": statistics.median(rates),
            "images_per_s_windows": [round(r, 2) for r in rates],
            "ms_per_step_median": 1000 * statistics.median(self.seconds) / self.window,
        }


def _peak_memory_mb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# --------------------------------------------------------------------------------------------------------------------
# Plain PyTorch


def run_plain(
    args: argparse.Namespace, pool: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> dict[str, Any]:
    """The hand-written loop: augment, forward + loss under autocast, backward, SGD step, scheduler step."""
    torch.manual_seed(0)
    model = build_pyramidnet(args.model, channel_multiple=args.channel_multiple).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if args.compile:
        model.compile()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    timer = WindowTimer(device, args.warmup, args.window, args.windows, args.batch_size)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(
        optimizer, milestones=[timer.total_steps // 2, 3 * timer.total_steps // 4], gamma=0.1
    )
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "16-mixed")
    model.train()
    _reset_peak(device)
    for step in range(1, timer.total_steps + 1):
        images, labels = pool[(step - 1) % len(pool)]
        x = transform_batch(images, train=True, channels_last=args.channels_last)
        with _autocast(device, args.precision):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        timer.step_done(step)
    _sync(device)
    return {**timer.summary(), "peak_memory_mb": _peak_memory_mb(device), "final_loss": float(loss.detach())}


# --------------------------------------------------------------------------------------------------------------------
# Lightning


class _Batches:
    """Iterable over the device-resident pool for ``steps`` batches (Lightning's batch transfer is then a no-op)."""

    def __init__(self, pool: list[tuple[torch.Tensor, torch.Tensor]], steps: int) -> None:
        self.pool, self.steps = pool, steps

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self.pool[i % len(self.pool)] for i in range(self.steps))

    def __len__(self) -> int:
        return self.steps


class _BenchModule(PyramidNetModule):
    """The recipe module with the data module's on-device augmentation hook (the benchmark feeds no data module)."""

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        images, labels = batch
        return transform_batch(images, train=self.trainer.training, channels_last=self.hparams.channels_last), labels


class _SilentBenchModule(_BenchModule):
    """The same module with ``self.log`` a no-op: separates Lightning's loop overhead from its logging cost."""

    def log(self, *args: Any, **kwargs: Any) -> None:
        return None


class _TimerCallback(L.Callback):
    def __init__(self, timer: WindowTimer) -> None:
        self.timer = timer

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.timer.step_done(trainer.global_step)


def run_lightning(
    args: argparse.Namespace, pool: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device, log: bool = True
) -> dict[str, Any]:
    """The recipe's LightningModule under a single-device Trainer, same data, precision and memory format.

    ``log=False`` turns the module's ``self.log`` calls into no-ops (a diagnostic, not the recipe).
    """
    torch.manual_seed(0)
    module_cls = _BenchModule if log else _SilentBenchModule
    module = module_cls(
        arch=args.model,
        channels_last=args.channels_last,
        channel_multiple=args.channel_multiple,
        compile_net=args.compile,
    )
    timer = WindowTimer(device, args.warmup, args.window, args.windows, args.batch_size)
    trainer = L.Trainer(
        accelerator=device.type if device.type != "cuda" else "gpu",
        devices=[device.index] if device.type == "cuda" else 1,
        precision=args.precision,
        max_steps=timer.total_steps,
        max_epochs=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        benchmark=device.type == "cuda",
        callbacks=[_TimerCallback(timer)],
    )
    _reset_peak(device)
    trainer.fit(module, train_dataloaders=_Batches(pool, timer.total_steps))
    _sync(device)
    assert trainer.global_step == timer.total_steps, trainer.global_step
    final = trainer.callback_metrics.get("train_loss")
    return {
        **timer.summary(),
        "peak_memory_mb": _peak_memory_mb(device),
        "final_loss": float(final) if final is not None else None,
    }


# --------------------------------------------------------------------------------------------------------------------
# Reporting


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                return f"{name} ({os.cpu_count()} cores, torch threads: {torch.get_num_threads()})"
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def _versions() -> dict[str, str | None]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "torchmetrics": torchmetrics.__version__,
        "cuda": torch.version.cuda,
        "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None,
    }


def _markdown(report: dict[str, Any]) -> str:
    cfg, res = report["config"], report["results"]
    rows = []
    for i, rnd in enumerate(report["rounds"], start=1):
        for name in rnd["order"]:
            r = rnd[name]
            mem = f"{r['peak_memory_mb']:.0f}" if r["peak_memory_mb"] is not None else "n/a"
            windows = ", ".join(f"{w:.0f}" for w in r["images_per_s_windows"])
            rows.append(
                f"| {i} | {name} | {r['images_per_s_median']:.1f} | {r['ms_per_step_median']:.2f} | {mem} | {windows} |"
            )
        rows.append(f"| {i} | **lightning / plain** | **{rnd['ratio_lightning_over_plain']:.3f}** | | | |")
        rows.append(f"| {i} | lightning_no_log / plain | {rnd['ratio_no_log_over_plain']:.3f} | | | |")
    ratios = ", ".join(f"{r['ratio_lightning_over_plain']:.3f}" for r in report["rounds"])
    return "\n".join(
        [
            "# PyramidNet training throughput: Lightning recipe vs plain PyTorch",
            "",
            f"- device: {report['device']}",
            f"- model: `{cfg['model']}` ({cfg['parameters']:,} parameters), batch {cfg['batch_size']}, "
            f"precision {cfg['precision']}, channels_last {cfg['channels_last']}, compile {cfg['compile']}, "
            f"channel_multiple {cfg['channel_multiple']}",
            f"- one discarded run of each loop, then {cfg['rounds']} rounds, each loop running first in turn; per run "
            f"{cfg['warmup']} warm-up steps, then {cfg['windows']} windows of {cfg['window']} steps, median window",
            "- versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v),
            f"- command: `{report['command']}`",
            f"- date: {report['date']}, wall {report['wall_seconds']} s",
            *([f"- note: {report['note']}"] if report["note"] else []),
            "",
            "| round | loop | images/s (median window) | ms/step | peak memory (MiB) | images/s per window |",
            "| ---: | --- | ---: | ---: | ---: | --- |",
            *rows,
            "",
            f"Median over rounds: plain **{res['plain']['images_per_s_median']:.1f}** images/s, lightning "
            f"**{res['lightning']['images_per_s_median']:.1f}** images/s, lightning without `self.log` "
            f"{res['lightning_no_log']['images_per_s_median']:.1f} images/s.",
            "",
            "**Lightning / plain throughput ratio (median of paired rounds): "
            f"{report['ratio_lightning_over_plain']:.3f}** "
            f"(rounds: {ratios}); without `self.log`: {report['ratio_no_log_over_plain']:.3f}.",
            "",
            "Same device-resident uint8 batches, on-device augmentation, optimizer and precision in every loop; the "
            "Lightning side also updates the recipe's torchmetrics accuracy and logs its loss and lr as the recipe "
            "does. "
            "`lightning_no_log` is the same module with `self.log` made a no-op: a diagnostic that splits Lightning's "
            "per-step host overhead into its loop and its logging, not a configuration to train with.",
            "",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--model", default=None, help="a build_pyramidnet name (default: seed on cuda, tiny on cpu)")
    parser.add_argument("--batch-size", type=int, default=None, help="default: 256 on cuda, 32 on cpu")
    parser.add_argument(
        "--precision", choices=PRECISIONS, default="bf16-mixed", help="autocast precision of both loops"
    )
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 15 on cuda, 5 on cpu)")
    parser.add_argument(
        "--window", type=int, default=None, help="steps per timed window (default 20 on cuda, 10 on cpu)"
    )
    parser.add_argument("--windows", type=int, default=5, help="timed windows per run; the median is reported")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds of every loop (each first in turn); the median paired ratio is reported "
        "(default 3 on cuda, 6 on cpu)",
    )
    parser.add_argument("--pool-batches", type=int, default=8, help="distinct device-resident batches cycled through")
    parser.add_argument(
        "--no-channels-last", dest="channels_last", action="store_false", help="keep NCHW instead of channels_last"
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile the PyramidNet in both loops")
    parser.add_argument(
        "--channel-multiple",
        type=int,
        default=1,
        help="round unit widths up to this multiple (8: tensor-core aligned; not the paper's model)",
    )
    parser.add_argument("--note", default="", help="free text stored with the results (e.g. machine conditions)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--out-name", default=None, help="file stem (default pyramidnet_throughput_<device type>[_compile])"
    )
    args = parser.parse_args(argv)
    on_cuda = args.device.startswith("cuda")
    args.model = args.model or ("seed" if on_cuda else "tiny")
    args.batch_size = args.batch_size if args.batch_size is not None else (256 if on_cuda else 32)
    args.warmup = args.warmup if args.warmup is not None else (15 if on_cuda else 5)
    args.window = args.window if args.window is not None else (20 if on_cuda else 10)
    args.rounds = args.rounds if args.rounds is not None else (3 if on_cuda else 6)
    for name in ("window", "windows", "rounds", "batch_size", "pool_batches", "channel_multiple"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 1:
        parser.error(f"--warmup must be at least 1 (the timer starts after a warm-up step), got {args.warmup}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda asked for, but CUDA is not available")
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    L.seed_everything(0, verbose=False)
    pool = make_pool(args.batch_size, args.pool_batches, device)
    start = time.perf_counter()
    runners = {
        "plain": run_plain,
        "lightning": run_lightning,
        "lightning_no_log": lambda a, p, d: run_lightning(a, p, d, log=False),
    }
    for run in runners.values():  # discarded: one-time costs (kernel selection, allocator growth, JIT) go here
        run(args, pool, device)
    names = list(runners)
    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        order = names[i % len(names) :] + names[: i % len(names)]  # each loop runs first in turn
        rnd: dict[str, Any] = {"order": order}
        for name in order:
            rnd[name] = runners[name](args, pool, device)
        plain_rate = rnd["plain"]["images_per_s_median"]
        rnd["ratio_lightning_over_plain"] = rnd["lightning"]["images_per_s_median"] / plain_rate
        rnd["ratio_no_log_over_plain"] = rnd["lightning_no_log"]["images_per_s_median"] / plain_rate
        rounds.append(rnd)
    summary = {
        name: {"images_per_s_median": statistics.median(r[name]["images_per_s_median"] for r in rounds)}
        for name in runners
    }
    ratio = statistics.median(r["ratio_lightning_over_plain"] for r in rounds)
    ratio_no_log = statistics.median(r["ratio_no_log_over_plain"] for r in rounds)
    with torch.device("meta"):
        n_params = count_parameters(build_pyramidnet(args.model, channel_multiple=args.channel_multiple))
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES") if k in os.environ]
    command = " ".join(
        [
            *env,
            "python",
            shlex.quote(os.path.relpath(__file__, Path.cwd())),
            *map(shlex.quote, argv if argv is not None else sys.argv[1:]),
        ]
    )
    report: dict[str, Any] = {
        "benchmark": "pyramidnet_throughput",
        "command": command,
        "device": _device_name(device),
        "device_type": device.type,
        "versions": _versions(),
        "config": {
            "model": args.model,
            "parameters": n_params,
            "batch_size": args.batch_size,
            "precision": args.precision,
            "channels_last": args.channels_last,
            "compile": args.compile,
            "channel_multiple": args.channel_multiple,
            "warmup": args.warmup,
            "window": args.window,
            "windows": args.windows,
            "rounds": args.rounds,
            "pool_batches": args.pool_batches,
        },
        "rounds": rounds,
        "results": summary,
        "ratio_lightning_over_plain": ratio,
        "ratio_no_log_over_plain": ratio_no_log,
        "wall_seconds": round(time.perf_counter() - start, 1),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "note": args.note,
    }
    stem = args.out_name or (
        f"pyramidnet_throughput_{device.type}"
        + ("_compile" if args.compile else "")
        + (f"_aligned{args.channel_multiple}" if args.channel_multiple > 1 else "")
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out_dir / f"{stem}.md").write_text(_markdown(report))
    print(
        f"pyramidnet_throughput: {args.model} batch {args.batch_size} {args.precision}"
        f"{' channels_last' if args.channels_last else ''}{' compile' if args.compile else ''} on {report['device']}: "
        f"plain {summary['plain']['images_per_s_median']:.1f} img/s, lightning "
        f"{summary['lightning']['images_per_s_median']:.1f} img/s, paired ratio {ratio:.3f} over {args.rounds} "
        f"rounds -> {args.out_dir / stem}.json",
        flush=True,
    )
    return report


if __name__ == "__main__":
    main()
