"""dp merges a forward's loss by its declared rule whatever structure carries it (namedtuple fields included)."""

from __future__ import annotations

import importlib
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from strategy_models import trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import DataParallelStrategy

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


def test_each_replicated_module_merges_its_own_scalars_by_its_own_rule():
    """Two parallel modules return a scalar at the same output path (``output[1]``): the encoder an auxiliary
    per-sample mean, the head a summed cross-entropy. Each is merged by its own module's rule."""
    L = importlib.import_module("lightning.pytorch")

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(6, 8)

        def forward(self, x):
            h = torch.tanh(self.lin(x))
            return h, h.pow(2).sum(1).mean()

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 3)
            self.criterion = torch.nn.CrossEntropyLoss(reduction="sum")

        def forward(self, h, labels):
            logits = self.lin(h)
            return logits, self.criterion(logits, labels)

    class TwoModules(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.encoder, self.head = Encoder(), Head()

        def training_step(self, batch, batch_idx):
            x, y = batch
            h, aux = self.encoder(x)
            _, summed = self.head(h, y)
            self.log("summed", summed)
            return summed / len(x) + 0.1 * aux

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(22, 6, generator=g), torch.randint(0, 3, (22,), generator=g))
    runs = {}
    for devices, strategy in ((1, "auto"), (3, DataParallelStrategy(parallel_modules=["encoder", "head"]))):
        module = TwoModules().double()
        t = trainer(strategy, devices, max_steps=4, enable_progress_bar=True)
        t.fit(module, DataLoader(TensorDataset(*(d.double() if d.is_floating_point() else d for d in data.tensors)), 7))
        runs[devices] = (torch.cat([p.flatten() for p in module.parameters()]), float(t.callback_metrics["summed"]))
    torch.testing.assert_close(runs[3][0], runs[1][0], rtol=0, atol=1e-10)
    assert runs[3][1] == pytest.approx(runs[1][1], abs=1e-10, rel=0)
