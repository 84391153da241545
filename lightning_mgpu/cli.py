"""``python -m lightning_mgpu``: LightningCLI with this package's strategies registered.

Any LightningModule and LightningDataModule can be named by ``class_path`` in a YAML config, so recipe configs read
``trainer.strategy: parallel_criterion`` (or ``dp``) without the user importing anything first.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch.cli import LightningCLI

import lightning_mgpu  # noqa: F401  (registers the strategies with Lightning's StrategyRegistry)


def main(args: Sequence[str] | None = None, run: bool = True) -> LightningCLI:
    """Run LightningCLI over any model/datamodule given by ``class_path``.

    ``args`` replaces ``sys.argv[1:]`` (tests drive the CLI in-process this way); ``run=False`` only instantiates.
    """
    return LightningCLI(
        model_class=None,
        datamodule_class=None,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=list(args) if args is not None else None,
        run=run,
    )
