"""Lasting replicas whose parameters, gradients and buffers live in flat buffers (threads mode, other devices).

Units pin each invariant of the per-step sync (:class:`lightning_mgpu.parallel.replicas.ReplicaParameters`); the
module-level tests check equality with one device in every case the flat layout must handle. ``cpu:0`` is a device
distinct from ``cpu`` for these classes (tensors land on the same memory), which exercises the copy-to-other-devices
path without a GPU.
"""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_mgpu.parallel import DataParallelCriterion, DataParallelModel, ReplicaSet
from lightning_mgpu.parallel import replicas as replicas_module
from lightning_mgpu.parallel.replicas import DtypeGroups, ReplicaParameters

CPU = torch.device("cpu")
OTHER = torch.device("cpu", 0)  # compares unequal to CPU: the "other device" path
CPU3 = ["cpu"] * 3


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def batch(n: int = 12, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, dtype=torch.float64, generator=g), torch.randint(0, 3, (n,), generator=g)


def train(model: nn.Module, devices: list[str] | None, steps: int = 3, accumulate: int = 1, **options) -> nn.Module:
    """SGD with momentum (zero_grad(set_to_none=True), as Lightning does) on one device or under the wrappers."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    if devices is None:
        net, criterion = model, nn.CrossEntropyLoss()
    else:
        net = DataParallelModel(model, devices, execution_mode="threads", **options)
        criterion = DataParallelCriterion(nn.CrossEntropyLoss(), devices, execution_mode="threads")
    for step in range(steps):
        for micro in range(accumulate):
            x, y = batch(seed=10 * step + micro)
            (criterion(net(x), y) / accumulate).backward()
        opt.step()
        opt.zero_grad()
    return model


def assert_same_parameters(a: nn.Module, b: nn.Module, tol: float = 1e-10) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=tol, msg=name)


# --- units: ReplicaParameters ---------------------------------------------------------------------------------------
def test_the_first_replica_aliases_the_originals_and_every_other_owns_a_copy_synced_once_per_change():
    params = [nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(4))]
    flat = ReplicaParameters(params, [CPU, CPU, OTHER], CPU)
    assert all(leaf.data_ptr() == p.data_ptr() for leaf, p in zip(flat.leaves[0], params, strict=True))
    ptrs = {flat.leaves[i][0].data_ptr() for i in range(3)}
    assert len(ptrs) == 3  # a copy per replica, on the root device too
    flat.sync(3)
    assert all(torch.equal(leaf, p) for leaf, p in zip(flat.leaves[2], params, strict=True))
    with torch.no_grad():
        params[1].add_(1.0)  # an optimizer step
    flat.sync(3)
    assert torch.equal(flat.leaves[1][1], params[1]) and torch.equal(flat.leaves[2][1], params[1])
    flat.sync(3)
    with torch.no_grad():
        flat.leaves[1][1].zero_()  # a replica's own change: its copy alone; the original keeps replica 0's
    assert not torch.equal(flat.leaves[1][1], params[1])
    flat.sync(3)  # and the next step starts from the original again
    assert torch.equal(flat.leaves[1][1], params[1])


def _backward(flat: ReplicaParameters, per_replica_scale: list[float], used: list[int] | None = None) -> None:
    for i, scale in enumerate(per_replica_scale):
        leaves = flat.leaves[i]
        chosen = range(len(leaves)) if used is None else used
        sum(leaves[j].sum() * scale for j in chosen).backward()


def _pass(flat: ReplicaParameters, scales: list[float], used: list[int] | None = None, reduce: bool = True) -> None:
    """One step's pass through ``len(scales)`` replicas: sync, backward, then the reduction unless accumulating."""
    flat.sync(len(scales))
    _backward(flat, scales, used)
    flat.backward_done()
    if reduce:
        flat.reduce()


@pytest.mark.parametrize("devices", [[CPU, CPU, CPU], [CPU, OTHER, OTHER]])
def test_reduce_adds_every_replica_and_zeroes_them(devices):
    params = [nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(3))]
    flat = ReplicaParameters(params, devices, CPU)
    flat.sync(3)
    _backward(flat, [1.0, 2.0, 4.0])
    flat.reduce()
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in params)
    _backward(flat, [1.0, 1.0, 1.0])  # accumulates onto the existing .grad, as autograd does
    flat.sync(3)
    flat.reduce()
    assert all(torch.equal(p.grad, torch.full_like(p, 10.0)) for p in params)
    for p in params:
        p.grad = None  # zero_grad(set_to_none=True)
    flat.sync(3)
    _backward(flat, [1.0, 0.0, 0.0])
    flat.reduce()
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in params)  # the replicas' buffers were zeroed


def test_grads_set_to_none_for_some_parameters_or_replaced_by_the_user_are_reduced_one_by_one():
    params = [nn.Parameter(torch.zeros(2)) for _ in range(4)]
    flat = ReplicaParameters(params, [CPU, CPU], CPU)

    def step(scales: list[float]) -> list[list[float]]:
        flat.sync(2)
        _backward(flat, scales)
        flat.backward_done()  # every replica reached every parameter: the whole-buffer paths
        flat.reduce()
        return [p.grad.tolist() for p in params]

    assert step([1.0, 1.0]) == [[2.0, 2.0]] * 4  # every .grad is now a view of the flat gradient buffer
    params[0].grad = None  # a partial zero_grad: the leading parameter is pointed at its view again, the rest not
    params[2].grad = None
    params[3].grad = torch.full((2,), 5.0)  # set by the user: added to, not replaced
    assert step([1.0, 1.0]) == [[2.0, 2.0], [4.0, 4.0], [2.0, 2.0], [7.0, 7.0]]
    for p in params[1:]:
        p.grad = None  # the first parameter keeps its view
    assert step([1.0, 2.0]) == [[5.0, 5.0]] + [[3.0, 3.0]] * 3
    for p in params:
        p.grad = None  # zero_grad(set_to_none=True)
    assert step([1.0, 0.0]) == [[1.0, 1.0]] * 4
    assert all(p.grad.data_ptr() == view.data_ptr() for p, view in zip(params, flat._root_views, strict=True))


def test_a_parameter_no_replica_reached_keeps_grad_none_and_one_reached_by_one_replica_gets_it():
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))]
    flat = ReplicaParameters(params, [CPU, CPU], CPU)
    flat.sync(2)
    flat.leaves[0][0].sum().backward()
    flat.leaves[1][1].sum().backward()  # only replica 1 uses parameter 1 (data-dependent branches, experts)
    flat.reduce()
    assert torch.equal(params[0].grad, torch.ones(2)) and torch.equal(params[1].grad, torch.ones(2))
    assert params[2].grad is None  # as on one device: weight decay and momentum skip it


def test_a_parameter_reached_with_an_exactly_zero_gradient_gets_zeros_not_none():
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))]
    flat = ReplicaParameters(params, [CPU, CPU], CPU)
    flat.sync(2)
    (flat.leaves[0][0].sum() + flat.leaves[0][1].sum() * 0).backward()  # parameter 1 reached, its gradient 0
    flat.leaves[1][0].sum().backward()
    flat.reduce()
    assert torch.equal(params[0].grad, torch.full((2,), 2.0)) and torch.equal(params[1].grad, torch.zeros(2))
    assert params[2].grad is None


def test_one_counter_per_device_and_parameter_counts_every_replica_on_that_device():
    """Replicas sharing a device share one gradient version counter per parameter: a parameter no replica reached keeps
    ``None``, however many accumulations the others made (a layer reused under reentrant checkpointing accumulates
    several times in one backward pass)."""
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))]
    flat = ReplicaParameters(params, [CPU, CPU, OTHER, OTHER], CPU)
    flat.sync(4)
    for i, times in enumerate([2, 1, 2, 1]):  # per device, as many accumulations as 2 replicas reaching all 3 make
        for _ in range(times):  # nested backward passes inside one counted pass; nobody reaches parameter 2
            (flat.leaves[i][0].sum() + flat.leaves[i][1].sum()).backward()
    flat.backward_done()
    flat.reduce()
    assert torch.equal(params[0].grad, torch.full((2,), 6.0)) and torch.equal(params[1].grad, torch.full((2,), 6.0))
    assert params[2].grad is None


def test_a_second_backward_through_a_retained_graph_reaches_the_originals_at_once():
    params = [nn.Parameter(torch.ones(2))]
    flat = ReplicaParameters(params, [CPU, OTHER], CPU)
    flat.sync(2)
    loss = sum(leaves[0].pow(2).sum() for leaves in flat.leaves)
    loss.backward(retain_graph=True)
    flat.backward_done()
    flat.reduce()
    loss.backward()
    flat.backward_done()
    flat.reduce()
    assert torch.equal(params[0].grad, torch.full((2,), 8.0))  # 2 replicas x 2 passes x d(x^2)/dx at 1


def test_a_graph_of_more_replicas_than_the_last_step_used_reduces_them_all():
    """A backward pass through an older graph (3 replicas) after a reduction and a step with fewer replicas (2)."""
    params = [nn.Parameter(torch.ones(2))]
    flat = ReplicaParameters(params, [CPU, CPU, OTHER], CPU)
    flat.sync(3)
    older = sum(leaves[0].sum() for leaves in flat.leaves)
    flat.reduce()
    flat.sync(2)
    (older + sum(leaves[0].sum() for leaves in flat.leaves[:2])).backward()
    flat.backward_done()
    flat.reduce()
    assert torch.equal(params[0].grad, torch.full((2,), 5.0))
    assert all(float(flat.leaves[i][0].grad.abs().sum()) == 0 for i in range(3))  # nothing left for the next step


def test_gradients_kept_across_zero_grad_keep_their_values_and_others_reuse_the_buffer():
    """``.grad`` are views of one flat buffer reused from step to step; one that something still holds after
    ``zero_grad(set_to_none=True)`` (PCGrad keeps each task's gradients) is not written again: new tensors instead."""
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))]
    flat = ReplicaParameters(params, [CPU, CPU], CPU)
    buffers, kept = [], []
    for step, scale in enumerate((1.0, 2.0, 3.0)):  # .grad kept after the second step only
        _pass(flat, [scale, scale])
        buffers.append(flat._root_grads)
        if step == 1:
            kept = [p.grad for p in params]
        for p in params:
            p.grad = None if step < 2 else p.grad
    assert buffers[1] is buffers[0] and buffers[2] is not buffers[1]
    assert torch.equal(kept[0], torch.full((2,), 4.0)) and torch.equal(params[0].grad, torch.full((2,), 6.0))


@pytest.mark.parametrize(
    "keep", [Tensor.detach, lambda g: g.view(-1), lambda g: g.data], ids=["detach", "view", ".data"]
)
def test_other_tensors_on_a_dropped_gradients_storage_keep_their_values(keep):
    """A ``.detach()`` (or view) of a ``.grad`` kept after ``zero_grad(set_to_none=True)`` holds the root buffer's
    storage through another tensor: as on one device, the next step's gradients go to new tensors, not into it."""
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))]
    flat = ReplicaParameters(params, [CPU, CPU], CPU)
    _pass(flat, [1.0, 1.0])
    kept = keep(params[0].grad)
    for p in params:
        p.grad = None
    _pass(flat, [2.0, 2.0])
    assert torch.equal(kept, torch.full((2,), 2.0)) and torch.equal(params[0].grad, torch.full((2,), 4.0))
    del kept
    for p in params:
        p.grad = None
    before = flat._root_grads
    _pass(flat, [1.0, 1.0])
    assert flat._root_grads is before  # nothing else holds it now: reused


def test_swapping_the_frozen_parameters_between_backward_passes_keeps_the_earlier_gradients():
    """``toggle_optimizer`` in a GAN: parameter 0 trains in the first pass, parameter 1 in the second; the first keeps
    its gradient (its ``.grad`` is its part of the root's buffer, which the second pass must not overwrite)."""
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))]
    params[1].requires_grad_(False)
    flat = ReplicaParameters(params, [CPU, CPU], CPU)
    _pass(flat, [1.0, 2.0], used=[0])
    params[0].requires_grad_(False)
    params[1].requires_grad_(True)
    _pass(flat, [1.0, 1.0], used=[1])
    assert torch.equal(params[0].grad, torch.full((2,), 3.0)) and torch.equal(params[1].grad, torch.full((2,), 2.0))


def test_requires_grad_flipped_between_accumulated_micro_batches_keeps_their_gradients():
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))]
    flat = ReplicaParameters(params, [CPU, CPU], CPU)
    _pass(flat, [1.0, 2.0], reduce=False)  # micro-batch 1, not reduced yet (accumulating)
    params[1].requires_grad_(False)
    _pass(flat, [1.0, 1.0], used=[0])
    assert torch.equal(params[0].grad, torch.full((2,), 5.0)) and torch.equal(params[1].grad, torch.full((2,), 3.0))


def test_only_the_first_replicas_leaves_share_the_originals_version_counters():
    """A write in a step to replica 0's leaf is the original's (it stands for the root module); other replicas' leaves,
    on the root device too, are their own."""
    params = [nn.Parameter(torch.zeros(2))]
    flat = ReplicaParameters(params, [CPU, CPU, OTHER], CPU)
    before = params[0]._version
    with torch.no_grad():
        flat.leaves[0][0].add_(1.0)
    assert params[0]._version == before + 1 and torch.equal(params[0], torch.ones(2))
    with torch.no_grad():
        flat.leaves[1][0].add_(1.0)
        flat.leaves[2][0].add_(1.0)
    assert params[0]._version == before + 1 and torch.equal(params[0], torch.ones(2))


def test_renormalised_embeddings_keep_their_own_counters_in_threads_on_one_device():
    """Embedding(max_norm=...) renormalises rows in place in every forward; a tied output layer in another replica
    saved the weight for backward, and must not fail on that replica's renormalisation (the set-up warning names the
    layer: results can differ from one device's)."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(20, 4, max_norm=1.0)
            self.out = nn.Linear(4, 20, bias=False)
            self.out.weight = self.embedding.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.out(self.embedding(ids).mean(1))

    torch.manual_seed(0)
    ids, y = torch.randint(0, 20, (8, 5)), torch.randint(0, 20, (8,))
    with pytest.warns(UserWarning, match="max_norm"):
        model = DataParallelModel(Tied(), CPU3, execution_mode="threads")
    criterion = DataParallelCriterion(nn.CrossEntropyLoss(), CPU3, execution_mode="threads")
    for _ in range(3):
        criterion(model(ids), y).backward()
    assert model.module.embedding.weight.grad is not None


def test_frozen_then_unfrozen_parameters_follow_the_originals():
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))]
    flat = ReplicaParameters(params, [CPU, OTHER], CPU)
    params[1].requires_grad_(False)
    flat.sync(2)
    assert not flat.leaves[1][1].requires_grad and flat.leaves[1][0].requires_grad
    _backward(flat, [1.0, 1.0], used=[0])
    flat.reduce()
    assert params[1].grad is None and torch.equal(params[0].grad, torch.full((2,), 2.0))
    params[1].requires_grad_(True)
    flat.sync(2)
    assert all(leaves[1].requires_grad for leaves in flat.leaves)
    _backward(flat, [1.0, 1.0])
    flat.reduce()
    assert torch.equal(params[1].grad, torch.full((2,), 2.0))


def test_mixed_dtypes_get_one_flat_buffer_each():
    params = [nn.Parameter(torch.zeros(2, dtype=torch.float64)), nn.Parameter(torch.zeros(3, dtype=torch.float32))]
    flat = ReplicaParameters(params, [CPU, OTHER], CPU)
    flat.sync(2)
    assert [leaf.dtype for leaf in flat.leaves[1]] == [torch.float64, torch.float32]
    _backward(flat, [1.0, 2.0])
    flat.reduce()
    assert params[0].grad.dtype == torch.float64 and torch.equal(params[1].grad, torch.full((3,), 3.0))


def test_replaced_parameter_tensors_make_the_leaves_stale():
    params = [nn.Parameter(torch.zeros(2))]
    flat = ReplicaParameters(params, [CPU, CPU], CPU)
    assert flat.sync(2)
    params[0].data = torch.ones(2)  # an optimizer (or .to(), .double()) that swaps the tensor
    assert not flat.sync(2)


# --- units: ReplicaSet's structure check ------------------------------------------------------------------------
def test_prepare_checks_the_structure_unless_execution_mode_just_did():
    model = mlp()
    replicas = ReplicaSet(model, CPU3)
    replicas.execution_mode("threads", 3)
    replicas.prepare(3)
    model[0] = nn.Linear(4, 8).double()
    replicas.prepare(3)  # no execution_mode() before it: prepare() looks itself
    assert replicas.builds == 2
    model[1] = nn.ReLU()
    replicas.execution_mode("threads", 3)  # looks, and rebuilds ...
    assert replicas.builds == 3
    replicas.prepare(3)  # ... so the prepare() right after it need not look again
    assert replicas.builds == 3 and all(isinstance(replica[1], nn.ReLU) for replica in replicas.replicas)


# --- units: buffers -------------------------------------------------------------------------------------------------
def _buffers(n: int = 3) -> tuple[list[torch.Tensor], ReplicaParameters]:
    sources = [torch.zeros(3), torch.zeros((), dtype=torch.long)]
    return sources, ReplicaParameters([], [CPU] * n, CPU, buffers=sources)


def test_replicas_see_the_roots_buffers_after_every_step():
    sources, flat = _buffers()
    assert flat.leaves[0] == sources  # replica 0 holds the originals
    for step in range(3):
        flat.sync(3)
        for mean, count in flat.leaves[1:]:
            assert torch.equal(mean, sources[0]) and torch.equal(count, sources[1]), step
            mean.add_(100.0)  # replica >= 1 updates its own running statistics in its forward
            count.add_(1)
        sources[0].add_(1.0)  # replica 0 (the original) updates the root's
        sources[1].add_(1)


def test_a_replica_whose_copy_changed_is_refreshed_even_when_the_root_did_not_change():
    sources, flat = _buffers()
    flat.sync(3)
    flat.leaves[2][0].fill_(5.0)
    flat.sync(3)
    assert torch.equal(flat.leaves[2][0], sources[0])


def test_replica_buffers_are_parts_of_one_flat_buffer_per_replica_and_dtype():
    _, flat = _buffers()
    means = [leaves[0] for leaves in flat.leaves[1:]]
    assert means[0].data_ptr() != means[1].data_ptr()
    for i, mean in enumerate(means, 1):
        assert mean.untyped_storage().data_ptr() == flat._storage[i][1][torch.float32].data_ptr()


def test_buffers_requiring_grad_reach_replicas_through_autograd_and_back_to_plain_copies():
    module = nn.Module()
    module.register_buffer("mean", torch.zeros(3, requires_grad=True))
    replica_set = ReplicaSet(module, CPU3)
    replicas = replica_set.prepare(3)
    assert replicas[0].mean is module.mean and replicas[1].mean.grad_fn is not None
    (replicas[1].mean.sum() * 2 + replicas[2].mean.sum()).backward()
    assert torch.equal(module.mean.grad, torch.full((3,), 3.0))
    replica_set.watch([])
    with torch.no_grad():
        replicas = replica_set.prepare(3)
    assert replicas[1].mean.grad_fn is None
    replica_set.watch([])


# --- DataParallelModel / DataParallelCriterion, threads mode ---------------------------------------------------------
def test_threads_mode_equals_one_device_and_is_bitwise_reproducible():
    reference = train(mlp(), None)
    first = train(mlp(), CPU3)
    assert_same_parameters(first, reference)
    second = train(mlp(), CPU3)
    for p, q in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(p, q)


def test_the_originals_gradient_hooks_run_once_per_backward_on_the_summed_gradient():
    calls = {"clamp": 0, "post": 0}

    def with_hooks(model: nn.Module) -> nn.Module:
        def clamp(grad: torch.Tensor) -> torch.Tensor:  # not linear: a hook on each replica's share would differ
            calls["clamp"] += 1
            return grad.clamp(-0.01, 0.01)

        def post(param: torch.Tensor) -> None:
            calls["post"] += 1

        model[0].weight.register_hook(clamp)
        model[2].bias.register_post_accumulate_grad_hook(post)
        return model

    expected = train(with_hooks(mlp()), None)
    assert calls == {"clamp": 3, "post": 3}
    got = train(with_hooks(mlp()), CPU3)
    assert calls == {"clamp": 6, "post": 6}
    assert_same_parameters(got, expected)


def test_gradient_accumulation_equals_one_device():
    assert_same_parameters(train(mlp(), CPU3, accumulate=3), train(mlp(), None, accumulate=3))


def test_deferred_reduction_reduces_once_for_all_accumulated_backward_passes():
    model = mlp()
    net = DataParallelModel(model, CPU3, execution_mode="threads")
    replica_set = net._replicas.of(model, net.device_ids)
    replica_set.defer_reduction = True
    for seed in range(3):
        x, _ = batch(seed=seed)
        sum(o.sum() for o in net(x)).backward()
    assert all(p.grad is None for p in model.parameters())
    replica_set.reduce_gradients()
    reference = mlp()
    for seed in range(3):
        reference(batch(seed=seed)[0]).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-10)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x)))).mean(1)[:, :3]


@pytest.mark.parametrize("devices", [CPU3, [CPU, OTHER]])
def test_two_backward_passes_through_a_retained_graph_equal_one_device(devices, monkeypatch):
    monkeypatch.setattr(replicas_module, "to_device", lambda d: d if isinstance(d, torch.device) else torch.device(d))
    grads = []
    for parallel in (False, True):
        model = mlp()
        net = DataParallelModel(model, devices, execution_mode="threads") if parallel else model
        criterion = DataParallelCriterion(nn.CrossEntropyLoss(), devices) if parallel else nn.CrossEntropyLoss()
        for step in range(2):
            x, y = batch(seed=step)
            loss = criterion(net(x), y)
            loss.backward(retain_graph=True)
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            model.zero_grad()
    for ours, reference in zip(grads[2:], grads[:2], strict=True):
        for a, b in zip(ours, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


class GaussianPolicy(nn.Module):
    """Returns a ``torch.distributions.Normal`` (an RL policy head), or, with ``scale_out``, its mean and its log-std
    parameter as it is (as CLIP returns its logit scale)."""

    def __init__(self, scale_out: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale_out = scale_out
        self.mean = nn.Linear(4, 2).double()
        self.log_std = nn.Parameter(torch.zeros(2, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> Any:
        if self.scale_out:
            return self.mean(x), self.log_std
        return torch.distributions.Normal(self.mean(x), self.log_std.exp())


def nll(dist: torch.distributions.Normal, target: torch.Tensor) -> torch.Tensor:
    return -dist.log_prob(target).mean()


def scaled(mean: torch.Tensor, log_std: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nll(torch.distributions.Normal(mean, log_std.exp()), target)


@pytest.mark.parametrize("scale_out", [False, True])
def test_outputs_holding_tensors_in_attributes_or_parameters_reach_the_gradients(scale_out):
    """Tensors inside other objects (a distribution) are found; a parameter returned as it is gets one hook, not one
    per step."""
    reference, model = GaussianPolicy(scale_out), GaussianPolicy(scale_out)
    loss = scaled if scale_out else nll
    net = DataParallelModel(model, CPU3, execution_mode="threads")
    criterion = DataParallelCriterion(loss, CPU3, weight_fn=lambda output, targets: len(targets[0]))
    for step in range(4):
        x, y = batch(seed=step)
        target = y.double().unsqueeze(1).expand(-1, 2)
        out = reference(x)
        (loss(*out, target) if scale_out else loss(out, target)).backward()
        criterion(net(x), target).backward()
        for a, b in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)
            a.grad = b.grad = None
    replica_set = net._replicas.values()[0]
    j = next(k for k, p in enumerate(replica_set._params) if p is model.log_std)
    hooks = [len(replica[j]._backward_hooks or {}) for replica in replica_set._flat.leaves]
    assert hooks == ([1, 1, 1] if scale_out else [0, 0, 0])


def test_tied_weights_equal_one_device():
    def make() -> nn.Module:
        torch.manual_seed(0)
        return Tied().double()

    def run(devices: list[str] | None) -> nn.Module:
        model = make()
        net = model if devices is None else DataParallelModel(model, devices, execution_mode="threads")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randint(0, 5, (6, 2), generator=torch.Generator().manual_seed(step))
            out = net(x)
            loss = (out**2).sum() if devices is None else sum((o**2).sum() for o in out)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return model

    tied = run(CPU3)
    assert tied.head.weight is tied.emb.weight
    assert_same_parameters(tied, run(None))


def test_frozen_then_unfrozen_layer_equals_one_device():
    def run(devices: list[str] | None) -> nn.Module:
        model = mlp()
        model[0].weight.requires_grad_(False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        net = model if devices is None else DataParallelModel(model, devices, execution_mode="threads")
        for step in range(4):
            if step == 2:
                model[0].weight.requires_grad_(True)
            x, y = batch(seed=step)
            out = net(x)
            loss = (
                nn.functional.cross_entropy(out, y)
                if devices is None
                else DataParallelCriterion(nn.CrossEntropyLoss(), devices)(out, y)
            )
            loss.backward()
            if step < 2:
                assert model[0].weight.grad is None
            opt.step()
            opt.zero_grad()
        return model

    assert_same_parameters(run(CPU3), run(None))


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4).double()
        self.b = nn.Linear(4, 3).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)).float()).double()


def test_mixed_dtypes_equal_one_device():
    def run(devices: list[str] | None) -> nn.Module:
        torch.manual_seed(0)
        model = Mixed()
        net = model if devices is None else DataParallelModel(model, devices, execution_mode="threads")
        x, _ = batch()
        out = net(x)
        ((out**2).sum() if devices is None else sum((o**2).sum() for o in out)).backward()
        return model

    a, b = run(CPU3), run(None)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["sequential", "threads"])
def test_sparse_gradients_are_summed_as_on_one_device(mode):
    """An ``Embedding(sparse=True)``: the replicas' sparse gradients summed onto the original's, twice (accumulated)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Linear(3, 2)).double()
    reference = copy.deepcopy(model)
    x = torch.tensor([[1], [2], [2], [7], [9], [1]])
    net = DataParallelModel(model, CPU3, execution_mode=mode)
    for _ in range(2):
        torch.cat(net(x)).pow(2).sum().backward()
        reference(x).pow(2).sum().backward()
    assert model[0].weight.grad.is_sparse
    torch.testing.assert_close(model[0].weight.grad.to_dense(), reference[0].weight.grad.to_dense(), rtol=0, atol=1e-12)
    torch.testing.assert_close(model[1].weight.grad, reference[1].weight.grad, rtol=0, atol=1e-12)


def test_buffers_requiring_grad_get_their_gradient_as_under_data_parallel():
    """torch's test_data_parallel_buffers_requiring_grad, on virtual devices in threads mode."""

    class TestModule(nn.Module):
        def __init__(self, t: torch.Tensor) -> None:
            super().__init__()
            self.register_buffer("t_rg", t)
            self.register_buffer("t_not_rg", t.clone().detach())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.t_rg + self.t_not_rg

    m = TestModule(torch.randn(100, dtype=torch.double, requires_grad=True))
    assert m.t_rg.requires_grad
    net = DataParallelModel(m, ["cpu"] * 2, execution_mode="threads")
    inp = torch.randn(2, 100, dtype=torch.double)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return net.gather(net(inp))

    assert torch.autograd.gradcheck(fn, (m.t_rg,))


def test_an_optimizer_that_replaces_parameter_tensors_is_followed():
    def run(devices: list[str] | None) -> nn.Module:
        model = mlp()
        net = model if devices is None else DataParallelModel(model, devices, execution_mode="threads")
        for step in range(3):
            x, _ = batch(seed=step)
            out = net(x)
            ((out**2).sum() if devices is None else sum((o**2).sum() for o in out)).backward()
            for p in model.parameters():  # out of place: new tensors every step
                p.data = p.data - 0.1 * p.grad
                p.grad = None
        return model

    assert_same_parameters(run(CPU3), run(None))


def test_state_dict_holds_no_flat_buffer_and_loads_back():
    model = train(mlp(), CPU3)
    assert set(model.state_dict()) == set(mlp().state_dict())
    fresh = mlp(seed=5)
    fresh.load_state_dict(model.state_dict())
    assert_same_parameters(fresh, model, tol=0)


def test_loading_a_state_dict_between_steps_reaches_the_replicas():
    model = mlp()
    net = DataParallelModel(model, ["cpu", OTHER, OTHER], execution_mode="threads")
    x, _ = batch()
    net(x)
    model.load_state_dict(mlp(seed=3).state_dict())
    outputs = net(x)
    torch.testing.assert_close(torch.cat(outputs), mlp(seed=3)(x), rtol=0, atol=1e-12)


def test_no_per_step_growth_in_objects():
    model = mlp()
    net = DataParallelModel(model, CPU3, execution_mode="threads")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    counts = []
    for step in range(60):
        x, _ = batch(seed=step)
        sum(o.sum() for o in net(x)).backward()
        opt.step()
        opt.zero_grad()
        if step in (10, 59):
            gc.collect()
            counts.append(len(gc.get_objects()))
    assert counts[1] - counts[0] < 50, counts


def test_compiled_replicas_on_other_devices_use_their_own_leaves():
    model = mlp()
    model.compile(backend="eager")
    reference = copy.deepcopy(mlp())
    replica_set = ReplicaSet(model, ["cpu", OTHER])
    x, _ = batch(4)
    outputs = [r(x[2 * i : 2 * i + 2]) for i, r in enumerate(replica_set.prepare(2, "sequential"))]
    replica_set.watch(outputs)
    sum(o.sum() for o in outputs).backward()
    reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-10)


class ScaledLoss(nn.Module):
    """A criterion with a learnable parameter: its replicas reduce their gradients like the model's."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
        self.reduction = "mean"

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.scale * nn.functional.cross_entropy(logits, target)


def test_a_criterion_with_parameters_reduces_its_gradients_in_threads_mode():
    x, y = batch()
    model, reference_model = mlp(), mlp()
    criterion, reference_criterion = ScaledLoss(), ScaledLoss()
    net = DataParallelModel(model, CPU3, execution_mode="threads")
    loss_fn = DataParallelCriterion(criterion, CPU3, execution_mode="threads")
    loss_fn(net(x), y).backward()
    reference_criterion(reference_model(x), y).backward()
    torch.testing.assert_close(criterion.scale.grad, reference_criterion.scale.grad, rtol=0, atol=1e-10)
    for p, q in zip(model.parameters(), reference_model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-10)


class Gated(nn.Module):
    """A residual branch behind a gate that starts at 0 (ReZero, LayerScale; LoRA's B = 0): the branch's parameters
    are reached with an exactly zero gradient at the first step; ``unused`` is never reached."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.f = nn.Linear(4, 4).double()
        self.gate = nn.Parameter(torch.zeros(1, dtype=torch.float64))
        self.unused = nn.Linear(4, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * self.f(x)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("mode", ["sequential", "threads"])
def test_a_parameter_reached_with_a_zero_gradient_steps_as_on_one_device(mode, optimizer):
    """One device gives it a zeros ``.grad``: momentum, weight decay and AdamW's step count apply to it."""

    def train_gated(devices: list[str] | None) -> tuple[nn.Module, list[tuple[bool, bool]]]:
        model = Gated()
        net = model if devices is None else DataParallelModel(model, devices, execution_mode=mode)
        opt: torch.optim.Optimizer = (
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
            if optimizer == "sgd"
            else torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
        )
        seen = []
        for step in range(4):
            x = batch(seed=step)[0]
            out = net(x)
            (torch.cat(out) if isinstance(out, list) else out).pow(2).mean().backward()
            seen.append((model.f.weight.grad is None, model.unused.weight.grad is None))
            opt.step()
            opt.zero_grad()
        return model, seen

    reference, reference_seen = train_gated(None)
    model, seen = train_gated(["cpu"] * 2)
    assert seen == reference_seen == [(False, True)] * 4
    assert_same_parameters(model, reference, tol=1e-12)


def test_flat_parts_keep_each_tensors_layout_and_flattening_reads_current_values():
    """A channels_last or transposed tensor's part of a flat buffer is laid out as the tensor is (its flat view is its
    memory, made once), so the part's view has its strides and values; one with gaps takes the contiguous layout; a
    replacement laid out otherwise is copied into its part's layout. Every flatten() reads the current values."""
    conv = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)
    transposed, gapped = torch.randn(3, 4).t(), torch.randn(4, 6)[:, ::2]
    bias, other = torch.randn(5), torch.randn(3, dtype=torch.float64)
    tensors = [conv, transposed, gapped, bias, other]
    groups = DtypeGroups(tensors)
    assert groups.strides[:3] == [conv.stride(), transposed.stride(), (3, 1)]
    for _ in range(2):
        flats = groups.flatten()
        for j, tensor in enumerate(tensors):
            part = groups.view(flats, j)
            assert part.stride() == groups.strides[j]
            torch.testing.assert_close(part, tensor, rtol=0, atol=0)
        for tensor in tensors:
            tensor.add_(1)  # an optimizer step, in place
    groups.replace(0, conv.contiguous())
    torch.testing.assert_close(groups.view(groups.flatten(), 0), conv, rtol=0, atol=0)


def test_gradients_of_replica_parameters_are_laid_out_as_the_parameters():
    """The root's ``.grad`` views and every replica leaf's ``.grad`` have the parameter's strides (a channels_last
    conv weight): autograd accumulates into them without the layout-contract warning or a copy."""
    params = [nn.Parameter(torch.randn(4, 3, 3, 3).to(memory_format=torch.channels_last)), nn.Parameter(torch.randn(3))]
    flat = ReplicaParameters(iter(params), [torch.device("cpu")] * 2, torch.device("cpu"))  # any iterable
    for p, view in zip(params, flat._root_views, strict=True):
        assert view.shape == p.shape and view.stride() == p.stride()
    for leaves in flat.leaves:
        assert [leaf.grad.stride() for leaf in leaves] == [p.stride() for p in params]


def test_mark_stale_copies_values_written_through_data_into_the_replicas():
    """A write through ``.data`` moves no version counter, so the sync cannot see it; after ``mark_stale`` the next
    ``prepare`` copies every buffer (and parameter copy) anyway."""
    module = nn.BatchNorm1d(2)
    replica_set = ReplicaSet(module, CPU3)
    replica_set.prepare(3, "sequential")
    module.running_mean.data.copy_(torch.tensor([5.0, 6.0]))
    replica_set.prepare(3, "sequential")
    assert torch.equal(replica_set.replicas[2].running_mean, torch.zeros(2))  # unseen: why mark_stale exists
    replica_set.mark_stale()
    replica_set.prepare(3, "sequential")
    assert all(torch.equal(r.running_mean, torch.tensor([5.0, 6.0])) for r in replica_set.replicas)


@pytest.mark.parametrize("mode", ["sequential", "threads"])
def test_a_gradient_penalty_through_the_replicas_equals_one_device(mode):
    """WGAN-GP's ``autograd.grad(critic(x).sum(), x, create_graph=True)``: it leaves ``.grad`` alone, so replicas that
    own their parameters reduce the penalty's gradient as any other."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    reference = copy.deepcopy(net)
    x = torch.randn(6, 4, dtype=torch.float64)

    def loss(out: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        (grad,) = torch.autograd.grad(out.sum(), inputs, create_graph=True)
        return out.mean() + ((grad.norm(dim=1) - 1) ** 2).mean()

    inputs = x.clone().requires_grad_(True)
    loss(reference(inputs), inputs).backward()
    inputs = x.clone().requires_grad_(True)
    loss(torch.cat(DataParallelModel(net, CPU3, execution_mode=mode)(inputs)), inputs).backward()
    for p, q in zip(net.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)
    with pytest.raises(RuntimeError, match=r"create_graph=True.*torch\.autograd\.grad.*lightning_mgpu\.replicate"):
        torch.cat(DataParallelModel(net, CPU3, execution_mode=mode)(x)).sum().backward(create_graph=True)
