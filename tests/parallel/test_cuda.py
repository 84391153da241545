"""The same core on real CUDA devices: virtual replicas of cuda:0, and cuda:0 + cuda:1 when there are two GPUs."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from lightning_mgpu.parallel import (
    DataParallelCriterion,
    DataParallelModel,
    merge_outputs,
    replicate,
    split_batch,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

DEVICE_SETS = {
    "virtual": ["cuda:0", "cuda:0"],
    "virtual3": ["cuda:0"] * 3,
    "two_gpus": pytest.param(["cuda:0", "cuda:1"], marks=two_gpus),
}


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 7 * 7, 5),
    )


@pytest.fixture(autouse=True)
def _exact_float32():
    previous = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


@pytest.mark.parametrize("devices", list(DEVICE_SETS.values()), ids=list(DEVICE_SETS))
def test_replicate_scatter_gather(devices):
    model = cnn().cuda()
    replicas = replicate(model, devices)
    assert [next(r.parameters()).device for r in replicas] == [torch.device(d) for d in devices]
    x = torch.randn(9, 3, 16, 16, device="cuda:0")
    chunks, sizes = split_batch({"x": x, "names": list("abcdefghi")}, devices)
    assert sizes == [len(t) for t in torch.arange(9).tensor_split(len(devices))]
    assert [c["x"].device for c in chunks] == [torch.device(d) for d in devices]
    back = merge_outputs(chunks, "cuda:0")
    assert torch.equal(back["x"], x) and back["names"] == list("abcdefghi")
    outputs = [r(c["x"]) for r, c in zip(replicas, chunks, strict=True)]
    assert (merge_outputs(outputs, "cuda:0") - model(x)).abs().max().item() < 1e-5


@pytest.mark.parametrize("mode", ["threads", "sequential"])
@pytest.mark.parametrize("devices", list(DEVICE_SETS.values()), ids=list(DEVICE_SETS))
@pytest.mark.parametrize("batch_size", [12, 7, 1])
def test_gradients_float32(devices, mode, batch_size):
    reference, model = cnn().cuda(), cnn().cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch_size, 3, 16, 16, device="cuda", generator=g)
    y = torch.randint(0, 5, (batch_size,), device="cuda", generator=g)
    ref_loss = nn.CrossEntropyLoss()(reference(x), y)
    ref_loss.backward()
    loss = DataParallelCriterion(nn.CrossEntropyLoss(), devices, execution_mode=mode)(
        DataParallelModel(model, devices, execution_mode=mode)(x),
        y.cpu(),  # targets may live elsewhere: moved per device
    )
    loss.backward()
    assert loss.device == torch.device("cuda:0")
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    for p, q in zip(reference.parameters(), model.parameters(), strict=True):
        assert q.grad.device == p.device
        assert (p.grad - q.grad).abs().max().item() < 1e-5


@pytest.mark.parametrize("devices", list(DEVICE_SETS.values()), ids=list(DEVICE_SETS))
def test_autocast_bf16_in_worker_threads(devices):
    records = []
    lock = threading.Lock()

    class Recorder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            out = self.lin(x)
            with lock:
                records.append(
                    (
                        threading.current_thread().name,
                        torch.is_autocast_enabled("cuda"),
                        torch.get_autocast_dtype("cuda"),
                        out.dtype,
                        torch.cuda.current_device(),
                        x.device,
                    )
                )
            return out

    with torch.autocast("cuda", dtype=torch.bfloat16):
        outputs = DataParallelModel(Recorder().cuda(), devices, execution_mode="threads")(
            torch.randn(6, 8, device="cuda")
        )
    assert len(records) == len(devices)
    assert sum(name == threading.current_thread().name for name, *_ in records) == 1
    assert all(enabled and dtype == torch.bfloat16 and out == torch.bfloat16 for _, enabled, dtype, out, *_ in records)
    assert all(current == device.index for *_, current, device in records)  # each worker on its replica's device
    assert all(o.dtype == torch.bfloat16 for o in outputs)


def test_caller_stream_is_used_by_workers():
    streams = []
    lock = threading.Lock()

    class Probe(nn.Module):
        def forward(self, x):
            with lock:
                streams.append(torch.cuda.current_stream(x.device))
            return x * 2

    side = torch.cuda.Stream()
    x = torch.randn(4, 3, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        outputs = DataParallelModel(Probe(), ["cuda:0", "cuda:0"], execution_mode="threads")(x)
        result = torch.cat(outputs)
    torch.cuda.current_stream().wait_stream(side)
    assert all(s == side for s in streams)
    assert torch.equal(result, x * 2)


@pytest.mark.parametrize("devices", list(DEVICE_SETS.values()), ids=list(DEVICE_SETS))
@pytest.mark.parametrize("accumulate", [1, 3])
def test_flat_buffer_replicas_in_threads_train_as_one_device(devices, accumulate):
    """Own-leaf replicas (threads): one copy per device after each step, one reduction per device onto cuda:0."""

    def run(parallel: bool) -> nn.Module:
        model = cnn().cuda().double()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        net = DataParallelModel(model, devices, execution_mode="threads") if parallel else model
        loss_fn = DataParallelCriterion(nn.CrossEntropyLoss(), devices, execution_mode="threads")
        for step in range(3):
            for micro in range(accumulate):
                g = torch.Generator(device="cuda:0").manual_seed(10 * step + micro)
                x = torch.randn(8, 3, 16, 16, device="cuda:0", dtype=torch.float64, generator=g)
                y = torch.randint(0, 5, (8,), device="cuda:0", generator=g)
                out = net(x)
                loss = loss_fn(out, y) if parallel else nn.functional.cross_entropy(out, y)
                (loss / accumulate).backward()
            opt.step()
            opt.zero_grad()
        return model

    for p, q in zip(run(True).parameters(), run(False).parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-10)


@two_gpus
def test_replicas_on_the_second_gpu_see_the_optimizer_step_and_the_roots_buffers():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).cuda()
    net = DataParallelModel(model, ["cuda:0", "cuda:1"], execution_mode="threads")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        out = net(torch.randn(8, 4, device="cuda:0"))
        sum(o.sum() for o in out).backward()
        opt.step()
        opt.zero_grad()
    replica = net._replicas.of(model, net.device_ids).prepare(2)[1]
    torch.testing.assert_close(replica[0].weight.cpu(), model[0].weight.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(replica[1].running_mean.cpu(), model[1].running_mean.cpu(), rtol=0, atol=0)
