"""``CIFAR10DataModule``: CIFAR-10 (or its synthetic stand-in) as uint8 tensors, augmented on the device.

The loaders only index uint8 tensors, a whole batch at a time; random crop, flip and normalisation run on the
device in ``on_after_batch_transfer`` (see ``augment.py``), so on a GPU the accelerator, not the loader, sets the pace.
Training batches are augmented (random crop and horizontal flip, each with its own switch: ``crop_padding`` and
``flip``), validation/test/predict batches only normalised, all in the memory format the attached LightningModule asks
for (its ``channels_last`` attribute) and in the dtype it trains in (its parameters' dtype: float64 under
``precision=64-true``, float16/bfloat16 under ``16-true``/``bf16-true``, float32 under ``32-true`` and the mixed
precisions, whose autocast casts inside the model). Lightning's precision plugins convert a batch's floating-point
tensors before ``on_after_batch_transfer``, when these batches are still uint8, so the conversion happens here.

The training order is a function of the seed and the epoch only (:class:`ShuffledBatches`): a new order every epoch,
the same one for the same seed, and a run resumed at epoch ``k`` replays epoch ``k``'s order, not epoch 0's.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as L
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler, SequentialSampler
from typing_extensions import override

from recipes.pyramidnet.augment import transform_batch
from recipes.pyramidnet.sources import CIFARSplits, download_hub, is_local_source, load_cifar10

__all__ = ["CIFAR10DataModule", "ShuffledBatches", "TensorBatches", "epoch_seed", "global_seed"]


class TensorBatches(Dataset):
    """Images and labels indexed by a *list* of indices: one ``__getitem__`` returns a whole batch.

    Used with ``DataLoader(batch_size=None, sampler=...)`` and a sampler of index lists: no per-sample collation.
    Lightning can still shard it across DDP processes (it wraps that sampler in its ``DistributedSamplerWrapper``).
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images = images
        self.labels = labels

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return self.images[index], self.labels[index]


def global_seed() -> int:
    """The seed of the last ``seed_everything`` call in this process (it sets ``PL_GLOBAL_SEED``), 0 without one."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed for ``(seed, epoch)``; distinct pairs get unrelated seeds.

    A hash rather than ``seed + epoch``: with the sum, seed 0 at epoch 1 would replay seed 1's epoch 0.
    """
    digest = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class ShuffledBatches(Sampler[list[int]]):
    """Batches of indices of a random permutation of ``range(size)`` that depends on ``(seed, epoch)`` only.

    So the order is reproducible from the seed, changes every epoch, does not depend on how often the loader was
    rebuilt (``reload_dataloaders_every_n_epochs``), and a run resumed at epoch ``k`` sees epoch ``k``'s order. Under
    ddp, Lightning's ``DistributedSamplerWrapper`` deals whole batches of this order to the ranks; every rank computes
    the same order, so their batches are disjoint.

    The epoch of a pass is, in this order: what ``epoch_source()`` returns (the data module passes the trainer's
    ``current_epoch``), else the last ``set_epoch`` (the ``DistributedSampler`` convention), else one more than the
    previous pass (a plain loop gets epochs 0, 1, 2, ...). The source matters under Lightning: it creates the first
    epoch's iterator before calling ``set_epoch``, and under ddp its wrapper lists the batches right then, so on
    resume ``set_epoch`` alone would come too late for the first epoch. The epoch is read when the first batch is
    drawn.
    """

    def __init__(
        self,
        size: int,
        batch_size: int,
        drop_last: bool,
        seed: int,
        epoch_source: Callable[[], int | None] | None = None,
    ) -> None:
        if size < 1 or batch_size < 1:
            raise ValueError(f"size and batch_size must be >= 1, got size={size} batch_size={batch_size}")
        self.size = size
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.seed = seed
        self.epoch_source = epoch_source
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass use ``epoch``'s order (unless ``epoch_source`` gives one)."""
        self.epoch = epoch

    def _take_epoch(self) -> int:
        """The epoch of the pass starting now; the next pass defaults to the one after it."""
        epoch = self.epoch_source() if self.epoch_source is not None else None
        if epoch is None:
            epoch = self.epoch
        self.epoch = epoch + 1
        return epoch

    def order(self, epoch: int) -> torch.Tensor:
        """The permutation of epoch ``epoch`` (before batching)."""
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(epoch_seed(self.seed, epoch)))

    def __len__(self) -> int:
        return self.size // self.batch_size if self.drop_last else math.ceil(self.size / self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order(self._take_epoch())  # a generator: runs at the first next(), after Lightning's set_epoch
        for i in range(len(self)):
            yield order[i * self.batch_size : (i + 1) * self.batch_size].tolist()


class CIFAR10DataModule(L.LightningDataModule):
    """CIFAR-10 for the PyramidNet recipe.

    Args:
        source: ``"synthetic"`` (generated offline, learnable), a local path (the python pickles folder
            ``cifar-10-batches-py``, a ``save_to_disk`` DatasetDict, or a parquet folder; relative paths that do not
            exist must start with ``./``), or a Hugging Face Hub dataset name (downloaded in ``prepare_data``).
        batch_size: training batch size per process (the global batch under single-process strategies such as
            ``parallel_criterion`` and ``dp``, which split it across devices).
        eval_batch_size: validation/test batch size (default: ``batch_size``).
        val_split: images held out of the training set for validation, as a count (int ≥ 1) or a fraction
            (0 < float < 1), chosen with ``seed``. ``0`` validates on the test set, as the paper reports test error.
        seed: seeds the split, the synthetic data and the training order (with the epoch, see ``ShuffledBatches``).
            ``None``: the global seed of ``seed_everything`` (``seed_everything: N`` in a config), 0 without one.
            Under ddp every process needs the same seed (as Lightning's own distributed sampler does): the ranks
            then agree on the split and on the order whose batches they share out.
        num_workers: DataLoader worker processes (0 is right for in-memory tensors).
        augment: augment training batches at all (``False``: training batches are only normalised, like the others).
        crop_padding: zero padding of the random crop, 4 in the paper; 0 turns the crop off.
        flip: random horizontal flip of half the training images, as in the paper; ``False`` turns it off alone, for
            data where a mirror image is another class (digits, text).
        drop_last: drop the last, smaller training batch.
        pin_memory: pin host batches (faster host-to-GPU copies).
        synthetic_train_size: images in the synthetic training set.
        synthetic_test_size: images in the synthetic test set.
        cache_dir: ``datasets`` cache folder for Hub downloads.
    """

    def __init__(
        self,
        source: str = "uoft-cs/cifar10",
        batch_size: int = 128,
        eval_batch_size: int | None = None,
        val_split: int | float = 0,
        seed: int | None = None,
        num_workers: int = 0,
        augment: bool = True,
        crop_padding: int = 4,
        flip: bool = True,
        drop_last: bool = False,
        pin_memory: bool = False,
        synthetic_train_size: int = 5000,
        synthetic_test_size: int = 1000,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if isinstance(val_split, float) and not 0 <= val_split < 1:
            raise ValueError(f"a fractional val_split must be in [0, 1), got {val_split}")
        if val_split < 0:
            raise ValueError(f"val_split must be >= 0, got {val_split}")
        if crop_padding < 0:
            raise ValueError(f"crop_padding must be >= 0 (0 turns the random crop off), got {crop_padding}")
        self.save_hyperparameters()
        self.source = source
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.val_split = val_split
        self.seed = seed
        self.num_workers = num_workers
        self.augment = augment
        self.crop_padding = crop_padding
        self.flip = flip
        self.drop_last = drop_last
        self.pin_memory = pin_memory
        self.synthetic_sizes = (synthetic_train_size, synthetic_test_size)
        self.cache_dir = cache_dir
        self.classes: tuple[str, ...] = ()
        self.train_set: TensorBatches | None = None
        self.val_set: TensorBatches | None = None
        self.test_set: TensorBatches | None = None
        self._splits: CIFARSplits | None = None
        self._seed: int | None = None

    @property
    def effective_seed(self) -> int:
        """The seed in use: ``seed``, else the global seed (see ``seed``); fixed at first use."""
        if self._seed is None:
            self._seed = self.seed if self.seed is not None else global_seed()
        return self._seed

    @property
    def uses_hub(self) -> bool:
        return self.source != "synthetic" and not is_local_source(self.source)

    def prepare_data(self) -> None:
        """Download a Hub dataset into the cache once (rank 0); local and synthetic sources need nothing."""
        if self.uses_hub:
            download_hub(self.source, cache_dir=self.cache_dir)

    def load(self) -> CIFARSplits:
        """Load (once) the train and test sets from ``source``."""
        if self._splits is None:
            self._splits = load_cifar10(self.source, self.cache_dir, self.synthetic_sizes, self.effective_seed)
            self.classes = self._splits.classes
        return self._splits

    def _num_val(self, n_train: int) -> int:
        n = round(self.val_split * n_train) if isinstance(self.val_split, float) else int(self.val_split)
        if n >= n_train:
            raise ValueError(f"val_split={self.val_split} leaves no training images out of {n_train}")
        return n

    def setup(self, stage: str | None = None) -> None:
        """Split the training set into train/validation (seeded) and wrap the tensors for batch indexing."""
        if self.train_set is not None:
            return
        splits = self.load()
        n_train = splits.train_images.shape[0]
        n_val = self._num_val(n_train)
        if n_val:
            perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(self.effective_seed))
            val_idx, train_idx = perm[:n_val].sort().values, perm[n_val:].sort().values
            self.train_set = TensorBatches(splits.train_images[train_idx], splits.train_labels[train_idx])
            self.val_set = TensorBatches(splits.train_images[val_idx], splits.train_labels[val_idx])
        else:
            self.train_set = TensorBatches(splits.train_images, splits.train_labels)
            self.val_set = TensorBatches(splits.test_images, splits.test_labels)
        self.test_set = TensorBatches(splits.test_images, splits.test_labels)

    def _trainer_epoch(self) -> int | None:
        """The attached trainer's epoch (restored from the checkpoint on resume); ``None`` without a trainer."""
        return self.trainer.current_epoch if self.trainer is not None else None

    def _loader(self, dataset: TensorBatches | None, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("CIFAR10DataModule.setup() must run before asking for a dataloader")
        sampler: Sampler[list[int]]
        if train:
            sampler = ShuffledBatches(
                len(dataset), self.batch_size, self.drop_last, self.effective_seed, epoch_source=self._trainer_epoch
            )
        else:
            sampler = BatchSampler(SequentialSampler(dataset), self.eval_batch_size, False)
        return DataLoader(
            dataset,
            batch_size=None,
            sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, train=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, train=False)

    def transform(
        self, images: torch.Tensor, train: bool, channels_last: bool = False, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """uint8 batch → normalised ``dtype`` batch, augmented when ``train`` and ``augment`` (see ``augment.py``)."""
        return transform_batch(
            images,
            train=train and self.augment,
            padding=self.crop_padding,
            flip=self.flip,
            channels_last=channels_last,
            dtype=dtype,
        )

    def model_wants_channels_last(self) -> bool:
        """Whether the attached LightningModule has a true ``channels_last`` attribute (``PyramidNetModule`` does).

        The model owns the memory format (its weights are converted); the batches follow it, so the two cannot
        disagree and there is one setting, ``model.init_args.channels_last``.
        """
        module = self.trainer.lightning_module if self.trainer is not None else None
        return bool(getattr(module, "channels_last", False))

    def model_dtype(self) -> torch.dtype:
        """The floating-point dtype the attached LightningModule trains in (float32 without one).

        Its parameters' dtype, which the trainer's precision plugin has set (``64-true`` → float64, ``16-true`` →
        float16, ``bf16-true`` → bfloat16; mixed precisions keep float32 parameters and autocast inside the model).
        """
        module = self.trainer.lightning_module if self.trainer is not None else None
        dtype = getattr(module, "dtype", torch.float32)
        return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32

    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Augment/normalise the batch on its device, in the model's memory format and dtype; augmentation only in
        training."""
        images, labels = batch
        training = self.trainer is not None and self.trainer.training
        out = self.transform(
            images, train=training, channels_last=self.model_wants_channels_last(), dtype=self.model_dtype()
        )
        return out, labels
