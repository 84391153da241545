"""How many samples a step's batch holds, as its DataLoader says: its batch size, then its last batch's where smaller.
The split needs it where the tensors cannot tell (a collate_fn returning a list of per-sample items). Read once per
DataLoader from the trainer's public properties; ``()`` where unknown (an ``IterableDataset``, a batch sampler of its
own, several training dataloaders combined): the split then infers the batch size from the tensors.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, IterableDataset

Counts = tuple[int, ...]

# The trainer property holding the current stage's dataloaders, by ``RunningStage`` value.
_STAGE_LOADERS = {
    "train": "train_dataloader",
    "sanity_check": "val_dataloaders",
    "validate": "val_dataloaders",
    "test": "test_dataloaders",
    "predict": "predict_dataloaders",
}

_COUNTS: weakref.WeakKeyDictionary[DataLoader, Counts] = weakref.WeakKeyDictionary()


def step_sample_counts(module: Any, step_args: Sequence[Any] | None = None) -> Counts:
    """The sample counts of the current step's batch for ``module``'s trainer and stage; ``()`` where unknown.
    ``step_args``: the step's positional arguments, whose last is the dataloader index when an evaluation stage has
    several dataloaders; ``None`` when not at hand (several dataloaders then count only if they all agree)."""
    try:
        trainer = module.trainer
    except (AttributeError, RuntimeError):  # a module outside a Trainer
        return ()
    name = _STAGE_LOADERS.get(getattr(trainer.state.stage, "value", None)) if trainer is not None else None
    loaders = getattr(trainer, name, None) if name is not None else None
    if isinstance(loaders, DataLoader):
        return loader_sample_counts(loaders)
    # Several training dataloaders give one combined batch; an iterable of its own is never iterated here.
    if name == "train_dataloader" or not isinstance(loaders, (Mapping, list, tuple)):
        return ()
    every = list(loaders.values()) if isinstance(loaders, Mapping) else list(loaders)
    index = 0 if len(every) == 1 else step_args[-1] if step_args is not None and len(step_args) > 1 else None
    if isinstance(index, int) and 0 <= index < len(every):
        return loader_sample_counts(every[index])
    counts = {loader_sample_counts(loader) for loader in every}
    return counts.pop() if len(counts) == 1 else ()


def loader_sample_counts(loader: Any) -> Counts:
    """``(batch_size,)``, or ``(batch_size, last)`` where the last batch holds fewer samples, of a DataLoader that
    batches a sized data set by a fixed size; ``()`` for any other loader. Read once per loader."""
    if not isinstance(loader, DataLoader):
        return ()
    counts = _COUNTS.get(loader)
    if counts is None:
        counts = _COUNTS[loader] = _read_counts(loader)
    return counts


def _read_counts(loader: DataLoader) -> Counts:
    """From the loader's ``batch_size`` and sampler, else a plain ``BatchSampler``'s (Lightning wraps it in predict)."""
    if isinstance(loader.dataset, IterableDataset):  # workers end their shares with partial batches
        return ()
    size, drop_last, sampler = loader.batch_size, loader.drop_last, loader.sampler
    if size is None:
        inner = getattr(loader.batch_sampler, "_batch_sampler", loader.batch_sampler)
        if type(inner) is not BatchSampler:  # a batch sampler of its own may vary its batch sizes
            return ()
        size, drop_last, sampler = inner.batch_size, inner.drop_last, inner.sampler
    try:
        last = len(sampler) % size
    except TypeError:  # a sampler without a length: the last batch's size is unknown
        return ()
    return (size, last) if last and not drop_last else (size,)
