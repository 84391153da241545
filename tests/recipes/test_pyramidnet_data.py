"""CIFAR-10 data for the PyramidNet recipe: loaders on small files in the real formats, errors, synthetic data,
on-device augmentation, the data module's splits and its training order (one process, resume, ddp). Nothing here
touches the network."""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

import lightning.pytorch as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

from benchmarks.compare.process_group import run_in_process_group
from recipes.pyramidnet.augment import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    normalize,
    random_crop,
    random_hflip,
    transform_batch,
)
from recipes.pyramidnet.data import CIFAR10DataModule, ShuffledBatches
from recipes.pyramidnet.model import build_pyramidnet
from recipes.pyramidnet.sources import (
    CIFAR10_CLASSES,
    is_local_source,
    load_local,
    make_synthetic,
    parquet_split,
)

ROOT = Path(__file__).resolve().parents[2]

# --------------------------------------------------------------------------------------------------------------------
# Files in the real formats


def _random_images(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8)


def _write_python_version(root: Path, per_batch: int = 4, n_test: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Write cifar-10-batches-py/ as the original tarball has it (Python pickles of dicts with bytes keys)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    train = []
    for i in range(1, 6):
        images = _random_images(per_batch, seed=i)
        labels = [(i + j) % 10 for j in range(per_batch)]
        train.append(images)
        batch = {
            b"batch_label": f"training batch {i} of 5".encode(),
            b"labels": labels,
            b"data": images.reshape(per_batch, 3072),
            b"filenames": [b"x.png"] * per_batch,
        }
        (folder / f"data_batch_{i}").write_bytes(pickle.dumps(batch, protocol=2))
    test = _random_images(n_test, seed=99)
    test_batch = {
        b"batch_label": b"testing batch 1 of 1",
        b"labels": [9, 0, 4][:n_test],
        b"data": test.reshape(n_test, 3072),
        b"filenames": [b"y.png"] * n_test,
    }
    (folder / "test_batch").write_bytes(pickle.dumps(test_batch, protocol=2))
    meta = {b"num_cases_per_batch": per_batch, b"label_names": [c.encode() for c in CIFAR10_CLASSES], b"num_vis": 3072}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))
    return np.concatenate(train), test


def test_python_version_loads_pixels_in_rgb_planes(tmp_path: Path) -> None:
    train, test = _write_python_version(tmp_path)
    for source in (tmp_path, tmp_path / "cifar-10-batches-py"):
        splits = load_local(source)
        assert splits.train_images.shape == (20, 3, 32, 32) and splits.train_images.dtype == torch.uint8
        assert torch.equal(splits.train_images, torch.from_numpy(train))
        assert torch.equal(splits.test_images, torch.from_numpy(test))
        assert splits.train_labels[:4].tolist() == [1, 2, 3, 4] and splits.test_labels.tolist() == [9, 0, 4]
        assert splits.classes == CIFAR10_CLASSES
    # Row layout: the first 1024 values of a row are the red plane, row-major.
    raw = pickle.loads((tmp_path / "cifar-10-batches-py" / "data_batch_1").read_bytes())[b"data"]
    assert splits.train_images[0, 0, 1, 2] == raw[0, 32 + 2] and splits.train_images[0, 2, 0, 0] == raw[0, 2048]


def test_data_module_reads_the_python_version(tmp_path: Path) -> None:
    _write_python_version(tmp_path)
    dm = CIFAR10DataModule(source=str(tmp_path), batch_size=8, val_split=4)
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_set) == 16 and len(dm.val_set) == 4 and len(dm.test_set) == 3
    images, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (8, 3, 32, 32) and images.dtype == torch.uint8 and labels.dtype == torch.int64


def test_missing_folder_names_the_path_and_the_layouts(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere") as err:
        load_local(missing)
    assert "cifar-10-batches-py" in str(err.value) and "data_batch_1..5" in str(err.value)
    dm = CIFAR10DataModule(source=str(missing))
    with pytest.raises(FileNotFoundError, match="nowhere"):
        dm.setup("fit")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no CIFAR-10 data recognised"):
        load_local(empty)


def test_incomplete_python_folder_lists_missing_files(tmp_path: Path) -> None:
    _write_python_version(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "test_batch").unlink()
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match="missing data_batch_3, test_batch"):
        load_local(tmp_path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"not a pickle at all", "unpickling failed"),
        (pickle.dumps([1, 2, 3]), "holds a list, expected a dict"),
        (pickle.dumps({b"labels": [0]}), "lacks b'data' or b'labels'"),
        (pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}), "expected uint8 N×3072"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]}), "expected uint8 N×3072"),
    ],
)
def test_malformed_batch_names_the_file(tmp_path: Path, content: bytes, message: str) -> None:
    _write_python_version(tmp_path)
    bad = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    bad.write_bytes(content)
    with pytest.raises(ValueError, match=message) as err:
        load_local(tmp_path)
    assert str(bad) in str(err.value)


def _hf_dataset_dict(n_train: int = 6, n_test: int = 4):
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    def split(n: int, seed: int):
        images = _random_images(n, seed)
        return datasets.Dataset.from_dict(
            {"img": [Image.fromarray(im.transpose(1, 2, 0)) for im in images], "label": [i % 10 for i in range(n)]},
            features=datasets.Features(
                {"img": datasets.Image(), "label": datasets.ClassLabel(names=list(CIFAR10_CLASSES))}
            ),
        ), images

    train, train_images = split(n_train, 1)
    test, test_images = split(n_test, 2)
    return datasets.DatasetDict({"train": train, "test": test}), train_images, test_images


def test_hub_converted_parquet_layout_takes_splits_from_folders(tmp_path: Path) -> None:
    # The Hub's auto-converted parquet (refs/convert/parquet): <config>/<split>/0000.parquet, no split in file names.
    dsd, train_images, test_images = _hf_dataset_dict()
    for split in ("train", "test"):
        (tmp_path / "plain_text" / split).mkdir(parents=True)
        dsd[split].to_parquet(str(tmp_path / "plain_text" / split / "0000.parquet"))
    splits = load_local(tmp_path)
    assert torch.equal(splits.train_images, torch.from_numpy(train_images))
    assert torch.equal(splits.test_images, torch.from_numpy(test_images))
    # A file name naming a split wins over its folder; folder names must match exactly.
    assert parquet_split(tmp_path / "train" / "test-0.parquet", tmp_path) == "test"
    assert parquet_split(tmp_path / "partial-train" / "0000.parquet", tmp_path) is None
    (tmp_path / "plain_text" / "test" / "0000.parquet").rename(tmp_path / "plain_text" / "0000.parquet")
    with pytest.raises(FileNotFoundError, match=r"no test\*\.parquet file or parquet file in a test/ folder") as err:
        load_local(tmp_path)
    assert "plain_text/0000.parquet" in str(err.value)  # lists what it found, relative to the source


def test_saved_dataset_and_parquet_loaders(tmp_path: Path) -> None:
    dsd, train_images, test_images = _hf_dataset_dict()
    saved = tmp_path / "saved"
    dsd.save_to_disk(str(saved))
    parquet = tmp_path / "parquet" / "plain_text"
    parquet.mkdir(parents=True)
    dsd["train"].to_parquet(str(parquet / "train-00000-of-00001.parquet"))
    dsd["test"].to_parquet(str(parquet / "test-00000-of-00001.parquet"))
    for source in (saved, tmp_path / "parquet"):
        splits = load_local(source)
        assert torch.equal(splits.train_images, torch.from_numpy(train_images))  # PNG is lossless
        assert torch.equal(splits.test_images, torch.from_numpy(test_images))
        assert splits.train_labels.tolist() == [0, 1, 2, 3, 4, 5] and splits.test_labels.tolist() == [0, 1, 2, 3]
    assert load_local(saved).classes == CIFAR10_CLASSES


def test_parquet_without_test_split_is_an_error(tmp_path: Path) -> None:
    dsd, _, _ = _hf_dataset_dict()
    dsd["train"].to_parquet(str(tmp_path / "train-00000-of-00001.parquet"))
    with pytest.raises(FileNotFoundError, match=r"no test\*\.parquet"):
        load_local(tmp_path)


def test_saved_dataset_missing_split_or_columns(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    dsd, _, _ = _hf_dataset_dict()
    datasets.DatasetDict({"train": dsd["train"]}).save_to_disk(str(tmp_path / "a"))
    with pytest.raises(ValueError, match=r"missing \['test'\]"):
        load_local(tmp_path / "a")
    renamed = datasets.DatasetDict({k: v.rename_column("img", "picture") for k, v in dsd.items()})
    renamed.save_to_disk(str(tmp_path / "b"))
    with pytest.raises(ValueError, match="expected an image column"):
        load_local(tmp_path / "b")


def test_hub_source_goes_through_load_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The Hub cannot be reached here: stand in for datasets.load_dataset with what it returns for uoft-cs/cifar10
    # (a DatasetDict with an Image column 'img' and a ClassLabel 'label'), and with the error it raises offline.
    datasets = pytest.importorskip("datasets")
    dsd, train_images, _ = _hf_dataset_dict()
    calls = []

    def fake_load_dataset(name: str, cache_dir: str | None = None):
        calls.append((name, cache_dir))
        return dsd

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    dm = CIFAR10DataModule(source="uoft-cs/cifar10", cache_dir=str(tmp_path), batch_size=4)
    assert dm.uses_hub
    dm.prepare_data()
    dm.setup("fit")
    assert calls == [("uoft-cs/cifar10", str(tmp_path))] * 2
    assert torch.equal(dm.train_set.images, torch.from_numpy(train_images))

    def offline(name: str, cache_dir: str | None = None):
        raise ConnectionError("Couldn't reach the Hugging Face Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match=r"could not load 'someone/cifar' .*prefix relative paths with '\./'"):
        CIFAR10DataModule(source="someone/cifar").prepare_data()


def test_sources_that_look_like_paths_are_never_sent_to_the_hub(tmp_path: Path) -> None:
    assert not is_local_source("uoft-cs/cifar10")
    assert is_local_source("./data/cifar") and is_local_source("/data/cifar") and is_local_source(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        CIFAR10DataModule(source="./surely-missing-cifar").setup("fit")


# --------------------------------------------------------------------------------------------------------------------
# Synthetic data


def test_synthetic_is_deterministic_balanced_and_cifar_shaped() -> None:
    a, b, c = make_synthetic(200, 50, seed=3), make_synthetic(200, 50, seed=3), make_synthetic(200, 50, seed=4)
    assert a.train_images.shape == (200, 3, 32, 32) and a.train_images.dtype == torch.uint8
    assert a.test_images.shape == (50, 3, 32, 32)
    assert torch.equal(a.train_images, b.train_images) and torch.equal(a.test_labels, b.test_labels)
    assert not torch.equal(a.train_images, c.train_images)
    assert torch.bincount(a.train_labels, minlength=10).tolist() == [20] * 10
    assert 60 < a.train_images.float().mean() < 200  # mid-grey on average, like real photos


@pytest.mark.usefixtures("one_thread")
def test_synthetic_data_is_learnable_by_a_tiny_pyramidnet() -> None:
    torch.manual_seed(0)
    data = make_synthetic(1024, 500, seed=0)
    model = build_pyramidnet("tiny").to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    for _ in range(3):
        model.train()
        for idx in torch.randperm(1024).split(64):
            x = transform_batch(data.train_images[idx], train=True, channels_last=True)
            loss = F.cross_entropy(model(x), data.train_labels[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(transform_batch(data.test_images, train=False)).argmax(1) == data.test_labels).float().mean()
    assert accuracy > 0.35, f"synthetic test accuracy {accuracy:.3f} after 3 epochs (chance 0.1)"


# --------------------------------------------------------------------------------------------------------------------
# Augmentation


def test_random_crop_takes_a_window_of_the_zero_padded_image() -> None:
    torch.manual_seed(0)
    images = torch.randint(1, 256, (16, 3, 8, 8), dtype=torch.uint8)  # no zeros inside: padding is recognisable
    crops = random_crop(images, padding=2)
    assert crops.shape == images.shape and crops.dtype == torch.uint8
    padded = F.pad(images, (2, 2, 2, 2))
    offsets = set()
    for i in range(16):
        matches = [
            (dy, dx)
            for dy in range(5)
            for dx in range(5)
            if torch.equal(crops[i], padded[i, :, dy : dy + 8, dx : dx + 8])
        ]
        assert len(matches) == 1, f"crop {i} is not a window of the padded image"
        offsets.add(matches[0])
    assert len(offsets) > 5  # offsets differ between images
    assert torch.equal(random_crop(images, padding=0), images)


def test_random_hflip_flips_each_image_or_leaves_it() -> None:
    torch.manual_seed(0)
    images = torch.randint(0, 256, (64, 3, 4, 4), dtype=torch.uint8)
    out = random_hflip(images)
    flipped = torch.tensor([torch.equal(o, i.flip(2)) for o, i in zip(out, images, strict=True)])
    kept = torch.tensor([torch.equal(o, i) for o, i in zip(out, images, strict=True)])
    assert (flipped | kept).all() and 10 < flipped.sum() < 54
    assert torch.equal(random_hflip(images, p=1.0), images.flip(3))
    assert torch.equal(random_hflip(images, p=0.0), images)


def test_normalisation_values() -> None:
    images = torch.tensor([0, 255, 128], dtype=torch.uint8).view(3, 1, 1, 1).expand(3, 3, 2, 2).contiguous()
    out = normalize(images)
    assert out.dtype == torch.float32
    for c in range(3):
        mean, std = CIFAR10_MEAN[c], CIFAR10_STD[c]
        for n, value in enumerate((0, 255, 128)):
            assert out[n, c].allclose(torch.tensor((value / 255 - mean) / std), atol=1e-5)


def test_eval_transform_only_normalises_and_train_transform_augments() -> None:
    torch.manual_seed(0)
    images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8)
    assert torch.equal(transform_batch(images, train=False), normalize(images))
    train = transform_batch(images, train=True, channels_last=True)
    assert train.shape == (8, 3, 32, 32) and train.is_contiguous(memory_format=torch.channels_last)
    assert not torch.equal(train, normalize(images))
    with pytest.raises(TypeError, match="uint8"):
        transform_batch(images.float(), train=False)


def test_flip_off_crops_without_flipping_and_both_off_only_normalises() -> None:
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    # The same random draws as random_crop alone: no flip draw, and no image mirrored.
    torch.manual_seed(5)
    no_flip = transform_batch(images, train=True, padding=4, flip=False)
    torch.manual_seed(5)
    assert torch.equal(no_flip, normalize(random_crop(images, padding=4)))
    assert torch.equal(transform_batch(images, train=True, padding=0, flip=False), normalize(images))
    # The switch matters: with the flip on, some images of the batch are mirrored (same crop offsets).
    torch.manual_seed(5)
    flipped = transform_batch(images, train=True, padding=4, flip=True)
    mirrored = [torch.equal(f, n.flip(2)) and not torch.equal(f, n) for f, n in zip(flipped, no_flip, strict=True)]
    assert 10 < sum(mirrored) < 54


def test_data_module_flip_and_crop_switches() -> None:
    kwargs = {"source": "synthetic", "batch_size": 64, "synthetic_train_size": 64, "synthetic_test_size": 8}
    dm = CIFAR10DataModule(**kwargs, flip=False)
    dm.setup("fit")
    images, _ = next(iter(dm.train_dataloader()))
    torch.manual_seed(3)
    out = dm.transform(images, train=True)
    torch.manual_seed(3)
    assert torch.equal(out, normalize(random_crop(images, padding=4)))
    plain = CIFAR10DataModule(**kwargs, flip=False, crop_padding=0)
    assert torch.equal(plain.transform(images, train=True), normalize(images))
    assert CIFAR10DataModule(**kwargs).flip  # the paper's recipe by default
    with pytest.raises(ValueError, match="crop_padding must be >= 0"):
        CIFAR10DataModule(**kwargs, crop_padding=-1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_transform_outputs_the_requested_dtype(dtype: torch.dtype) -> None:
    images = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for train in (False, True):
        out = transform_batch(images, train=train, dtype=dtype, channels_last=True)
        assert out.dtype == dtype and out.is_contiguous(memory_format=torch.channels_last)
    reference = normalize(images, dtype=torch.float64)
    # float64 is computed in float64 (not float32 then widened); half precisions are the float32 values rounded once.
    expected = reference if dtype == torch.float64 else normalize(images).to(dtype)
    assert torch.equal(transform_batch(images, train=False, dtype=dtype), expected)
    assert not torch.equal(normalize(images).double(), reference)  # so the float64 check above can fail
    with pytest.raises(TypeError, match="floating-point dtype"):
        normalize(images, dtype=torch.int32)


def test_data_module_transforms_batches_by_trainer_state() -> None:
    dm = CIFAR10DataModule(source="synthetic", batch_size=8, synthetic_train_size=32, synthetic_test_size=16)
    dm.setup("fit")
    images, labels = next(iter(dm.val_dataloader()))
    # No trainer attached: evaluation transform (normalisation only), in the default layout (no model to follow).
    out, out_labels = dm.on_after_batch_transfer((images, labels), 0)
    assert torch.equal(out, normalize(images)) and out.is_contiguous()
    assert out_labels is labels
    channels_last = dm.transform(images, train=False, channels_last=True)
    assert torch.equal(channels_last, out) and channels_last.is_contiguous(memory_format=torch.channels_last)
    torch.manual_seed(0)
    assert not torch.equal(dm.transform(images, train=True), normalize(images))


# --------------------------------------------------------------------------------------------------------------------
# Splits and loaders


@pytest.mark.parametrize(("val_split", "n_val"), [(0.25, 25), (10, 10)])
def test_validation_split_is_seeded_and_disjoint(val_split: float | int, n_val: int) -> None:
    def build(seed: int) -> CIFAR10DataModule:
        dm = CIFAR10DataModule(
            source="synthetic", val_split=val_split, seed=seed, synthetic_train_size=100, synthetic_test_size=20
        )
        dm.setup("fit")
        return dm

    a, b, c = build(0), build(0), build(1)
    assert len(a.val_set) == n_val and len(a.train_set) == 100 - n_val and len(a.test_set) == 20
    assert torch.equal(a.val_set.images, b.val_set.images)
    # Every training image lands in exactly one of train/val (the synthetic images are all distinct).
    everything = torch.cat([a.train_set.images, a.val_set.images]).flatten(1)
    assert torch.unique(everything, dim=0).shape[0] == 100
    c_split = make_synthetic(100, 20, seed=1)
    assert torch.unique(torch.cat([c.train_set.images, c.val_set.images]).flatten(1), dim=0).shape[0] == 100
    assert c_split.train_images.shape[0] == 100


def test_no_validation_split_validates_on_the_test_set() -> None:
    dm = CIFAR10DataModule(source="synthetic", synthetic_train_size=40, synthetic_test_size=12)
    dm.setup("fit")
    assert torch.equal(dm.val_set.images, dm.test_set.images) and len(dm.train_set) == 40


def test_bad_split_or_batch_arguments() -> None:
    with pytest.raises(ValueError, match="fractional val_split"):
        CIFAR10DataModule(source="synthetic", val_split=1.5)
    with pytest.raises(ValueError, match="batch_size"):
        CIFAR10DataModule(source="synthetic", batch_size=0)
    dm = CIFAR10DataModule(source="synthetic", val_split=40, synthetic_train_size=40, synthetic_test_size=4)
    with pytest.raises(ValueError, match="leaves no training images"):
        dm.setup("fit")


def test_loaders_yield_whole_uint8_batches() -> None:
    dm = CIFAR10DataModule(
        source="synthetic", batch_size=16, eval_batch_size=7, synthetic_train_size=40, synthetic_test_size=10
    )
    dm.setup("fit")
    train = list(dm.train_dataloader())
    assert [b[0].shape[0] for b in train] == [16, 16, 8]
    assert all(b[0].dtype == torch.uint8 for b in train)
    seen = torch.cat([b[1] for b in train])
    assert torch.equal(seen.sort().values, dm.train_set.labels.sort().values)  # a permutation of the training set
    assert [b[0].shape[0] for b in dm.val_dataloader()] == [7, 3]
    dm_drop = CIFAR10DataModule(
        source="synthetic", batch_size=16, drop_last=True, synthetic_train_size=40, synthetic_test_size=10
    )
    dm_drop.setup("fit")
    assert [b[0].shape[0] for b in dm_drop.train_dataloader()] == [16, 16]


# --------------------------------------------------------------------------------------------------------------------
# Training order: a function of (seed, epoch)


class _IndexedCIFAR(CIFAR10DataModule):
    """The real data module with each training image's index as its label, so a run can record its order."""

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        self.train_set.labels = torch.arange(len(self.train_set))


class _IndexedCIFARInDDPWrapper(_IndexedCIFAR):
    """One process, but the training sampler wrapped as Lightning wraps it under ddp (world size 1 here).

    The wrapper lists the batches when the epoch's iterator is created, which Lightning does for the first epoch of
    a fit before it calls ``set_epoch``: the path where a resumed ddp run could replay epoch 0.
    """

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        loader = super().train_dataloader()
        wrapped = DistributedSamplerWrapper(loader.sampler, num_replicas=1, rank=0, shuffle=False)
        return torch.utils.data.DataLoader(loader.dataset, batch_size=None, sampler=wrapped)


class _RecordOrder(L.LightningModule):
    """A one-layer model that records, per epoch, the training indices it was given (the labels of _IndexedCIFAR)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.seen: dict[int, list[int]] = {}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, index = batch
        self.seen.setdefault(self.current_epoch, []).extend(index.tolist())
        return self.layer(images.mean(dim=(2, 3))).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _indexed(seed: int | None = 0, size: int = 48, cls: type[_IndexedCIFAR] = _IndexedCIFAR) -> _IndexedCIFAR:
    return cls(source="synthetic", batch_size=8, seed=seed, synthetic_train_size=size, synthetic_test_size=8)


def _order(loader: torch.utils.data.DataLoader) -> list[int]:
    return torch.cat([index for _, index in loader]).tolist()


def _fit(
    data: CIFAR10DataModule, epochs: int, root: Path, ckpt_path: Path | None = None, **trainer_kwargs: object
) -> tuple[_RecordOrder, L.Trainer]:
    model = _RecordOrder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=root,
        **trainer_kwargs,
    )
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return model, trainer


def test_order_changes_every_epoch_and_is_reproducible_from_the_seed() -> None:
    dm = _indexed(seed=3)
    dm.setup("fit")
    loader = dm.train_dataloader()
    epoch0, epoch1 = _order(loader), _order(loader)  # a plain loop: each pass is the next epoch
    assert sorted(epoch0) == sorted(epoch1) == list(range(48)) and epoch0 != epoch1
    again = _indexed(seed=3)
    again.setup("fit")
    assert _order(again.train_dataloader()) == epoch0
    other = _indexed(seed=4)
    other.setup("fit")
    assert _order(other.train_dataloader()) != epoch0
    loader.sampler.set_epoch(1)  # what Lightning calls before each epoch
    assert _order(loader) == epoch1
    assert len(loader) == 6 and [len(b) for b in ShuffledBatches(10, 4, drop_last=True, seed=0)] == [4, 4]


def test_default_seed_is_the_global_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)  # restored after the test: seed_everything sets it

    def first_epoch(seed: int | None, global_seed: int) -> list[int]:
        L.seed_everything(global_seed, verbose=False)
        dm = _indexed(seed=seed)
        dm.setup("fit")
        return _order(dm.train_dataloader())

    assert first_epoch(None, 1) != first_epoch(None, 2)
    assert first_epoch(None, 1) == first_epoch(1, 2)  # an explicit seed wins over the global one
    assert first_epoch(5, 1) == first_epoch(5, 2)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("cls", [_IndexedCIFAR, _IndexedCIFARInDDPWrapper], ids=["plain", "ddp-wrapper"])
def test_trainer_epochs_follow_the_epoch_across_reloads_and_resume(cls: type[_IndexedCIFAR], tmp_path: Path) -> None:
    expected = [ShuffledBatches(48, 8, drop_last=False, seed=0).order(epoch).tolist() for epoch in range(3)]
    full, _ = _fit(_indexed(cls=cls), 3, tmp_path / "full")
    assert [full.seen[e] for e in range(3)] == expected and len({tuple(o) for o in expected}) == 3
    # A loader rebuilt every epoch does not start over at epoch 0's order.
    reloaded, _ = _fit(_indexed(cls=cls), 3, tmp_path / "reload", reload_dataloaders_every_n_epochs=1)
    assert reloaded.seen == full.seen
    # Stopped after 2 epochs, resumed in a fresh trainer and data module: epoch 2's order, not epoch 0's.
    _, first = _fit(_indexed(cls=cls), 2, tmp_path / "first")
    first.save_checkpoint(tmp_path / "epoch2.ckpt")
    resumed, _ = _fit(_indexed(cls=cls), 3, tmp_path / "resumed", ckpt_path=tmp_path / "epoch2.ckpt")
    assert resumed.seen == {2: full.seen[2]}


_DDP_SCRIPT = """
import importlib.util, json, os
import lightning.pytorch as L
import torch

spec = importlib.util.spec_from_file_location("pyramidnet_data_tests", {test_file!r})
tests = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tests)
L.seed_everything(100, verbose=False)  # the data module's default seed: the global one, the same on every rank
model = tests._RecordOrder()
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    limit_val_batches=0, default_root_dir={out!r})
trainer.fit(model, tests._indexed(seed=None, size=48))
with open(os.path.join({out!r}, f"rank{{trainer.global_rank}}.json"), "w") as f:
    json.dump(model.seen, f)
# Lightning leaves the process group alive; gloo's threads can abort the interpreter's exit (SIGABRT) without this.
torch.distributed.destroy_process_group()
"""


@pytest.mark.usefixtures("one_thread")
def test_ddp_ranks_see_disjoint_batches_of_each_epochs_order(tmp_path: Path) -> None:
    # Two gloo processes in a subprocess (in-process ddp would re-launch pytest's command line). Lightning wraps the
    # loader's sampler in its DistributedSamplerWrapper, which deals out whole batches of the epoch's order.
    script = tmp_path / "ddp_order.py"
    script.write_text(_DDP_SCRIPT.format(test_file=str(Path(__file__)), out=str(tmp_path)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    run = run_in_process_group([sys.executable, str(script)], 300, cwd=tmp_path, env=env, log=tmp_path / "output.log")
    assert run.returncode == 0, run.describe()
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for epoch in ("0", "1"):
        assert not set(rank0[epoch]) & set(rank1[epoch])
        assert sorted(rank0[epoch] + rank1[epoch]) == list(range(48))
    assert rank0["0"] != rank0["1"] and rank1["0"] != rank1["1"]
