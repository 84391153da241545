"""The batch's sample count comes from its DataLoader: a collate_fn that returns its samples as they are (a list of
``((view1, view2), label)`` pairs, lightning-bolts-style SimCLR) is split by item under ``parallel_criterion``, and by
``dp``'s forward, instead of cutting each ``(3, 8, 8)`` image into channel slices; both equal one device (float64, to
1e-9, divisible and uneven batches, 2 and 3 devices, both Lightning namespaces). A batch that cannot be split
consistently with that count is refused naming the part and the fix; ``dim=1`` labels shaped ``(B, 1)`` are told that
their samples are on dim 0, and the fix told works; synchronised BatchNorm runs one-sample shards as one device does.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.trainer.states import RunningStage
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, SequentialSampler, TensorDataset

import lightning_mgpu
from lightning_mgpu.parallel.scatter_gather import BatchSplitError
from lightning_mgpu.strategies import loader_batch
from lightning_mgpu.strategies.loader_batch import loader_sample_counts, step_sample_counts
from tests.strategies.strategy_models import NAMESPACES

TOLERANCE = 1e-9


class Pairs(Dataset):
    """Two augmented views of an ``(3, 8, 8)`` image and its label, per sample (SimCLR's training transform)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64)
        self.noise = 0.1 * torch.randn(2, n, 3, 8, 8, generator=g, dtype=torch.float64)
        self.labels = torch.randint(0, 3, (n,), generator=g).tolist()

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
        return (self.images[i] + self.noise[0, i], self.images[i].flip(-1) + self.noise[1, i]), self.labels[i]


def per_sample_pairs(items: list[Any]) -> list[Any]:
    """The collate of the issue: the ``((view1, view2), label)`` items, one per sample, returned as they are."""
    return list(items)


def pairs_loader(n: int, batch_size: int, collate: str = "pairs") -> DataLoader:
    """``collate="pairs"``: the per-sample items; ``"default"``: ``default_collate``'s ``[[view1s, view2s], labels]``
    (what lightning-bolts' SimCLR datamodules give), whose full batches are no last batch's items."""
    return DataLoader(Pairs(n), batch_size=batch_size, collate_fn=per_sample_pairs if collate == "pairs" else None)


@functools.cache
def simclr_class(namespace: str) -> type:
    """A SimCLR-like module on ``namespace``: a conv encoder with BatchNorm, a projection head with BatchNorm1d, the
    NT-Xent loss over the gathered batch (each device its own rows), an online linear probe on the labels. Its forward
    takes the per-sample items themselves, so that ``dp`` splits them."""
    L = importlib.import_module(namespace)

    class SimCLRLike(L.LightningModule):
        def __init__(self, temperature: float = 0.5) -> None:
            super().__init__()
            self.temperature = temperature
            self.encoder = nn.Sequential(
                nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
            )
            self.projection = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))

        def forward(self, items: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
            if isinstance(items[0][0], torch.Tensor):  # default_collate's [[view1s, view2s], labels]
                first, second = items[0]
            else:  # a channel slice would fail the conv here
                first = torch.stack([views[0] for views, _ in items])
                second = torch.stack([views[1] for views, _ in items])
            return self.projection(self.encoder(first)), self.projection(self.encoder(second))

        def nt_xent(self, batch: list[Any]) -> torch.Tensor:
            z1, z2 = (F.normalize(z, dim=-1) for z in self(batch))
            all1 = self.all_gather(z1, sync_grads=True)
            all2 = self.all_gather(z2, sync_grads=True)
            if self.trainer.world_size > 1:
                all1, all2 = all1.flatten(0, 1), all2.flatten(0, 1)
            logits = all1 @ all2.T / self.temperature
            labels = torch.arange(len(all1), device=logits.device)
            rows = lightning_mgpu.local_rows(len(z1))
            # Both directions in one mean (the sum of two means over shards of 2 is read wrong at HEAD: halved).
            return F.cross_entropy(torch.cat([logits[rows], logits.T[rows]]), labels[rows].repeat(2))

        def training_step(self, batch: list[Any], batch_idx: int) -> torch.Tensor:
            loss = self.nt_xent(batch)
            # batch_size=: Lightning cannot read it off a list of pairs (it would take the images' 3 channels).
            self.log("train_loss", loss, prog_bar=True, batch_size=self.samples(batch))
            return loss

        def validation_step(self, batch: list[Any], batch_idx: int) -> None:
            self.log("val_loss", self.nt_xent(batch), prog_bar=True, batch_size=self.samples(batch))

        @staticmethod
        def samples(batch: list[Any]) -> int:
            return len(batch[1]) if isinstance(batch[0][0], torch.Tensor) else len(batch)  # default_collate's, or pairs

        def predict_step(self, batch: list[Any], batch_idx: int) -> torch.Tensor:
            return self(batch)[0]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

    return SimCLRLike


def default_trainer(namespace: str, strategy: Any, devices: int, root: Any, **kwargs: Any) -> Any:
    """A Trainer with Lightning's default callbacks (checkpoint, progress bar, model summary) and logger."""
    L = importlib.import_module(namespace)
    return L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_epochs=1, default_root_dir=root, **kwargs
    )


def fit_simclr(
    namespace: str, strategy: Any, devices: int, n: int, batch_size: int, root: Any, collate: str = "pairs"
) -> dict[str, Any]:
    torch.manual_seed(0)
    module = simclr_class(namespace)().double()
    trainer = default_trainer(namespace, strategy, devices, root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice about workers and ambiguous batch sizes
        trainer.fit(module, pairs_loader(n, batch_size, collate), pairs_loader(n, batch_size + 1, collate))
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        predicted = trainer.predict(module, pairs_loader(n, batch_size, collate))
    return {
        "state": {k: v.clone() for k, v in module.state_dict().items() if v.is_floating_point()},
        "metrics": metrics,
        "predicted": torch.cat(predicted),
    }


@functools.cache
def one_device(namespace: str, n: int, batch_size: int, root: str, collate: str) -> dict[str, Any]:
    return fit_simclr(namespace, "auto", 1, n, batch_size, root, collate)


def assert_equal_runs(run: dict[str, Any], reference: dict[str, Any]) -> None:
    for key, value in reference["state"].items():
        assert (run["state"][key] - value).abs().max() <= TOLERANCE, key
    assert run["metrics"].keys() == reference["metrics"].keys()
    for key, value in reference["metrics"].items():
        assert abs(run["metrics"][key] - value) <= TOLERANCE, key
    assert (run["predicted"] - reference["predicted"]).abs().max() <= TOLERANCE


@pytest.mark.parametrize(
    ("namespace", "strategy", "devices", "n", "batch_size", "collate"),
    [
        (NAMESPACES[0], "parallel_criterion", 2, 10, 5, "pairs"),  # divisible: 5 + 5, shards 3/2
        (NAMESPACES[0], "parallel_criterion", 3, 10, 4, "pairs"),  # 4, 4, 2: shards 2/1/1, the last 1/1
        (NAMESPACES[0], "parallel_criterion", 2, 11, 3, "pairs"),  # batch 3 over 2: a one-sample shard, BatchNorm
        (NAMESPACES[0], "dp", 2, 10, 4, "pairs"),
        (NAMESPACES[0], "dp", 3, 10, 5, "pairs"),
        (NAMESPACES[1], "parallel_criterion", 2, 10, 4, "pairs"),
        (NAMESPACES[1], "dp", 3, 11, 3, "pairs"),
        (NAMESPACES[0], "parallel_criterion", 2, 10, 4, "default"),  # full batches' 2 views: no last batch of 2
        (NAMESPACES[1], "dp", 2, 10, 4, "default"),
    ],
)
def test_per_sample_pairs_are_split_by_item_and_equal_one_device(
    namespace, strategy, devices, n, batch_size, collate, tmp_path
):
    root = str(tmp_path.parent / f"one-{namespace}-{n}-{batch_size}-{collate}")
    reference = one_device(namespace, n, batch_size, root, collate)
    run = fit_simclr(namespace, strategy, devices, n, batch_size, tmp_path, collate)
    assert_equal_runs(run, reference)


def test_before_the_loader_count_each_image_was_cut_into_channel_slices():
    """What the issue saw: without the DataLoader's count, the split reads the images' first dimension."""
    batch = per_sample_pairs([Pairs(5)[i] for i in range(5)])
    chunks, sizes = lightning_mgpu.split_batch(batch, ["cpu"] * 2)
    assert sizes == [2, 1] and chunks[0][0][0][0].shape == (2, 8, 8)  # 3 channels: 2 + 1, every sample on each
    chunks, sizes = lightning_mgpu.split_batch(batch, ["cpu"] * 2, samples=(5,))
    assert sizes == [3, 2] and chunks[0][0][0][0].shape == (3, 8, 8)


def test_a_list_that_is_not_one_item_per_sample_beside_batch_tensors_is_refused_naming_it_and_the_fix(tmp_path):
    def lossy(items: list[Any]) -> tuple[torch.Tensor, list[Any]]:
        return torch.tensor([label for _, label in items]), list(items)[:-1]

    module = simclr_class(NAMESPACES[0])().double()
    module.training_step = lambda batch, batch_idx: module.nt_xent(batch[1])
    loader = DataLoader(Pairs(10), batch_size=5, collate_fn=lossy)
    trainer = default_trainer(NAMESPACES[0], "parallel_criterion", 2, tmp_path, enable_progress_bar=False)
    with pytest.raises(BatchSplitError) as raised:
        trainer.fit(module, loader)
    message = str(raised.value)
    assert "batch[1] is a list of 4 tuples, but the DataLoader's batch holds 5 samples (batch[0] has 5)" in message
    assert "Return every sample's item from your collate_fn (5 of them)" in message


def test_a_tensor_that_disagrees_with_the_per_sample_items_is_refused_naming_both_and_the_fix(tmp_path):
    def with_weights(items: list[Any]) -> tuple[list[Any], torch.Tensor]:
        return list(items), torch.ones(3, dtype=torch.float64)  # class weights: not per sample

    module = simclr_class(NAMESPACES[1])().double()
    module.training_step = lambda batch, batch_idx: module.nt_xent(batch[0])
    loader = DataLoader(Pairs(10), batch_size=5, collate_fn=with_weights)
    trainer = default_trainer(NAMESPACES[1], "dp", 2, tmp_path, enable_progress_bar=False)
    trainer.fit(module, loader)  # dp: the forward gets the items alone, which split by item
    strategy = lightning_mgpu.strategies.pytorch_lightning.ParallelCriterionStrategy()
    trainer = default_trainer(NAMESPACES[1], strategy, 2, tmp_path, enable_progress_bar=False)
    with pytest.raises(BatchSplitError) as raised:
        trainer.fit(module, loader)
    message = str(raised.value)
    assert "batch[0] is a list of 5 tuples, one per sample of the DataLoader's batch (5 samples)" in message
    assert "but batch[1] has size 3 along dim 0" in message
    assert "keep what is not per sample out of the batch (a buffer of the module" in message


# --- dim=1: labels (B, 1) beside (T, B, F) inputs ---------------------------------------------------------------------
def time_major(items: list[Any], labels_on_dim_1: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.stack([x for x, _ in items], dim=1)  # (T, B, F)
    y = torch.stack([y for _, y in items]).unsqueeze(1)  # (B, 1)
    return x, y.movedim(0, 1) if labels_on_dim_1 else y  # the fix the error message gives: (1, B)


@functools.cache
def sequence_class(namespace: str) -> type:
    L = importlib.import_module(namespace)

    class Sequence(L.LightningModule):
        def __init__(self, labels_on_dim_1: bool) -> None:
            super().__init__()
            self.labels_on_dim_1 = labels_on_dim_1
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)  # (T, B, 3): dp gathers outputs along dim 1 too

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            y = y.movedim(1, 0) if self.labels_on_dim_1 else y  # back to (B, 1), as the message says
            loss = F.cross_entropy(self(x).mean(0), y.squeeze(1))
            self.log("train_loss", loss, batch_size=x.shape[1])
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.3)

    return Sequence


def sequence_run(namespace: str, strategy: Any, devices: int, labels_on_dim_1: bool, root: Any) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(10, 5, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (10,)))
    loader = DataLoader(data, batch_size=4, collate_fn=functools.partial(time_major, labels_on_dim_1=labels_on_dim_1))
    torch.manual_seed(0)
    module = sequence_class(namespace)(labels_on_dim_1).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = default_trainer(namespace, strategy, devices, root)
        trainer.fit(module, loader)
    return {"state": dict(module.state_dict()), "metrics": {"loss": float(trainer.callback_metrics["train_loss"])}}


def test_dim_1_labels_with_the_batch_on_dim_0_are_told_so_and_the_fix_told_equals_one_device(tmp_path):
    strategy = lightning_mgpu.ParallelCriterionStrategy(dim=1)
    with pytest.raises(BatchSplitError) as raised:
        sequence_run(NAMESPACES[0], strategy, 2, False, tmp_path)
    message = str(raised.value)
    assert "batch[1] has shape (4, 1): its 4 samples are on dim 0, not on dim 1" in message
    assert "`.movedim(0, 1)` (shape (1, 4)), and back in the step, `.movedim(1, 0)`" in message
    assert "keep it out of what is split" not in message  # the old advice, wrong here

    reference = sequence_run(NAMESPACES[0], "auto", 1, True, tmp_path)
    for namespace, strategy, devices in [
        (NAMESPACES[0], lightning_mgpu.ParallelCriterionStrategy(dim=1), 2),
        (NAMESPACES[0], lightning_mgpu.DataParallelStrategy(dim=1), 3),
        (NAMESPACES[1], lightning_mgpu.strategies.pytorch_lightning.ParallelCriterionStrategy(dim=1), 3),
    ]:
        run = sequence_run(namespace, strategy, devices, True, tmp_path)
        for key, value in reference["state"].items():
            assert (run["state"][key] - value).abs().max() <= TOLERANCE, (strategy, key)
        assert abs(run["metrics"]["loss"] - reference["metrics"]["loss"]) <= TOLERANCE


# --- BatchNorm on one-sample shards -----------------------------------------------------------------------------------
@functools.cache
def batchnorm_class(namespace: str) -> type:
    L = importlib.import_module(namespace)

    class WithBatchNorm1d(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = F.cross_entropy(self.net(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.3)

    return WithBatchNorm1d


@pytest.mark.parametrize(
    ("namespace", "strategy", "devices", "n", "batch_size"),
    [
        (NAMESPACES[0], "parallel_criterion", 2, 6, 3),  # shards 2/1
        (NAMESPACES[0], "parallel_criterion", 3, 10, 4),  # shards 2/1/1, the last batch 1/1
        (NAMESPACES[1], "dp", 3, 8, 3),  # 3, 3, 2: shards 1/1/1, the last 1/1
    ],
)
def test_synchronised_batchnorm_runs_one_sample_shards_as_one_device(namespace, strategy, devices, n, batch_size):
    g = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, 2, (n,), generator=g))
    runs = []
    for strategy_, devices_ in [("auto", 1), (strategy, devices)]:
        torch.manual_seed(0)
        module = batchnorm_class(namespace)().double()
        L = importlib.import_module(namespace)
        trainer = L.Trainer(
            strategy=strategy_,
            accelerator="cpu",
            devices=devices_,
            max_epochs=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, DataLoader(data, batch_size=batch_size))
        runs.append((module.state_dict(), float(trainer.callback_metrics["train_loss"])))
    (reference, loss), (state, run_loss) = runs
    for key, value in reference.items():
        assert (state[key].double() - value.double()).abs().max() <= TOLERANCE, key
    assert abs(run_loss - loss) <= TOLERANCE


# --- the counts, read once per DataLoader -----------------------------------------------------------------------------
class Stream(IterableDataset):
    def __iter__(self) -> Any:
        return iter(range(10))


class Unsized(SequentialSampler):
    def __len__(self) -> int:
        raise TypeError("no length")


class Buckets:
    """A batch sampler of its own: batch sizes vary."""

    def __iter__(self) -> Any:
        return iter([[0, 1, 2], [3], [4, 5]])

    def __len__(self) -> int:
        return 3


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda data: DataLoader(data, batch_size=4), (4, 2)),
        (lambda data: DataLoader(data, batch_size=5), (5,)),
        (lambda data: DataLoader(data, batch_size=4, drop_last=True), (4,)),
        (lambda data: DataLoader(data, batch_size=16), (16, 10)),  # one batch, smaller than the batch size
        (lambda data: DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 3, False)), (3, 1)),
        (lambda data: DataLoader(data, batch_sampler=Buckets()), ()),
        (lambda data: DataLoader(data, batch_size=None), ()),
        (lambda data: DataLoader(data, batch_size=4, sampler=Unsized(data)), ()),
        (lambda data: DataLoader(Stream(), batch_size=4), ()),
        (lambda data: [1, 2], ()),  # not a DataLoader
    ],
)
def test_loader_sample_counts(make, expected):
    assert loader_sample_counts(make(TensorDataset(torch.arange(10)))) == expected


def test_counts_are_read_once_per_dataloader(monkeypatch):
    loader = DataLoader(TensorDataset(torch.arange(10)), batch_size=3)
    reads = []
    monkeypatch.setattr(loader_batch, "_read_counts", lambda dl: reads.append(dl) or (3, 1))
    assert [loader_sample_counts(loader) for _ in range(3)] == [(3, 1)] * 3
    assert reads == [loader]


def fake_module(stage: RunningStage | None, **loaders: Any) -> Any:
    trainer = SimpleNamespace(state=SimpleNamespace(stage=stage), **loaders)
    return SimpleNamespace(trainer=trainer)


def test_step_counts_follow_the_stage_and_the_dataloader_index():
    data = TensorDataset(torch.arange(10))
    a, b = DataLoader(data, batch_size=4), DataLoader(data, batch_size=5)
    assert step_sample_counts(fake_module(RunningStage.TRAINING, train_dataloader=a), ("batch", 0)) == (4, 2)
    assert step_sample_counts(fake_module(RunningStage.TRAINING, train_dataloader={"a": a, "b": b})) == ()
    validating = fake_module(RunningStage.VALIDATING, val_dataloaders=[a, b])
    assert step_sample_counts(validating, ("batch", 3, 1)) == (5,)  # the dataloader index comes last
    assert step_sample_counts(validating, ("batch", 0)) == (4, 2)  # a step without batch_idx: (batch, index)
    assert step_sample_counts(validating, None) == ()  # dp's forward: the loaders disagree
    assert step_sample_counts(fake_module(RunningStage.TESTING, test_dataloaders=[a]), ("batch", 7)) == (4, 2)
    sanity = fake_module(RunningStage.SANITY_CHECKING, val_dataloaders={"x": b, "y": b})
    assert step_sample_counts(sanity, None) == (5,)
    assert step_sample_counts(fake_module(RunningStage.PREDICTING, predict_dataloaders=iter([a])), None) == ()
    assert step_sample_counts(fake_module(None), None) == ()
    assert step_sample_counts(SimpleNamespace(), None) == ()  # not attached to a trainer
