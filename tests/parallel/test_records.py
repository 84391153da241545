"""Per-sample items marked with PerSample (detection targets, images of different sizes): split and gathered by item."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mgpu.parallel import (
    BatchSplitError,
    DataParallelCriterion,
    DataParallelModel,
    PerSample,
    merge_outputs,
    split_batch,
)
from lightning_mgpu.parallel.scatter_gather import batch_size_of

CPU2 = ["cpu"] * 2


def detection_batch(n: int, seed: int = 0) -> tuple[torch.Tensor, PerSample]:
    """Images (n, 3, 8, 8) and one target dict per image with a varying number of boxes (1 to 4)."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64)
    targets = PerSample()
    for i in range(n):
        boxes = torch.rand(i % 4 + 1, 4, generator=g, dtype=torch.float64)
        targets.append({"boxes": boxes, "labels": torch.arange(len(boxes))})
    return images, targets


def test_per_sample_lists_split_by_item_and_gather_back():
    images, targets = detection_batch(5)
    batch = {"images": images, "targets": targets, "names": [f"img{i}" for i in range(5)]}
    assert batch_size_of(batch) == 5
    chunks, sizes = split_batch(batch, CPU2)
    assert sizes == [3, 2]
    assert [len(c["targets"]) for c in chunks] == [3, 2] and chunks[1]["names"] == ["img3", "img4"]
    assert all(isinstance(c["targets"], PerSample) for c in chunks)
    for chunk, start in zip(chunks, (0, 3), strict=True):
        for k, target in enumerate(chunk["targets"]):
            assert torch.equal(target["boxes"], targets[start + k]["boxes"])
    back = merge_outputs(chunks, "cpu")
    assert torch.equal(back["images"], images) and back["names"] == batch["names"]
    assert all(torch.equal(b["boxes"], t["boxes"]) for b, t in zip(back["targets"], targets, strict=True))


def test_unmarked_per_sample_lists_fail_with_advice_only_where_it_applies():
    images, targets = detection_batch(5)
    with pytest.raises(BatchSplitError, match=r"batch\[1\] is a list of 5 dicts, as many as the batch: .*PerSample"):
        split_batch((images, list(targets)), CPU2)
    unrelated = [
        [torch.zeros(4, 5), torch.zeros(16)],  # default_collate's [x, y] with sizes that disagree
        [{"x": torch.zeros(8, 3)}, {"x": torch.zeros(4, 3)}],  # two loaders' batches
        {"hidden": [torch.zeros(4, 7), torch.zeros(4, 7)], "labels": torch.zeros(3)},
    ]
    for batch in unrelated:
        with pytest.raises(BatchSplitError) as err:
            split_batch(batch, CPU2)
        assert "PerSample" not in str(err.value)  # marking any of these lists would split it wrongly


def test_marked_lists_win_even_when_every_image_has_as_many_boxes_as_the_batch():
    """Two images with two boxes each: read as tensors, every size agrees on 2; marked, targets stay whole."""
    images = torch.randn(2, 3, 8, 8)
    targets = PerSample({"boxes": torch.full((2, 4), float(i))} for i in range(2))
    chunks, sizes = split_batch((images, targets), CPU2)
    assert sizes == [1, 1]
    for i, (chunk_images, chunk_targets) in enumerate(chunks):
        assert chunk_images.shape == (1, 3, 8, 8) and len(chunk_targets) == 1
        assert torch.equal(chunk_targets[0]["boxes"], targets[i]["boxes"])


@pytest.mark.parametrize("n", [1, 2, 3])
def test_lists_of_images_of_different_sizes_split_by_image(n: int):
    images = PerSample(torch.randn(3, 8 + i, 8) for i in range(n))
    targets = PerSample({"boxes": torch.rand(3, 4)} for _ in range(n))  # 3 boxes, 3 channels: nothing to confuse
    chunks, sizes = split_batch((images, targets), CPU2)
    assert sizes == {1: [1], 2: [1, 1], 3: [2, 1]}[n]
    assert [img.shape for chunk in chunks for img in chunk[0]] == [img.shape for img in images]
    assert sum(len(chunk[1]) for chunk in chunks) == n


def test_marked_lists_must_agree_with_the_batch():
    images, targets = detection_batch(5)
    with pytest.raises(BatchSplitError, match=r"batch\[1\] is a PerSample of 4 items but batch\[0\] has size 5"):
        split_batch((images, PerSample(targets[:4])), CPU2)
    with pytest.raises(BatchSplitError, match=r"PerSample of 5 items but batch\[1\] has 3"):
        split_batch((targets, PerSample(targets[:3])), CPU2)
    with pytest.raises(BatchSplitError, match="empty PerSample"):
        split_batch(PerSample(), CPU2)


def test_per_sample_lists_without_tensors_keep_their_type():
    chunks, _ = split_batch((torch.zeros(4, 2), PerSample(["a", "b", "c", "d"])), CPU2)
    assert [type(c[1]) for c in chunks] == [PerSample, PerSample] and chunks[1][1] == ["c", "d"]


def test_one_device_reports_the_per_sample_length_as_the_batch_size():
    model = DataParallelModel(nn.Identity(), ["cpu"])
    model(PerSample(torch.zeros(3, 8 + i, 8) for i in range(5)))
    assert model.last_split_sizes == (5,)


def test_criterion_splits_targets_without_tensors_like_the_outputs():
    """Class ids as a plain list (or a PerSample of ints): split as the outputs were, not copied to every replica."""
    logits = torch.randn(5, 3, dtype=torch.float64)
    labels = [0, 1, 0, 2, 1]

    def loss_fn(out: torch.Tensor, ids: list[int]) -> torch.Tensor:
        return nn.functional.cross_entropy(out, torch.tensor(ids))

    outputs = list(logits.tensor_split(2))
    reference = loss_fn(logits, labels)
    for targets in (labels, PerSample(labels)):
        torch.testing.assert_close(DataParallelCriterion(loss_fn, CPU2)(outputs, targets), reference)


def test_several_loaders_batches_are_read_as_a_structure():
    """Lightning passes ``[batch_a, batch_b]`` for two training loaders: each is split by its rows."""
    chunks, _ = split_batch([{"x": torch.arange(4)}, {"x": torch.arange(4, 8)}], CPU2)
    assert [[c[0]["x"].tolist(), c[1]["x"].tolist()] for c in chunks] == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]


class BoxRegressor(nn.Module):
    """Predicts one box per image; the loss is each image's mean L1 to its boxes, averaged over images."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(4, 4)
        self.double()

    def forward(self, images: torch.Tensor, targets: list[dict[str, torch.Tensor]]) -> dict[str, object]:
        boxes = self.head(self.features(images))
        per_image = torch.stack([(b - t["boxes"]).abs().mean() for b, t in zip(boxes, targets, strict=True)])
        return {"loss": per_image.mean(), "boxes": boxes, "detections": PerSample({"box": b} for b in boxes)}


@pytest.mark.parametrize("n", [5, 2, 1])
def test_model_taking_per_sample_targets_equals_one_device(n: int):
    images, targets = detection_batch(n)
    reference = BoxRegressor()
    ref = reference(images, targets)
    ref["loss"].backward()
    model = BoxRegressor()
    parallel = DataParallelModel(model, CPU2)
    outputs = parallel(images, targets)
    loss = DataParallelCriterion(lambda out: out["loss"], CPU2, weight_fn=lambda out, t: len(out["boxes"]))(outputs)
    loss.backward()
    torch.testing.assert_close(loss, ref["loss"], rtol=0, atol=1e-12)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)
    gathered = parallel.gather(outputs)
    assert len(gathered["detections"]) == n
    for got, want in zip(gathered["detections"], ref["detections"], strict=True):
        torch.testing.assert_close(got["box"], want["box"], rtol=0, atol=1e-12)


def test_criterion_with_per_sample_targets_only():
    """Targets given as PerSample alone are split as the outputs were."""
    images, targets = detection_batch(5)
    model = BoxRegressor()

    def box_loss(boxes: torch.Tensor, targets: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        return torch.stack([(b - t["boxes"]).abs().mean() for b, t in zip(boxes, targets, strict=True)]).mean()

    reference = box_loss(model.head(model.features(images)), targets)
    outputs = DataParallelModel(nn.Sequential(model.features, model.head), CPU2)(images)
    loss = DataParallelCriterion(box_loss, CPU2)(outputs, targets)
    torch.testing.assert_close(loss, reference, rtol=0, atol=1e-12)


def test_move_to_moves_the_tensors_inside_per_sample_lists():
    from lightning_mgpu.parallel.scatter_gather import move_to

    moved = move_to((PerSample([{"boxes": torch.zeros(2, 4)}]), torch.zeros(1)), "meta")
    assert isinstance(moved[0], PerSample) and moved[0][0]["boxes"].device.type == "meta"
    assert moved[1].device.type == "meta"
