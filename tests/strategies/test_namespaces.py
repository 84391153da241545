"""Both Lightning namespaces: ``lightning.pytorch`` and the separately importable ``pytorch_lightning`` copy.

``import lightning_mgpu`` imports neither; each gets its own strategy classes in its own registry, whatever the import
order. Run in fresh interpreters, since which namespaces are imported is process state.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import lightning_mgpu


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=240, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_the_core_imports_no_lightning_and_the_namespaces_register_in_either_order():
    out = _run(
        """
        import sys
        import lightning_mgpu
        from lightning_mgpu import DataParallelModel
        print("core", "lightning" in sys.modules, "pytorch_lightning" in sys.modules)
        import pytorch_lightning as pl
        print("pl", "lightning.pytorch" in sys.modules)
        t = pl.Trainer(strategy="parallel_criterion", accelerator="cpu", devices=2, logger=False)
        print("pl-trainer", type(t.strategy).__module__, isinstance(t.strategy, pl.strategies.ParallelStrategy))
        t = pl.Trainer(strategy="data_parallel", accelerator="cpu", devices=2, logger=False)
        print("pl-dp", type(t.strategy).__name__)
        import lightning.pytorch as L
        t = L.Trainer(strategy="dp", accelerator="cpu", devices=2, logger=False)
        print("L-trainer", type(t.strategy).__module__, isinstance(t.strategy, L.strategies.ParallelStrategy))
        """
    )
    assert "core False False" in out  # the pure-PyTorch core pays for no Lightning import
    assert "pl False" in out  # a pytorch_lightning project does not import lightning.pytorch through us
    assert "pl-trainer lightning_mgpu.strategies.pytorch_lightning True" in out
    assert "pl-dp DataParallelStrategy" in out
    assert "L-trainer lightning_mgpu.strategies.lightning_pytorch True" in out


def test_namespace_imported_before_the_package_and_instances_of_its_classes():
    out = _run(
        """
        import pytorch_lightning as pl
        import lightning_mgpu
        from lightning_mgpu.strategies.pytorch_lightning import ParallelCriterionStrategy
        t = pl.Trainer(strategy=ParallelCriterionStrategy(loss_reduction="samples"), accelerator="cpu", devices=3)
        print("instance", t.strategy.loss_reduction, t.num_devices, t.world_size)
        print("registered", "parallel_criterion" in pl.strategies.StrategyRegistry)
        """
    )
    assert "instance samples 3 1" in out and "registered True" in out


def test_the_class_attribute_imports_the_namespace_and_registers():
    """``lightning_mgpu.ParallelCriterionStrategy`` imports lightning.pytorch itself; that import must register too."""
    out = _run(
        """
        import lightning_mgpu
        cls = lightning_mgpu.ParallelCriterionStrategy
        from lightning.pytorch.strategies import StrategyRegistry
        print("registered", StrategyRegistry["parallel_criterion"]["strategy"] is cls)
        """
    )
    assert "registered True" in out


def test_registration_is_idempotent_and_explicit():
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["parallel_criterion"]["strategy"] is lightning_mgpu.ParallelCriterionStrategy
    assert StrategyRegistry["data_parallel"]["strategy"] is lightning_mgpu.DataParallelStrategy
    assert set(lightning_mgpu.register_strategies()) >= {"lightning.pytorch"}
    lightning_mgpu.register_strategies("pytorch_lightning")
    lightning_mgpu.register_strategies("pytorch_lightning")
    import pytorch_lightning as pl

    assert pl.strategies.StrategyRegistry["dp"]["strategy"].__module__ == "lightning_mgpu.strategies.pytorch_lightning"
    with pytest.raises(ValueError, match="Unknown Lightning namespace 'lightning'"):
        lightning_mgpu.register_strategies("lightning")


def test_one_strategy_instance_belongs_to_one_trainer():
    import lightning.pytorch as L

    strategy = lightning_mgpu.ParallelCriterionStrategy()
    L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    for accelerator in ("cpu", "auto"):
        with pytest.raises(Exception, match=r"already belongs to another Trainer.*new instance for each Trainer"):
            L.Trainer(strategy=strategy, accelerator=accelerator, devices=2, logger=False)
