"""Single-process SyncBatchNorm: replicas of one call normalise with the whole batch's statistics, exactly.

Reference: one ``BatchNorm`` on the whole batch, float64, to 1e-10 — outputs, input gradients, parameter gradients,
running statistics and ``num_batches_tracked`` over several steps, with uneven shards (4/3/3 and 5/4). Failure cases
(a replica that skips a layer, reorders layers or raises) run under a timeout so that a regression fails, not hangs.
"""

from __future__ import annotations

import copy
import functools
import pickle
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from lightning_mgpu.parallel import DataParallelModel, replicate, run_replicas
from lightning_mgpu.parallel.replica_group import PeerFailedError, RendezvousError
from lightning_mgpu.parallel.replicas import SYNC_BATCHNORM_THREADS
from lightning_mgpu.parallel.sync_batchnorm import (
    SyncBatchNorm,
    convert_sync_batchnorm,
    revert_sync_batchnorm,
    uses_sync_batchnorm,
)

C = 3
TOL = dict(rtol=0, atol=1e-10)
SPLITS = {"3 devices 4/3/3": (["cpu"] * 3, [4, 3, 3]), "2 devices 5/4": (["cpu"] * 2, [5, 4])}
SHAPES = {  # BatchNorm class, per-sample shape
    "1d-2D": (nn.BatchNorm1d, (C,)),
    "1d-3D": (nn.BatchNorm1d, (C, 5)),
    "2d": (nn.BatchNorm2d, (C, 4, 3)),
    "3d": (nn.BatchNorm3d, (C, 2, 3, 2)),
}


@pytest.fixture(autouse=True)
def _float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def bn_pair(cls: type[nn.Module] = nn.BatchNorm2d, **kwargs: Any) -> tuple[nn.Module, nn.Module]:
    """A BatchNorm with non-trivial affine parameters and its converted copy (same values, separate tensors)."""
    torch.manual_seed(0)
    reference = cls(C, **kwargs)
    if reference.affine:
        with torch.no_grad():
            reference.weight.uniform_(0.5, 1.5)
            reference.bias.uniform_(-1, 1)
    return reference, convert_sync_batchnorm(copy.deepcopy(reference))


def run_replicated(
    layer: nn.Module, x: torch.Tensor, devices: list[str], sizes: list[int], mode: str = "threads"
) -> torch.Tensor:
    replicas = replicate(layer, devices)
    chunks = x.split(sizes)
    outputs = run_replicas([functools.partial(r, c) for r, c in zip(replicas, chunks, strict=True)], devices, mode)
    return torch.cat(outputs)


def assert_same_state(sync: nn.Module, reference: nn.Module) -> None:
    for (name, a), (_, b) in zip(sync.named_buffers(), reference.named_buffers(), strict=True):
        torch.testing.assert_close(a, b, **TOL, msg=name)
    for (name, a), (_, b) in zip(sync.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, **TOL, msg=f"{name}.grad")


def step_both(reference: nn.Module, sync: nn.Module, devices: list[str], sizes: list[int], shape: tuple[int, ...]):
    """One forward/backward of both on the same batch and upstream gradient; compare outputs and input grads."""
    x = torch.randn(sum(sizes), *shape) * 2 + 1
    upstream = torch.randn_like(x)
    x_ref, x_sync = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = reference(x_ref)
    (expected * upstream).sum().backward()
    got = run_replicated(sync, x_sync, devices, sizes)
    (got * upstream).sum().backward()
    torch.testing.assert_close(got, expected, **TOL)
    torch.testing.assert_close(x_sync.grad, x_ref.grad, **TOL)


def call_with_timeout(fn: Callable[[], Any], timeout: float = 60.0) -> BaseException | None:
    """Run ``fn`` in a thread; fail (instead of hanging the suite) if it does not return in time. Returns its error."""
    outcome: dict[str, BaseException] = {}

    def target() -> None:
        try:
            fn()
        except BaseException as err:  # the test inspects whatever was raised
            outcome["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"the replicated call hung for {timeout} s"
    return outcome.get("error")


# --- equivalence with one BatchNorm on the whole batch ------------------------------------------------------------
@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("split", list(SPLITS))
def test_training_steps_equal_one_batchnorm(split, kind, momentum):
    devices, sizes = SPLITS[split]
    cls, shape = SHAPES[kind]
    reference, sync = bn_pair(cls, momentum=momentum)
    torch.manual_seed(1)
    for _ in range(3):
        step_both(reference, sync, devices, sizes, shape)
    assert_same_state(sync, reference)
    assert sync.num_batches_tracked.item() == 3


@pytest.mark.parametrize(
    "kwargs", [dict(affine=False), dict(track_running_stats=False)], ids=["no-affine", "no-running-stats"]
)
def test_options_equal_one_batchnorm(kwargs):
    devices, sizes = SPLITS["3 devices 4/3/3"]
    reference, sync = bn_pair(**kwargs)
    torch.manual_seed(1)
    for _ in range(2):
        step_both(reference, sync, devices, sizes, (C, 4, 3))
    assert_same_state(sync, reference)
    assert uses_sync_batchnorm(sync)
    # Without running statistics, eval mode normalises with the batch's statistics: across replicas too.
    reference.eval()
    sync.eval()
    assert uses_sync_batchnorm(sync) == (not sync.track_running_stats)
    step_both(reference, sync, devices, sizes, (C, 4, 3))


def test_eval_mode_uses_running_statistics_and_runs_sequentially():
    reference, sync = bn_pair()
    devices, sizes = SPLITS["3 devices 4/3/3"]
    torch.manual_seed(1)
    step_both(reference, sync, devices, sizes, (C, 4, 3))  # non-trivial running statistics
    reference.eval()
    sync.eval()
    assert not uses_sync_batchnorm(sync)
    x = torch.randn(10, C, 4, 3)
    torch.testing.assert_close(run_replicated(sync, x, devices, sizes, mode="sequential"), reference(x), **TOL)
    assert_same_state(sync, reference)


def test_plain_call_is_batchnorm():
    """Outside a replicated call (one device) the layer is BatchNorm, running statistics included."""
    reference, sync = bn_pair(momentum=None)
    for _ in range(2):
        x = torch.randn(6, C, 4, 3)
        torch.testing.assert_close(sync(x), reference(x), **TOL)
    assert_same_state(sync, reference)
    # A call with one replica is a plain call too.
    x = torch.randn(6, C, 4, 3)
    torch.testing.assert_close(run_replicated(sync, x, ["cpu"], [6]), reference(x), **TOL)


def test_input_without_grad_and_forward_without_grad():
    """BatchNorm on raw inputs (no input gradient) still trains its parameters; a no-grad forward still updates the
    running statistics, as BatchNorm's does."""
    reference, sync = bn_pair()
    devices, sizes = SPLITS["3 devices 4/3/3"]
    x = torch.randn(10, C, 4, 3)
    upstream = torch.randn_like(x)
    (reference(x) * upstream).sum().backward()
    (run_replicated(sync, x, devices, sizes) * upstream).sum().backward()
    with torch.no_grad():
        x = torch.randn(10, C, 4, 3)
        torch.testing.assert_close(run_replicated(sync, x, devices, sizes), reference(x), **TOL)
    assert_same_state(sync, reference)


def test_one_layer_object_serving_every_replica():
    """Without replicas (the same layer in every callable) the call is still one BatchNorm over the whole batch."""
    reference, sync = bn_pair()
    x = torch.randn(10, C, 4, 3)
    x_ref, x_sync = x.clone().requires_grad_(), x.clone().requires_grad_()
    upstream = torch.randn_like(x)
    expected = reference(x_ref)
    (expected * upstream).sum().backward()
    got = torch.cat(run_replicas([functools.partial(sync, c) for c in x_sync.split([4, 3, 3])], ["cpu"] * 3, "threads"))
    (got * upstream).sum().backward()
    torch.testing.assert_close(got, expected, **TOL)
    torch.testing.assert_close(x_sync.grad, x_ref.grad, **TOL)
    assert_same_state(sync, reference)


class TwoBlocks(nn.Module):
    """conv-BN-ReLU twice, then a head; ``share`` reuses one BatchNorm for both blocks (two calls per forward)."""

    def __init__(self, share: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(2, C, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(C)
        self.conv2 = nn.Conv2d(C, C, 3, padding=1)
        self.bn2 = self.bn1 if share else nn.BatchNorm2d(C)
        self.head = nn.Linear(C, 2)

    def forward(self, x: torch.Tensor, skip: bool = False, reverse: bool = False, fail: bool = False) -> torch.Tensor:
        if fail:
            raise ValueError("replica input is corrupt")
        first, second = (self.bn2, self.bn1) if reverse else (self.bn1, self.bn2)
        x = torch.relu_(first(self.conv1(x)))  # in place on the layer's output
        x = self.conv2(x)
        if not skip:
            x = second(x)
        return self.head(torch.relu(x).mean((2, 3)))


@pytest.mark.parametrize("share", [False, True], ids=["two-layers", "one-layer-called-twice"])
def test_model_under_data_parallel_model_equals_one_device(share):
    reference = TwoBlocks(share)
    model = convert_sync_batchnorm(copy.deepcopy(reference))
    parallel = DataParallelModel(model, ["cpu"] * 3, execution_mode="threads")
    torch.manual_seed(1)
    for _ in range(2):
        x, y = torch.randn(10, 2, 5, 4), torch.randn(10, 2)
        nn.functional.mse_loss(reference(x), y).backward()
        loss = nn.functional.mse_loss(torch.cat(parallel(x)), y)
        loss.backward()
        assert parallel.last_split_sizes == (4, 3, 3)
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, **TOL, msg=name)
    for (name, a), (_, b) in zip(model.named_buffers(), reference.named_buffers(), strict=True):
        torch.testing.assert_close(a, b, **TOL, msg=name)


def test_layers_converted_between_steps_synchronise_from_the_next_step_on():
    # The replica set lists its sync layers once per build; a conversion between steps is a structural change that
    # execution_mode() must see before choosing the mode (sequential replicas cannot meet: RendezvousError).
    reference = TwoBlocks()
    model = copy.deepcopy(reference)
    parallel = DataParallelModel(model, ["cpu"] * 3, execution_mode="sequential")
    torch.manual_seed(1)
    batches = [(torch.randn(10, 2, 5, 4), torch.randn(10, 2)) for _ in range(2)]
    parallel.eval()
    parallel(batches[0][0])  # plain BatchNorm with running statistics: replicas built, no state changed
    convert_sync_batchnorm(model.train())
    with pytest.warns(UserWarning, match="overridden"):
        nn.functional.mse_loss(torch.cat(parallel(batches[1][0])), batches[1][1]).backward()
    nn.functional.mse_loss(reference(batches[1][0]), batches[1][1]).backward()
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, **TOL, msg=name)
    for (name, a), (_, b) in zip(model.named_buffers(), reference.named_buffers(), strict=True):
        torch.testing.assert_close(a, b, **TOL, msg=name)


def test_threads_are_deterministic():
    results = []
    for _ in range(3):
        _, sync = bn_pair()
        torch.manual_seed(1)
        x = torch.randn(10, C, 4, 3, requires_grad=True)
        y = run_replicated(sync, x, *SPLITS["3 devices 4/3/3"])
        (y * torch.randn_like(y)).sum().backward()
        results.append(torch.cat([y.flatten(), x.grad.flatten(), sync.weight.grad, sync.running_var]))
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_empty_shard_on_one_replica():
    reference, sync = bn_pair()
    x = torch.randn(7, C, 4, 3)
    x_ref, x_sync = x.clone().requires_grad_(), x.clone().requires_grad_()
    upstream = torch.randn_like(x)
    expected = reference(x_ref)
    (expected * upstream).sum().backward()
    got = run_replicated(sync, x_sync, ["cpu"] * 3, [4, 0, 3])
    (got * upstream).sum().backward()
    torch.testing.assert_close(got, expected, **TOL)
    torch.testing.assert_close(x_sync.grad, x_ref.grad, **TOL)
    assert_same_state(sync, reference)


def test_bf16_autocast_within_bf16_tolerance():
    torch.set_default_dtype(torch.float32)
    reference = TwoBlocks()
    model = convert_sync_batchnorm(copy.deepcopy(reference))
    torch.manual_seed(1)
    x, y = torch.randn(10, 2, 5, 4), torch.randn(10, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference.bn1(reference.conv1(x))
        got = torch.cat(DataParallelModel(model.bn1, ["cpu"] * 3, execution_mode="threads")(model.conv1(x)))
        assert got.dtype == expected.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
        nn.functional.mse_loss(reference(x).float(), y).backward()
        nn.functional.mse_loss(
            torch.cat(DataParallelModel(model, ["cpu"] * 3, execution_mode="threads")(x)).float(), y
        ).backward()
    # A conv bias that feeds a training-mode BatchNorm has a zero gradient in exact arithmetic: in half precision
    # both runs hold rounding noise there, which is measured against the model's gradient scale, not its own norm.
    scale = max(p.grad.norm() for p in reference.parameters())
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert (a.grad - b.grad).norm() <= 5e-2 * b.grad.norm() + 1e-2 * scale, name
    torch.testing.assert_close(model.bn1.running_mean, reference.bn1.running_mean, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(model.bn1.running_var, reference.bn1.running_var, rtol=1e-2, atol=1e-2)
    assert model.bn1.running_mean.dtype == torch.float32


# --- failures: fast and clear, never a hang -----------------------------------------------------------------------
def run_two_blocks(model: nn.Module, flags: list[dict[str, bool]], mode: str = "threads") -> list[torch.Tensor]:
    devices = ["cpu"] * len(flags)
    replicas = replicate(model, devices)
    chunks = torch.randn(3 * len(flags), 2, 5, 4).chunk(len(flags))
    calls = [functools.partial(r, c, **f) for r, c, f in zip(replicas, chunks, flags, strict=True)]
    return run_replicas(calls, devices, mode)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_block_holding_a_sync_layer_fails_clearly_in_backward(reentrant):
    """Activation checkpointing recomputes the block in the backward pass, where replicas cannot meet: without the
    error, the recomputation normalised each shard by itself (wrong gradients) or failed on mismatched metadata."""
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(4, 4)  # the block's input requires grad, as reentrant checkpointing needs
            self.block = nn.Sequential(nn.Linear(4, C), nn.BatchNorm1d(C), nn.ReLU())
            self.head = nn.Linear(C, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(checkpoint(self.block, self.stem(x), use_reentrant=reentrant))

    torch.manual_seed(0)
    model = DataParallelModel(convert_sync_batchnorm(Net()), ["cpu"] * 2, execution_mode="threads")
    outputs = model(torch.randn(6, 4))
    with pytest.raises(RuntimeError, match=r"activation checkpointing.*Keep SyncBatchNorm layers out of checkpointed"):
        torch.cat(outputs).sum().backward()


def test_replica_that_skips_a_layer_fails_fast_naming_it():
    model = convert_sync_batchnorm(TwoBlocks())
    err = call_with_timeout(lambda: run_two_blocks(model, [{}, {"skip": True}, {}]))
    assert isinstance(err, RendezvousError) and not isinstance(err, PeerFailedError)
    message = str(err)
    assert "SyncBatchNorm layer 'bn2'" in message
    assert "replica(s) [1], which finished without reaching it" in message
    assert "same number of times and in the same order" in message  # what to do
    assert err.replica_index == 0


def test_replica_that_reorders_layers_fails_fast():
    model = TwoBlocks()
    model.bn1, model.bn2 = SyncBatchNorm(C), SyncBatchNorm(C)  # built directly: named by uses_sync_batchnorm
    assert uses_sync_batchnorm(model)
    err = call_with_timeout(lambda: run_two_blocks(model, [{}, {"reverse": True}, {}]))
    assert isinstance(err, RendezvousError) and not isinstance(err, PeerFailedError)
    assert "different sync points" in str(err)
    assert "'bn1'" in str(err) and "'bn2'" in str(err)


def test_raising_replica_is_the_error_the_caller_sees():
    model = convert_sync_batchnorm(TwoBlocks())
    err = call_with_timeout(lambda: run_two_blocks(model, [{}, {}, {"fail": True}]))
    assert isinstance(err, ValueError) and str(err) == "replica input is corrupt"
    assert err.replica_index == 2
    assert "Other replicas of this call failed too: replica 0: PeerFailedError" in err.__notes__[-1]


def test_keyboard_interrupt_in_a_replica_releases_the_waiting_ones():
    class Interrupting(TwoBlocks):
        def forward(self, x, interrupt=False):
            if interrupt:
                raise KeyboardInterrupt
            return super().forward(x)

    model = convert_sync_batchnorm(Interrupting())
    err = call_with_timeout(lambda: run_two_blocks(model, [{}, {"interrupt": True}]))
    assert isinstance(err, KeyboardInterrupt) and err.replica_index == 1


def test_failure_while_combining_is_reported_by_the_replica_that_combined():
    _, sync = bn_pair(nn.BatchNorm1d)
    err = call_with_timeout(lambda: run_replicated(sync, torch.randn(1, C), ["cpu"] * 2, [1, 0]))
    assert isinstance(err, ValueError) and "Expected more than 1 value per channel when training" in str(err)


def test_sequential_mode_cannot_synchronise():
    model = convert_sync_batchnorm(TwoBlocks())
    err = call_with_timeout(lambda: run_two_blocks(model, [{}, {}], mode="sequential"))
    assert isinstance(err, RendezvousError)
    assert "'bn1'" in str(err) and "execution_mode='sequential'" in str(err) and "execution_mode='threads'" in str(err)


# --- conversion ---------------------------------------------------------------------------------------------------
def bn_zoo() -> nn.Module:
    torch.manual_seed(0)
    shared = nn.BatchNorm2d(4)
    return nn.Sequential(
        nn.Conv2d(2, 4, 1),
        shared,
        nn.Sequential(nn.BatchNorm2d(4, affine=False), shared),
        nn.Flatten(2),
        nn.BatchNorm1d(4, momentum=None),
        nn.Unflatten(2, (1, 1, 1)),
        nn.BatchNorm3d(4, track_running_stats=False),
    )


def test_convert_keeps_parameters_buffers_flags_and_hooks():
    model = bn_zoo()
    model[4].eval()
    model[1].weight.requires_grad_(False)
    seen = []
    model[4].register_forward_hook(lambda m, i, o: seen.append(type(m)))
    params = {name: p for name, p in model.named_parameters()}
    buffers = {name: b for name, b in model.named_buffers()}
    keys = list(model.state_dict())
    converted = convert_sync_batchnorm(model)
    assert converted is model
    layers = {name: m for name, m in model.named_modules() if isinstance(m, SyncBatchNorm)}
    assert sorted(layers) == ["1", "2.0", "4", "6"]
    assert model[2][1] is model[1]  # a shared layer stays shared
    assert all(p is params[name] for name, p in model.named_parameters())
    assert all(b is buffers[name] for name, b in model.named_buffers())
    assert list(model.state_dict()) == keys
    assert not model[1].weight.requires_grad and not model[4].training and model[1].training
    model(torch.randn(5, 2, 1, 1))
    assert seen == [SyncBatchNorm]
    assert model[2][0]._sync_key.name == "2.0" and model[6]._sync_key.original_class is nn.BatchNorm3d
    with pytest.raises(ValueError, match=r"expected 4D input \(got 3D input\)"):
        model[1](torch.randn(5, 4, 3))

    reverted = revert_sync_batchnorm(model)
    assert [type(m) for m in reverted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)] == [
        nn.BatchNorm2d,
        nn.BatchNorm2d,
        nn.BatchNorm1d,
        nn.BatchNorm3d,
    ]
    assert all(p is params[name] for name, p in reverted.named_parameters())
    assert "_sync_key" not in reverted[1].__dict__ and reverted[2][1] is reverted[1]


def test_checkpoints_move_between_converted_and_plain_models():
    plain, converted = bn_zoo(), convert_sync_batchnorm(bn_zoo())
    with torch.no_grad():
        for t in [*converted.parameters(), *converted.buffers()]:
            t.add_(torch.rand_like(t.double()).to(t.dtype) * 3 if t.is_floating_point() else 7)
    plain.load_state_dict(converted.state_dict())
    fresh = convert_sync_batchnorm(bn_zoo())
    fresh.load_state_dict(plain.state_dict())
    for (name, a), (_, b) in zip(fresh.state_dict().items(), converted.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_root_torch_syncbatchnorm_lazy_and_direct_layers():
    root = nn.BatchNorm2d(C)
    converted = convert_sync_batchnorm(root)
    assert isinstance(converted, SyncBatchNorm) and converted.weight is root.weight
    assert type(revert_sync_batchnorm(converted)) is nn.BatchNorm2d

    torch_sync = nn.SyncBatchNorm(C)
    assert type(revert_sync_batchnorm(convert_sync_batchnorm(torch_sync))) is nn.SyncBatchNorm

    with pytest.raises(ValueError, match="Run one forward pass"):
        convert_sync_batchnorm(nn.Sequential(nn.LazyBatchNorm2d()))

    direct = nn.Sequential(SyncBatchNorm(C))
    with pytest.raises(ValueError, match=r"'0' was built directly.*default=nn.BatchNorm2d"):
        revert_sync_batchnorm(direct)
    assert type(revert_sync_batchnorm(direct, default=nn.BatchNorm1d)[0]) is nn.BatchNorm1d


def test_replicas_share_the_key_and_deep_copies_get_their_own():
    layer = SyncBatchNorm(C)
    replicas = replicate(layer, ["cpu"] * 3)
    assert all(r._sync_key is layer._sync_key for r in replicas)
    clone = copy.deepcopy(layer)
    assert clone._sync_key is not layer._sync_key
    layer._sync_key.name = "net.bn"
    restored = pickle.loads(pickle.dumps(layer))  # torch.save of a whole model
    assert restored._sync_key is not layer._sync_key and restored._sync_key.name == "net.bn"


def test_uses_sync_batchnorm():
    plain = bn_zoo()
    assert not uses_sync_batchnorm(plain)
    converted = convert_sync_batchnorm(bn_zoo())
    assert uses_sync_batchnorm(converted)
    converted.eval()
    assert uses_sync_batchnorm(converted)  # the BatchNorm3d without running statistics still synchronises
    converted[6].train()
    converted[6].track_running_stats = False
    revert_sync_batchnorm(converted)
    assert not uses_sync_batchnorm(converted)


@pytest.mark.parametrize("replicas", [2, 3])
def test_the_synchronised_statistics_do_not_read_as_a_loss_coupled_across_the_shard(replicas):
    """A shard normalised with the whole batch's statistics trains as one device: the loss graph's coupling check
    (which flags a per-shard BatchNorm) finds nothing, also where the shard size equals the number of replicas."""
    from lightning_mgpu.parallel.loss_coupling import coupling

    model = convert_sync_batchnorm(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 1)))
    outputs = DataParallelModel(model, ["cpu"] * replicas, execution_mode="threads")(torch.randn(replicas**2, 3))
    assert [coupling(o.pow(2).mean(), replicas) for o in outputs] == [None] * replicas


# --- CUDA ---------------------------------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
CUDA_SPLITS = {
    "virtual 4/3/3": (["cuda:0"] * 3, [4, 3, 3]),
    "two gpus 5/4": pytest.param((["cuda:0", "cuda:1"], [5, 4]), marks=two_gpus),
}


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("split", list(CUDA_SPLITS.values()), ids=list(CUDA_SPLITS))
def test_cuda_equals_one_batchnorm(split, momentum, dtype):
    devices, sizes = split
    reference, sync = bn_pair(momentum=momentum)
    reference, sync = reference.to("cuda:0", dtype), sync.to("cuda:0", dtype)
    tol = TOL if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.manual_seed(1)
    for _ in range(3):
        x = (torch.randn(sum(sizes), C, 4, 3) * 2 + 1).to("cuda:0", dtype)
        upstream = torch.randn_like(x)
        x_ref, x_sync = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected = reference(x_ref)
        (expected * upstream).sum().backward()
        replicas = replicate(sync, devices)
        chunks = [c.to(d) for c, d in zip(x_sync.split(sizes), devices, strict=True)]
        calls = [functools.partial(r, c) for r, c in zip(replicas, chunks, strict=True)]
        got = torch.cat([o.to("cuda:0") for o in run_replicas(calls, devices, execution_mode="threads")])
        (got * upstream).sum().backward()
        torch.testing.assert_close(got, expected, **tol)
        torch.testing.assert_close(x_sync.grad, x_ref.grad, **tol)
    for (name, a), (_, b) in zip(sync.named_buffers(), reference.named_buffers(), strict=True):
        torch.testing.assert_close(a.double(), b.double(), **tol, msg=name)
    for (name, a), (_, b) in zip(sync.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, **tol, msg=name)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels-last"])
def test_cuda_layer_never_blocks_the_host(momentum, channels_last):
    """Forward and backward of the synchronised layer run without a host synchronisation (no .item(), no blocking
    copy). The layer itself serves the 3 virtual replicas, so only its own code runs under the sync debug mode."""
    reference, sync = bn_pair(momentum=momentum)
    reference, sync = reference.to("cuda:0", torch.float32), sync.to("cuda:0", torch.float32)
    x = torch.randn(10, C, 4, 3, device="cuda:0", dtype=torch.float32) * 2 + 1  # the module fixture sets float64
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    upstream = torch.randn_like(x)
    x_ref, x_sync = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = reference(x_ref)
    (expected * upstream).sum().backward()
    chunks = x_sync.split([4, 3, 3])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outputs = run_replicas([functools.partial(sync, c) for c in chunks], ["cuda:0"] * 3, execution_mode="threads")
        got = torch.cat(outputs)
        (got * upstream).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, expected, **tol)
    torch.testing.assert_close(x_sync.grad, x_ref.grad, **tol)
    for (name, a), (_, b) in zip(sync.named_buffers(), reference.named_buffers(), strict=True):
        torch.testing.assert_close(a.double(), b.double(), **tol, msg=name)
    for (name, a), (_, b) in zip(sync.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, **tol, msg=name)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("split", list(CUDA_SPLITS.values()), ids=list(CUDA_SPLITS))
def test_cuda_autocast(split, dtype):
    devices, sizes = split
    torch.set_default_dtype(torch.float32)
    reference = TwoBlocks().cuda()
    model = convert_sync_batchnorm(copy.deepcopy(reference))
    x, y = torch.randn(sum(sizes), 2, 5, 4, device="cuda:0"), torch.randn(sum(sizes), 2, device="cuda:0")
    with torch.autocast("cuda", dtype=dtype):
        expected = reference(x)
        outputs = DataParallelModel(model, devices, execution_mode="threads")(x)
        got = torch.cat([o.to("cuda:0") for o in outputs])
        assert got.dtype == expected.dtype
        nn.functional.mse_loss(expected.float(), y).backward()
        nn.functional.mse_loss(got.float(), y).backward()
    torch.testing.assert_close(got.float(), expected.float(), rtol=3e-2, atol=3e-2)
    # A conv bias that feeds a training-mode BatchNorm has a zero gradient in exact arithmetic: in half precision
    # both runs hold rounding noise there, which is measured against the model's gradient scale, not its own norm.
    scale = max(p.grad.norm() for p in reference.parameters())
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert (a.grad - b.grad).norm() <= 5e-2 * b.grad.norm() + 1e-2 * scale, name
    torch.testing.assert_close(model.bn1.running_var, reference.bn1.running_var, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("mode", ["auto", "sequential"])
def test_threads_chosen_for_sync_batchnorm_are_said_once_and_only_where_the_user_chose_another_mode(mode):
    """``auto`` picks threads for SyncBatchNorm without a word; an explicit ``sequential`` is overridden with one
    warning, not one per call."""
    model = convert_sync_batchnorm(TwoBlocks().train())
    parallel = DataParallelModel(model, ["cpu"] * 2, execution_mode=mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            torch.cat(parallel(torch.randn(6, 2, 5, 4))).sum().backward()
    assert [str(w.message) for w in caught if "overridden" in str(w.message)] == (
        []
        if mode == "auto"
        else [f"DataParallelModel: execution_mode='sequential' overridden: {SYNC_BATCHNORM_THREADS}."]
    )
