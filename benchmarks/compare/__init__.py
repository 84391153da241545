"""Strategy-comparison benchmark, run from a clone's root: ``python -m benchmarks.compare -c <recipe config>``.

Trains a LightningCLI recipe config for a few steps under each strategy (``single``, ``dp``, ``parallel_criterion``,
``ddp``), each in a fresh process, and reports throughput, step time, peak memory per device, the imbalance between
devices and the bytes moved to the root device, beside the parameter-server / ring all-reduce communication model,
as JSON, markdown and a PNG chart. See :mod:`benchmarks.compare.cli` for the options.
"""

from benchmarks.compare.cli import main

__all__ = ["main"]
