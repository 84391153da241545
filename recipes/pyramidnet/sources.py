"""Where CIFAR-10 comes from: local files in the original or Hugging Face formats, the Hub, or a synthetic stand-in.

Every loader returns a :class:`CIFARSplits`: uint8 image tensors ``(N, 3, 32, 32)`` and int64 labels for the train and
test sets. Missing or malformed data raises an error that names the path and the layout that was expected; nothing
falls back to synthetic data silently. Only :func:`load_hub` touches the network, and only when a user names a Hub
dataset.

Local layouts understood by :func:`load_local`:

* the original python version (``cifar-10-python.tar.gz`` extracted): a folder ``cifar-10-batches-py`` holding the
  pickles ``data_batch_1`` … ``data_batch_5``, ``test_batch`` and ``batches.meta`` (or the folder containing it);
* a ``datasets`` ``DatasetDict`` written by ``save_to_disk`` (``dataset_dict.json`` plus ``train``/``test`` folders);
* parquet files as on the Hub, anywhere below the folder: named by split (``train-00000-of-00001.parquet``,
  ``test-*.parquet``) or in folders named by split (the Hub's converted layout ``plain_text/train/0000.parquet``).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "CIFAR10_CLASSES",
    "LAYOUTS_HELP",
    "CIFARSplits",
    "download_hub",
    "is_local_source",
    "load_cifar10",
    "load_hub",
    "load_local",
    "load_parquet",
    "load_python_batches",
    "load_saved_dataset",
    "make_synthetic",
    "parquet_split",
]

CIFAR10_CLASSES: tuple[str, ...] = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)
PYTHON_TRAIN_FILES: tuple[str, ...] = tuple(f"data_batch_{i}" for i in range(1, 6))
PYTHON_FILES: tuple[str, ...] = (*PYTHON_TRAIN_FILES, "test_batch", "batches.meta")

LAYOUTS_HELP = (
    "expected one of: (1) the CIFAR-10 python version, a folder 'cifar-10-batches-py' with data_batch_1..5, "
    "test_batch and batches.meta (pickled dicts with b'data': uint8 N×3072 and b'labels'), or the folder containing "
    "it; (2) a datasets DatasetDict saved with save_to_disk (dataset_dict.json, splits 'train' and 'test'); "
    "(3) a folder of parquet files named train-*.parquet and test-*.parquet, or inside folders named train/ and "
    "test/ (as <config>/train/0000.parquet), with an image column ('img' or 'image', encoded PNG bytes) and a "
    "'label' column; or source='synthetic' for generated data"
)


@dataclass
class CIFARSplits:
    """Train and test images (uint8, N×3×32×32) and labels (int64), plus the class names."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    classes: tuple[str, ...] = CIFAR10_CLASSES

    def __post_init__(self) -> None:
        for name in ("train", "test"):
            images, labels = getattr(self, f"{name}_images"), getattr(self, f"{name}_labels")
            if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
                raise ValueError(f"{name} images must be uint8 (N, 3, H, W), got {images.dtype} {tuple(images.shape)}")
            if labels.shape != (images.shape[0],):
                raise ValueError(f"{name}: {images.shape[0]} images but labels of shape {tuple(labels.shape)}")


# --------------------------------------------------------------------------------------------------------------------
# Dispatch


def is_local_source(source: str) -> bool:
    """A source names local data if it exists on disk or is written like a path (absolute, ``./``, ``../``, ``~``).

    Anything else (``"uoft-cs/cifar10"``) is taken as a Hugging Face Hub dataset name.
    """
    return Path(source).expanduser().exists() or source.startswith(("/", "./", "../", "~", "."))


def load_cifar10(
    source: str, cache_dir: str | None = None, synthetic_sizes: tuple[int, int] = (5000, 1000), seed: int = 0
) -> CIFARSplits:
    """Load CIFAR-10 from ``source``: ``"synthetic"``, a local path (see module doc) or a Hub dataset name."""
    if source == "synthetic":
        return make_synthetic(*synthetic_sizes, seed=seed)
    if is_local_source(source):
        return load_local(source)
    return load_hub(source, cache_dir=cache_dir)


def load_local(path: str | Path) -> CIFARSplits:
    """Load a local folder in any of the layouts of the module doc; errors name the path and the expected layouts."""
    root = Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"CIFAR-10 source {str(root)!r} does not exist; {LAYOUTS_HELP}")
    if root.is_dir() and (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    if root.is_dir() and any((root / f).exists() for f in PYTHON_FILES):
        return load_python_batches(root)
    if (root / "dataset_dict.json").is_file():
        return load_saved_dataset(root)
    if root.is_dir() and any(root.rglob("*.parquet")):
        return load_parquet(root)
    raise FileNotFoundError(f"no CIFAR-10 data recognised in {str(root)!r}; {LAYOUTS_HELP}")


# --------------------------------------------------------------------------------------------------------------------
# The original python pickles


def _unpickle(file: Path) -> dict[bytes, Any]:
    # The files are Python 2 pickles of dicts with bytes keys; pickle is the format, so only load files you trust.
    try:
        with file.open("rb") as f:
            obj = pickle.load(f, encoding="bytes")
    except Exception as err:  # any unpickling failure means the file is not a CIFAR batch
        raise ValueError(
            f"{str(file)!r} is not a CIFAR-10 python batch (unpickling failed: {err}); {LAYOUTS_HELP}"
        ) from err
    if not isinstance(obj, dict):
        raise ValueError(f"{str(file)!r} holds a {type(obj).__name__}, expected a dict; {LAYOUTS_HELP}")
    return obj


def _python_batch(file: Path) -> tuple[torch.Tensor, torch.Tensor]:
    batch = _unpickle(file)
    data, labels = batch.get(b"data"), batch.get(b"labels")
    if data is None or labels is None:
        keys = sorted(k.decode() if isinstance(k, bytes) else str(k) for k in batch)
        raise ValueError(f"{str(file)!r} lacks b'data' or b'labels' (keys: {keys}); {LAYOUTS_HELP}")
    data = np.asarray(data)
    labels_arr = np.asarray(labels, dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or data.shape[0] != labels_arr.shape[0]:
        raise ValueError(
            f"{str(file)!r}: b'data' is {data.dtype} {data.shape} with {labels_arr.shape[0]} labels, expected uint8 "
            f"N×3072 (1024 red, 1024 green, 1024 blue values per row) and N labels; {LAYOUTS_HELP}"
        )
    images = torch.from_numpy(data.reshape(-1, 3, 32, 32).copy())
    return images, torch.from_numpy(labels_arr)


def load_python_batches(folder: str | Path) -> CIFARSplits:
    """Load the CIFAR-10 python version from ``folder`` (``data_batch_1..5``, ``test_batch``, ``batches.meta``)."""
    folder = Path(folder)
    missing = [f for f in PYTHON_FILES if not (folder / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"CIFAR-10 python folder {str(folder)!r} is missing {', '.join(missing)}; {LAYOUTS_HELP}"
        )
    train = [_python_batch(folder / f) for f in PYTHON_TRAIN_FILES]
    test_images, test_labels = _python_batch(folder / "test_batch")
    meta = _unpickle(folder / "batches.meta")
    names = meta.get(b"label_names")
    classes = tuple(n.decode() if isinstance(n, bytes) else str(n) for n in names) if names else CIFAR10_CLASSES
    return CIFARSplits(
        torch.cat([x for x, _ in train]), torch.cat([y for _, y in train]), test_images, test_labels, classes
    )


# --------------------------------------------------------------------------------------------------------------------
# Hugging Face formats (saved DatasetDict, parquet, Hub)

_IMAGE_COLUMNS = ("img", "image")
_LABEL_COLUMNS = ("label", "labels")


def _decode_table(table: Any, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Arrow table with an encoded-image column and an integer label column → uint8 (N,3,32,32), int64 (N,)."""
    from PIL import Image

    names = table.column_names
    img_col = next((c for c in _IMAGE_COLUMNS if c in names), None)
    label_col = next((c for c in _LABEL_COLUMNS if c in names), None)
    if img_col is None or label_col is None:
        raise ValueError(
            f"{where}: columns {names}, expected an image column {_IMAGE_COLUMNS} and a label column "
            f"{_LABEL_COLUMNS}; {LAYOUTS_HELP}"
        )
    column = table.column(img_col).combine_chunks()
    if hasattr(column.type, "get_field_index") and column.type.get_field_index("bytes") >= 0:
        encoded = column.field("bytes").to_pylist()
    else:
        encoded = column.to_pylist()
    images = np.empty((len(encoded), 32, 32, 3), dtype=np.uint8)
    for i, blob in enumerate(encoded):
        if not isinstance(blob, bytes | bytearray):
            raise ValueError(
                f"{where}: row {i} of column {img_col!r} holds {type(blob).__name__}, expected encoded "
                f"image bytes; {LAYOUTS_HELP}"
            )
        with Image.open(io.BytesIO(blob)) as im:
            arr = np.asarray(im.convert("RGB"))
        if arr.shape != (32, 32, 3):
            raise ValueError(f"{where}: row {i} is a {arr.shape} image, expected 32×32 RGB")
        images[i] = arr
    labels = np.asarray(table.column(label_col).to_pylist(), dtype=np.int64)
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), torch.from_numpy(labels)


def _splits_from_dataset_dict(dsd: Any, where: str) -> CIFARSplits:
    missing = [s for s in ("train", "test") if s not in dsd]
    if missing:
        raise ValueError(f"{where}: splits {list(dsd)}, missing {missing}; {LAYOUTS_HELP}")
    out = []
    for split in ("train", "test"):
        ds = dsd[split]
        out.extend(_decode_table(ds.with_format("arrow")[:], f"{where} [{split}]"))
    classes = CIFAR10_CLASSES
    label_feature = next((dsd["train"].features[c] for c in _LABEL_COLUMNS if c in dsd["train"].features), None)
    if getattr(label_feature, "names", None):
        classes = tuple(label_feature.names)
    return CIFARSplits(*out, classes=classes)


def load_saved_dataset(folder: str | Path) -> CIFARSplits:
    """Load a ``DatasetDict`` saved with ``save_to_disk`` (memory-mapped; nothing is written or downloaded)."""
    import datasets

    folder = Path(folder)
    try:
        dsd = datasets.load_from_disk(str(folder))
    except Exception as err:
        raise ValueError(f"could not read the saved dataset at {str(folder)!r}: {err}; {LAYOUTS_HELP}") from err
    if not isinstance(dsd, datasets.DatasetDict):
        raise ValueError(
            f"{str(folder)!r} holds a single Dataset, expected a DatasetDict with 'train' and 'test' "
            f"splits; {LAYOUTS_HELP}"
        )
    return _splits_from_dataset_dict(dsd, repr(str(folder)))


def parquet_split(file: Path, folder: Path) -> str | None:
    """The split (``"train"``/``"test"``) of a parquet ``file`` below ``folder``, or ``None``.

    From the file name (``train-00000-of-00001.parquet``, as in Hub repositories) or, failing that, from the innermost
    folder between ``folder`` and the file named exactly like a split (``plain_text/train/0000.parquet``, the Hub's
    auto-converted layout). The name wins: ``train/test-0.parquet`` is a test file.
    """
    for split in ("train", "test"):
        if file.name.startswith(split):
            return split
    return next((part for part in reversed(file.relative_to(folder).parent.parts) if part in ("train", "test")), None)


def load_parquet(folder: str | Path) -> CIFARSplits:
    """Load the train and test parquet files found below ``folder`` (see :func:`parquet_split`; pyarrow, no cache)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = Path(folder)
    files = sorted(folder.rglob("*.parquet"))
    out = []
    for split in ("train", "test"):
        chosen = [f for f in files if parquet_split(f, folder) == split]
        if not chosen:
            raise FileNotFoundError(
                f"no {split}*.parquet file or parquet file in a {split}/ folder below "
                f"{str(folder)!r} (found {[str(f.relative_to(folder)) for f in files]}); "
                f"{LAYOUTS_HELP}"
            )
        try:
            table = pa.concat_tables([pq.read_table(f) for f in chosen])
        except Exception as err:
            raise ValueError(f"could not read parquet files {[str(f) for f in chosen]}: {err}") from err
        out.extend(_decode_table(table, f"{str(folder)!r} [{split}]"))
    return CIFARSplits(*out)


def download_hub(name: str, cache_dir: str | None = None) -> Any:
    """Download (or reuse the cache of) a Hub dataset, e.g. ``"uoft-cs/cifar10"``; returns its ``DatasetDict``."""
    import datasets

    try:
        return datasets.load_dataset(name, cache_dir=cache_dir)
    except Exception as err:
        raise RuntimeError(
            f"could not load {name!r} from the Hugging Face Hub ({type(err).__name__}: {err}). It is not a local "
            f"path; for local data pass a path that exists (prefix relative paths with './'); {LAYOUTS_HELP}"
        ) from err


def load_hub(name: str, cache_dir: str | None = None) -> CIFARSplits:
    """Load a Hub dataset with ``train``/``test`` splits (image + label columns), downloading it on first use."""
    return _splits_from_dataset_dict(download_hub(name, cache_dir), repr(name))


# --------------------------------------------------------------------------------------------------------------------
# Synthetic


def _smooth_patterns(count: int, size: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` smooth random RGB patterns (count, 3, size, size) with values in about [-1, 1]."""
    coarse = torch.randn(count, 3, 5, 5, generator=generator)
    fine = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=True)
    return fine / fine.abs().amax(dim=(1, 2, 3), keepdim=True)


def _synthetic_split(
    templates: torch.Tensor, size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    num_classes, _, big, _ = templates.shape
    labels = torch.arange(size) % num_classes
    labels = labels[torch.randperm(size, generator=generator)]
    # Each image: a random 32×32 window of its class pattern (so the class is not a fixed pixel layout), a random
    # contrast and colour shift, and per-pixel noise; classes stay separable by shape and colour.
    off = torch.randint(0, big - 32 + 1, (2, size), generator=generator)
    rows = off[0, :, None] + torch.arange(32)
    cols = off[1, :, None] + torch.arange(32)
    base = templates[labels]
    base = base.gather(2, rows[:, None, :, None].expand(size, 3, 32, big))
    base = base.gather(3, cols[:, None, None, :].expand(size, 3, 32, 32))
    contrast = 40 + 40 * torch.rand(size, 1, 1, 1, generator=generator)
    colour = 120 + 10 * torch.randn(size, 3, 1, 1, generator=generator)
    noise = 25 * torch.randn(size, 3, 32, 32, generator=generator)
    images = (colour + contrast * base + noise).round().clamp_(0, 255).to(torch.uint8)
    return images, labels.long()


def make_synthetic(train_size: int = 5000, test_size: int = 1000, seed: int = 0) -> CIFARSplits:
    """A deterministic, learnable CIFAR-shaped stand-in (offline runs, tests, the quickstart).

    Each class is a smooth random colour pattern; images are random crops of it with random contrast, colour shift
    and noise. Same ``seed`` → same bytes. Train and test share the patterns and differ in their samples.
    """
    if train_size < 1 or test_size < 1:
        raise ValueError(f"synthetic sizes must be >= 1, got train={train_size} test={test_size}")
    g = torch.Generator().manual_seed(seed)
    templates = _smooth_patterns(len(CIFAR10_CLASSES), 36, g)
    train = _synthetic_split(templates, train_size, torch.Generator().manual_seed(seed * 1000 + 1))
    test = _synthetic_split(templates, test_size, torch.Generator().manual_seed(seed * 1000 + 2))
    return CIFARSplits(*train, *test)
