"""dp merges a forward's loss by its declared rule whatever structure carries it (namedtuple fields included)."""

from __future__ import annotations

import importlib
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from strategy_models import trainer
from torch.utils.data import DataLoader, TensorDataset

Out = namedtuple("Out", ["loss", "logits"])


def _module(namespace: str, record: list[tuple[float, float]]):
    L = importlib.import_module(namespace)

    class SummedLoss(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(4, 3).double()

        def forward(self, x, y):
            logits = self.net(x)
            return Out(F.cross_entropy(logits, y, reduction="sum"), logits)

        def training_step(self, batch, batch_idx):
            out = self(*batch)
            with torch.no_grad():
                whole = F.cross_entropy(self.net(batch[0]), batch[1], reduction="sum")
            record.append((out.loss.item(), whole.item()))
            return out.loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return SummedLoss()


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_a_namedtuple_loss_field_is_merged_by_the_declared_rule(namespace, tmp_path):
    """A summed loss in a namedtuple field, under loss_reduction='sum', is the whole batch's sum on 3 devices (an
    uneven 10 = 4 + 3 + 3 split), not a sample-weighted mean of the shards' sums (about a third of it)."""
    pytest.importorskip(namespace)
    strategies = importlib.import_module(f"lightning_mgpu.strategies.{namespace.replace('.', '_')}")
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(20, 4, dtype=torch.float64, generator=generator), torch.arange(20) % 3)
    record: list[tuple[float, float]] = []
    strategy = strategies.DataParallelStrategy(loss_reduction="sum")
    run = trainer(
        strategy,
        3,
        namespace=namespace,
        max_steps=2,
        default_root_dir=tmp_path,
        logger=True,
        enable_progress_bar=True,
        enable_model_summary=True,
    )
    run.fit(_module(namespace, record), DataLoader(data, 10))
    assert len(record) == 2
    for merged, whole in record:
        assert merged == pytest.approx(whole, rel=1e-12)
