"""``CIFAR10DataModule``: CIFAR-10 (or its synthetic stand-in) as uint8 tensors, augmented on the device.

The loaders only index uint8 tensors, a whole batch at a time; random crop, flip and normalisation run on the
device in ``on_after_batch_transfer`` (see ``augment.py``), so on a GPU the accelerator, not the loader, sets the pace.
Training batches are augmented, validation/test/predict batches only normalised.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler

from recipes.pyramidnet.augment import transform_batch
from recipes.pyramidnet.sources import CIFARSplits, download_hub, is_local_source, load_cifar10

__all__ = ["CIFAR10DataModule", "TensorBatches"]


class TensorBatches(Dataset):
    """Images and labels indexed by a *list* of indices: one ``__getitem__`` returns a whole batch.

    Used with ``DataLoader(batch_size=None, sampler=BatchSampler(...))``: no per-sample collation. Lightning can
    still shard it across DDP processes (it wraps the batch sampler in its ``DistributedSamplerWrapper``).
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images = images
        self.labels = labels

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return self.images[index], self.labels[index]


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
        seed: seeds the split, the synthetic data and the training order.
        num_workers: DataLoader worker processes (0 is right for in-memory tensors).
        augment: random crop (zero padding ``crop_padding``) and horizontal flip on training batches.
        crop_padding: zero padding of the random crop, 4 in the paper.
        channels_last: hand batches to the model in ``channels_last`` memory format.
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
        seed: int = 0,
        num_workers: int = 0,
        augment: bool = True,
        crop_padding: int = 4,
        channels_last: bool = False,
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
        self.save_hyperparameters()
        self.source = source
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.val_split = val_split
        self.seed = seed
        self.num_workers = num_workers
        self.augment = augment
        self.crop_padding = crop_padding
        self.channels_last = channels_last
        self.drop_last = drop_last
        self.pin_memory = pin_memory
        self.synthetic_sizes = (synthetic_train_size, synthetic_test_size)
        self.cache_dir = cache_dir
        self.classes: tuple[str, ...] = ()
        self.train_set: TensorBatches | None = None
        self.val_set: TensorBatches | None = None
        self.test_set: TensorBatches | None = None
        self._splits: CIFARSplits | None = None

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
            self._splits = load_cifar10(self.source, self.cache_dir, self.synthetic_sizes, self.seed)
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
            perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(self.seed))
            val_idx, train_idx = perm[:n_val].sort().values, perm[n_val:].sort().values
            self.train_set = TensorBatches(splits.train_images[train_idx], splits.train_labels[train_idx])
            self.val_set = TensorBatches(splits.train_images[val_idx], splits.train_labels[val_idx])
        else:
            self.train_set = TensorBatches(splits.train_images, splits.train_labels)
            self.val_set = TensorBatches(splits.test_images, splits.test_labels)
        self.test_set = TensorBatches(splits.test_images, splits.test_labels)

    def _loader(self, dataset: TensorBatches | None, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("CIFAR10DataModule.setup() must run before asking for a dataloader")
        if train:
            generator = torch.Generator().manual_seed(self.seed)
            sampler = BatchSampler(RandomSampler(dataset, generator=generator), self.batch_size, self.drop_last)
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

    def transform(self, images: torch.Tensor, train: bool) -> torch.Tensor:
        """uint8 batch → normalised float batch, augmented when ``train`` and ``augment`` (see ``augment.py``)."""
        return transform_batch(
            images, train=train and self.augment, padding=self.crop_padding, channels_last=self.channels_last
        )

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Augment/normalise the batch on its device; augmentation only while the trainer is training."""
        images, labels = batch
        training = self.trainer is not None and self.trainer.training
        return self.transform(images, train=training), labels
