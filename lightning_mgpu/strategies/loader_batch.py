"""How many samples a step's batch holds, as its DataLoader says: its batch size, and its last batch's where that one
is smaller. The split needs it where the batch's tensors cannot tell it (a collate_fn that returns its samples as a
list of items, each with its own tensors). Read from the trainer's public properties (``trainer.state.stage``,
``trainer.train_dataloader``, ``val_dataloaders``...), once per DataLoader: a step costs a few attribute reads and
one dict lookup. Where the count cannot be known (an ``IterableDataset``, a batch sampler of its own, several
training dataloaders combined), it is ``()`` and the split infers the batch size from the tensors, as before.
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
    """The sample counts the current step's batch may hold (the DataLoader's batch size, then its last batch's if
    smaller), for ``module``'s trainer and stage; ``()`` where unknown. ``step_args``: the step's positional arguments,
    whose last is the dataloader index when an evaluation stage has several dataloaders; ``None`` when they are not at
    hand (then several dataloaders give their counts only if they all agree)."""
    trainer = _trainer_of(module)
    if trainer is None:
        return ()
    name = _STAGE_LOADERS.get(getattr(trainer.state.stage, "value", None))
    loaders = getattr(trainer, name, None) if name is not None else None
    if isinstance(loaders, DataLoader):
        return loader_sample_counts(loaders)
    if name == "train_dataloader" or loaders is None:  # several training dataloaders: one combined batch
        return ()
    return _indexed_counts(loaders, step_args)


def loader_sample_counts(loader: Any) -> Counts:
    """``(batch_size,)``, or ``(batch_size, last)`` where the last batch holds fewer samples (``drop_last=False``), of
    a DataLoader that batches a sized data set by a fixed size; ``()`` for any other loader. Read once per loader."""
    if not isinstance(loader, DataLoader):
        return ()
    counts = _COUNTS.get(loader)
    if counts is None:
        counts = _read_counts(loader)
        _COUNTS[loader] = counts
    return counts


def _read_counts(loader: DataLoader) -> Counts:
    """The counts of :func:`loader_sample_counts`, read from the loader's ``batch_size`` and sampler, else from a
    plain ``BatchSampler`` (Lightning wraps it in predict, keeping its attributes)."""
    if isinstance(loader.dataset, IterableDataset):  # workers end their shares with partial batches
        return ()
    size, drop_last, sampler = loader.batch_size, loader.drop_last, loader.sampler
    if size is None:
        batches = loader.batch_sampler
        inner = getattr(batches, "_batch_sampler", batches)  # lightning's _IndexBatchSamplerWrapper in predict
        if type(inner) is not BatchSampler:  # a batch sampler of its own may vary its batch sizes
            return ()
        size, drop_last, sampler = inner.batch_size, inner.drop_last, inner.sampler
    try:
        total = len(sampler)
    except TypeError:  # a sampler without a length: the last batch's size is unknown
        return ()
    last = total % size
    return (size, last) if last and not drop_last else (size,)


def _indexed_counts(loaders: Any, step_args: Sequence[Any] | None) -> Counts:
    """The counts of the evaluation dataloader the step's last argument names (Lightning passes the dataloader index
    last when there are several), or, without it, those all of them share."""
    if not isinstance(loaders, (Mapping, list, tuple)):  # an iterable of its own: never iterated here
        return ()
    every = list(loaders.values()) if isinstance(loaders, Mapping) else list(loaders)
    if len(every) == 1:  # no dataloader index is passed then
        return loader_sample_counts(every[0])
    index = step_args[-1] if step_args is not None and len(step_args) > 1 else None
    if isinstance(index, int) and 0 <= index < len(every):
        return loader_sample_counts(every[index])
    counts = {loader_sample_counts(loader) for loader in every}
    return counts.pop() if len(counts) == 1 else ()


def _trainer_of(module: Any) -> Any:
    """The trainer ``module`` is attached to, else ``None``."""
    try:
        return module.trainer
    except (AttributeError, RuntimeError):  # a module outside a Trainer
        return None
