"""Per-sample records (detection-style targets): lists of dicts whose tensors have per-sample sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mgpu.parallel import (
    BatchSplitError,
    DataParallelCriterion,
    DataParallelModel,
    batch_size_of,
    gather,
    scatter,
)

CPU2 = ["cpu"] * 2


def detection_batch(n: int, seed: int = 0) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """Images (n, 3, 8, 8) and one target dict per image with a varying number of boxes (1 to 4)."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64)
    targets = []
    for i in range(n):
        boxes = torch.rand(i % 4 + 1, 4, generator=g, dtype=torch.float64)
        targets.append({"boxes": boxes, "labels": torch.arange(len(boxes))})
    return images, targets


def test_record_lists_split_by_items_and_gather_back():
    images, targets = detection_batch(5)
    batch = {"images": images, "targets": targets, "names": [f"img{i}" for i in range(5)]}
    assert batch_size_of(batch) == 5
    chunks, sizes = scatter(batch, CPU2)
    assert sizes == [3, 2]
    assert [len(c["targets"]) for c in chunks] == [3, 2] and chunks[1]["names"] == ["img3", "img4"]
    for chunk, start in zip(chunks, (0, 3), strict=True):
        for k, target in enumerate(chunk["targets"]):
            assert torch.equal(target["boxes"], targets[start + k]["boxes"])
    back = gather(chunks, "cpu")
    assert torch.equal(back["images"], images) and back["names"] == batch["names"]
    assert all(torch.equal(b["boxes"], t["boxes"]) for b, t in zip(back["targets"], targets, strict=True))
    with pytest.raises(BatchSplitError, match="has size"):  # records alone (e.g. several loaders' batches): strict
        batch_size_of(targets)


def test_record_lists_that_do_not_line_up_keep_the_clear_error():
    images, targets = detection_batch(5)
    with pytest.raises(BatchSplitError, match=r"batch\[0\] has size 5 but batch\[1\]\[0\]\['boxes'\] has size 1"):
        scatter((images, targets[:4]), CPU2)
    with pytest.raises(BatchSplitError, match="has size"):
        batch_size_of([targets, targets[:3]])  # two record lists of different lengths and nothing else


class BoxRegressor(nn.Module):
    """Predicts one box per image; the loss is each image's mean L1 to its boxes, averaged over images."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(4, 4)
        self.double()

    def forward(self, images: torch.Tensor, targets: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        boxes = self.head(self.features(images))
        per_image = torch.stack([(b - t["boxes"]).abs().mean() for b, t in zip(boxes, targets, strict=True)])
        return {"loss": per_image.mean(), "boxes": boxes, "detections": [{"box": b} for b in boxes]}


@pytest.mark.parametrize("n", [5, 2])
def test_model_taking_record_targets_equals_one_device(n: int):
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
    gathered = parallel.gather(outputs)  # with the call's split sizes: one record per sample, even 1 per replica
    assert len(gathered["detections"]) == n  # per-sample records concatenated, not merged item by item
    for got, want in zip(gathered["detections"], ref["detections"], strict=True):
        torch.testing.assert_close(got["box"], want["box"], rtol=0, atol=1e-12)


def test_records_win_when_every_image_has_as_many_boxes_as_the_batch():
    """Two images with exactly two boxes each: every tensor agrees on 2, yet the targets are per image."""
    images = torch.randn(2, 3, 8, 8)
    targets = [{"boxes": torch.full((2, 4), float(i))} for i in range(2)]
    chunks, sizes = scatter((images, targets), CPU2)
    assert sizes == [1, 1]
    for i, (chunk_images, chunk_targets) in enumerate(chunks):
        assert chunk_images.shape == (1, 3, 8, 8) and len(chunk_targets) == 1
        assert torch.equal(chunk_targets[0]["boxes"], targets[i]["boxes"])  # whole, not a slice of each


@pytest.mark.parametrize("n", [2, 3])
def test_torchvision_style_lists_of_images_split_by_image(n: int):
    """Images as a list of (3, H_i, W_i) tensors: with 3 images, the channel size must not be read as the batch."""
    images = [torch.randn(3, 8 + i, 8) for i in range(n)]
    targets = [{"boxes": torch.rand(i + 1, 4)} for i in range(n)]
    chunks, sizes = scatter((images, targets), CPU2)
    assert sizes == ([1, 1] if n == 2 else [2, 1])
    flat_images = [img for chunk in chunks for img in chunk[0]]
    assert [img.shape for img in flat_images] == [img.shape for img in images]
    assert sum(len(chunk[1]) for chunk in chunks) == n


def test_several_loaders_batches_are_not_taken_for_records():
    """Lightning passes ``[batch_a, batch_b]`` for two training loaders: not per-sample records, so sizes must agree."""
    batches = [{"x": torch.zeros(8, 3)}, {"x": torch.zeros(4, 3)}]
    with pytest.raises(BatchSplitError, match=r"batch\[0\]\['x'\] has size 8 but batch\[1\]\['x'\] has size 4"):
        scatter(batches, CPU2)
    chunks, _ = scatter([{"x": torch.arange(4)}, {"x": torch.arange(4)}], CPU2)  # equal sizes: each split by rows
    assert [c[0]["x"].tolist() for c in chunks] == [[0, 1], [2, 3]]
