"""One strategy, one fresh process: ``python -m benchmarks.compare.worker --strategy dp --result r.json -c cfg.yaml``.

The parent (``python -m benchmarks.compare``) starts this once per strategy, so each strategy's peak memory is its
own and a crash or an out-of-memory error costs only its own row. It builds the recipe's model and datamodule from
the LightningCLI config (the config's trainer settings such as ``precision`` or ``accumulate_grad_batches`` are
kept; devices, strategy, callbacks, loggers, validation and step counts are the benchmark's), trains ``--steps``
batches and writes one JSON result. Under ``ddp`` Lightning's launcher re-runs this same command once per extra
rank; only rank 0 writes the result.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks.compare.comm import ring_allreduce_bytes
from benchmarks.compare.devices import plan_devices
from benchmarks.compare.strategies import StrategySetup, strategy_setup
from lightning_mgpu.cli import missing_extra_message

# Trainer arguments the benchmark decides; every other trainer setting of the config is kept.
CONTROLLED = frozenset(
    {
        "accelerator",
        "strategy",
        "devices",
        "num_nodes",
        "callbacks",
        "logger",
        "max_steps",
        "min_steps",
        "max_epochs",
        "min_epochs",
        "max_time",
        "limit_train_batches",
        "limit_val_batches",
        "limit_test_batches",
        "limit_predict_batches",
        "overfit_batches",
        "val_check_interval",
        "check_val_every_n_epoch",
        "num_sanity_val_steps",
        "log_every_n_steps",
        "enable_checkpointing",
        "enable_progress_bar",
        "enable_model_summary",
        "default_root_dir",
        "fast_dev_run",
        "profiler",
        "barebones",
    }
)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Worker options, and the LightningCLI arguments that follow ``--``."""
    cli_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, cli_args = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare.worker", description=__doc__)
    parser.add_argument("-c", "--config", action="append", default=[], help="LightningCLI YAML (repeatable)")
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--ddp-batch", choices=["global", "per-process"], default="global")
    parser.add_argument("--no-flops", action="store_true")
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.steps < 2 or not 0 <= args.warmup < args.steps:
        parser.error(f"need --steps >= 2 and 0 <= --warmup < --steps, got {args.steps} and {args.warmup}")
    return args, cli_args


def _rank() -> int:
    """This process's global rank as Lightning's launcher set it (0 for the process the parent started)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def build_from_config(config_args: list[str], batch_divisor: int) -> tuple[Any, Any, dict[str, Any], str | None]:
    """Model, datamodule and the config's trainer settings, through LightningCLI's parser (no Trainer is built).

    ``batch_divisor`` > 1 divides ``data.init_args.batch_size`` (``--ddp-batch global``: under DDP the config's batch
    size is per process, so dividing keeps the global batch of the single-process strategies).
    """
    from lightning.pytorch.cli import LightningCLI

    import lightning_mgpu  # noqa: F401  (registers the strategies, as ``python -m lightning_mgpu`` does)

    captured: dict[str, Any] = {"note": None, "trainer": {}}

    class _ModelAndDataCLI(LightningCLI):
        def before_instantiate_classes(self) -> None:
            key = "data.init_args.batch_size"
            if batch_divisor > 1:
                size = self.config.get(key) if key in self.config else None
                if isinstance(size, int) and size % batch_divisor == 0:
                    self.config[key] = size // batch_divisor
                    each = size // batch_divisor
                    captured["note"] = f"{key}={size} split over {batch_divisor} processes: {each} each"
                else:
                    captured["note"] = f"{key}={size} kept per process (not divisible by {batch_divisor})"

        def instantiate_trainer(self, **kwargs: Any) -> Any:
            captured["trainer"] = dict(**self._get(self.config_init, "trainer", default={}))
            return None

    with warnings.catch_warnings():  # ``args`` replaces this worker's own command line on purpose
        warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python.*")
        cli = _ModelAndDataCLI(
            model_class=None,
            datamodule_class=None,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_callback=None,
            args=config_args,
            run=False,
        )
    trainer_config = {k: v for k, v in captured["trainer"].items() if k not in CONTROLLED}
    return cli.model, cli.datamodule, trainer_config, captured["note"]


def _memory_summary(values: dict[str, float]) -> dict[str, Any]:
    peaks = {
        k[: -len("_peak_mib")]: v
        for k, v in values.items()
        if k.endswith("_peak_mib") and not k.endswith("_reserved_peak_mib")
    }
    reserved = {k[: -len("_reserved_peak_mib")]: v for k, v in values.items() if k.endswith("_reserved_peak_mib")}
    return {"peak_mib": peaks, "reserved_peak_mib": reserved or None, "imbalance": values.get("imbalance")}


def _transfer(setup: StrategySetup, probe: Any, grad_bytes: int) -> dict[str, Any]:
    n = len(setup.devices)
    if setup.kind == "multi-process":
        ring = ring_allreduce_bytes(grad_bytes, n)
        return {
            "outputs": 0,
            "parameters": 0,
            "gradients": ring,
            "total": ring,
            "replicas": n,
            "source": "ring all-reduce of the gradients, 2(N-1)K/N bytes per device (formula, not measured)",
        }
    if probe.last is not None:
        return {
            **probe.last,
            "source": "the last training step, from its outputs and the module size (what distinct devices would move)",
        }
    return {"outputs": 0, "parameters": 0, "gradients": 0, "total": 0, "replicas": 1, "source": "one device"}


def run(args: argparse.Namespace, cli_args: list[str]) -> dict[str, Any]:
    """Train ``args.steps`` batches under ``args.strategy`` and measure them; the result dict (rank 0)."""
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ThroughputMonitor

    from benchmarks.compare import probes
    from lightning_mgpu.callbacks import DeviceMemoryMonitor

    plan = plan_devices(args.accelerator, args.devices, torch.cuda.device_count())
    setup = strategy_setup(args.strategy, plan)
    divisor = setup.world_size if setup.kind == "multi-process" and args.ddp_batch == "global" else 1
    config_args = [a for c in args.config for a in ("--config", c)] + cli_args
    model, datamodule, trainer_config, batch_note = build_from_config(config_args, divisor)

    monitor = DeviceMemoryMonitor(logging_interval=args.steps)
    flops = probes.FlopsProbe(enabled=not args.no_flops, after=monitor.reset_peaks)
    timer, transfer, batch = probes.StepTimer(), probes.TransferProbe(), probes.BatchProbe()
    # The window's first update ends the last warm-up batch (the first batch at least, whose start it cannot see),
    # so its rates cover exactly the timed batches.
    throughput = ThroughputMonitor(
        batch_size_fn=probes.batch_size_fn,
        length_fn=probes.token_count_fn,
        window_size=args.steps - max(args.warmup, 1) + 1,
    )
    recorder = probes.MetricsRecorder()
    with warnings.catch_warnings(), tempfile.TemporaryDirectory(prefix="lightning_mgpu_bench_") as root_dir:
        warnings.filterwarnings("ignore", message=".*(log_every_n_steps|flops_per_batch|does not have many workers).*")
        trainer = L.Trainer(
            **trainer_config,
            **setup.trainer_kwargs,
            max_steps=args.steps,
            max_epochs=-1,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            log_every_n_steps=args.steps,  # ThroughputMonitor computes once, over the timed window, at the end
            logger=recorder,
            callbacks=[flops, timer, monitor, transfer, batch, throughput],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root_dir,  # nothing is meant to be written; if something is, it goes away
        )
        trainer.fit(model, datamodule=datamodule)

    world = trainer.world_size
    params = list(model.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    timed = timer.times[args.warmup :]
    median_step = statistics.median(timed) if timed else None
    batches = trainer.num_training_batches

    def latest(name: str) -> float | None:  # the all-process figure under ddp, this process's otherwise
        value = recorder.latest(f"train/{name}") if world > 1 else None
        return value if value is not None else recorder.latest(f"train/device/{name}")

    return {
        "strategy": args.strategy,
        "status": "ok",
        "kind": setup.kind,
        "accelerator": plan.accelerator,
        "devices": setup.devices,
        "physical_devices": list(dict.fromkeys(setup.devices)),
        "world_size": world,
        "device_names": sorted({torch.cuda.get_device_name(torch.device(d)) for d in setup.devices})
        if plan.accelerator == "gpu"
        else None,
        "precision": str(trainer.precision),
        "torch_threads": torch.get_num_threads(),
        "steps": args.steps,
        "warmup": args.warmup,
        "samples_per_step": batch.samples * world,
        "tokens_per_step": None if batch.tokens is None else batch.tokens * world,
        "batch_note": batch_note,
        "samples_per_s": latest("samples_per_sec"),
        "tokens_per_s": latest("items_per_sec") if batch.tokens is not None else None,
        "flops_per_batch": flops.flops,
        "flops_source": flops.source,
        "flops_error": flops.error,
        "flops_per_s": latest("flops_per_sec"),
        "mfu": recorder.latest("train/device/mfu"),
        "median_step_s": median_step,
        "step_times_s": timer.times,
        "batches_per_epoch": None if math.isinf(batches) else int(batches),
        "epoch_estimate_s": None if median_step is None or math.isinf(batches) else median_step * batches,
        "memory": {
            "kind": "cuda_max_memory_allocated" if plan.accelerator == "gpu" else "process_peak_rss",
            **_memory_summary(monitor.last),
        },
        "transfer_bytes_per_step": _transfer(setup, transfer, grad_bytes),
        "model": {
            "parameters": sum(p.numel() for p in params),
            "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
            "gradient_bytes": grad_bytes,
        },
    }


def _failure(args: argparse.Namespace, err: BaseException) -> dict[str, Any]:
    message = f"{type(err).__name__}: {err}".strip()
    if missing := missing_extra_message(err, "the benchmark's worker"):
        message = missing
    elif isinstance(err, SystemExit):  # LightningCLI's parser printed its reason to the log, then exited
        message = f"LightningCLI rejected the configuration (exit status {err.code}): see the log's last lines"
    oom = isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in message.lower()
    memory = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        from lightning_mgpu.callbacks import read_device_memory

        memory = read_device_memory([torch.device("cuda", i) for i in range(torch.cuda.device_count())])
    return {
        "strategy": args.strategy,
        "status": "oom" if oom else "failed",
        "error": message if len(message) <= 2000 else message[:2000] + " …",
        "memory_at_failure_mib": memory,
    }


def _write(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    """Run one strategy and write its result; exit status 0 when it trained, 1 when it failed."""
    args, cli_args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        result = run(args, cli_args)
    except BaseException as err:  # also SystemExit from LightningCLI's parser: every failure becomes a row
        if not isinstance(err, SystemExit):  # the parser has printed its own reason, which a traceback would bury
            traceback.print_exc()
        if _rank() == 0:
            _write(args.result, _failure(args, err))
        return 1
    if _rank() == 0:
        _write(args.result, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
