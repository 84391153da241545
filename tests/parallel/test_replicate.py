"""Replica semantics: shared parameters, BatchNorm buffers, tied weights, and the one-device plain call."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lightning_mgpu.parallel.modules as modules_module
from lightning_mgpu.parallel import DataParallelCriterion, DataParallelModel, replicate

MODES = ("threads", "sequential")


def bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2)).double()


def test_replicas_alias_parameters_and_replica_zero_shares_buffers():
    model = bn_net()
    replicas = replicate(model, ["cpu"] * 3)
    assert len(replicas) == 3 and all(r is not model for r in replicas)
    for index, replica in enumerate(replicas):
        for p, q in zip(model.parameters(), replica.parameters(), strict=True):
            # Same device: the original storage (no copy), linked to the original by one autograd node.
            assert q is not p and q.data_ptr() == p.data_ptr() and q.grad_fn is not None
            (q.sum() * (index + 1)).backward()
    for p in model.parameters():
        assert torch.equal(p.grad, torch.full_like(p, 6.0))  # 1 + 2 + 3: every replica's gradient reached p
    bn = model[1]
    assert replicas[0][1].running_mean is bn.running_mean
    assert replicas[0][1].num_batches_tracked is bn.num_batches_tracked
    for replica in replicas[1:]:
        assert replica[1].running_mean is not bn.running_mean
        assert replica[1].running_mean.data_ptr() != bn.running_mean.data_ptr()
        assert torch.equal(replica[1].running_mean, bn.running_mean)
    detached = replicate(model, ["cpu"] * 2, detach=True)
    assert all(not p.requires_grad for r in detached for p in r.parameters())
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("mode", MODES)
def test_batchnorm_running_stats_come_from_chunk_zero(mode):
    model = bn_net()
    chunk0_only = copy.deepcopy(model)
    x = torch.randn(10, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    outputs = DataParallelModel(model, ["cpu"] * 4, execution_mode=mode)(x)
    assert [o.shape[0] for o in outputs] == [3, 3, 2, 2]
    chunk0_only(x[:3])  # what BN sees on replica 0
    bn, ref = model[1], chunk0_only[1]
    assert torch.allclose(bn.running_mean, ref.running_mean, atol=1e-12, rtol=0)
    assert torch.allclose(bn.running_var, ref.running_var, atol=1e-12, rtol=0)
    assert bn.num_batches_tracked.item() == 1  # incremented once, not once per replica
    full_batch = copy.deepcopy(bn_net())
    full_batch(x)
    assert not torch.allclose(bn.running_mean, full_batch[1].running_mean)


def test_batchnorm_eval_mode_gradients_match():
    """With fixed statistics (eval), BatchNorm is per-sample and gradients equal the single-device ones."""
    reference, model = bn_net(), bn_net()
    for m in (reference, model):
        m[1].running_mean.uniform_(-1, 1, generator=torch.Generator().manual_seed(3))
        m.eval()
    x = torch.randn(9, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 2, (9,), generator=torch.Generator().manual_seed(1))
    nn.CrossEntropyLoss()(reference(x), y).backward()
    DataParallelCriterion(nn.CrossEntropyLoss(), ["cpu"] * 3)(DataParallelModel(model, ["cpu"] * 3)(x), y).backward()
    for p, q in zip(reference.parameters(), model.parameters(), strict=True):
        assert (p.grad - q.grad).abs().max().item() < 1e-10


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(13, 6)
        self.mix = nn.Linear(6, 6)
        self.head = nn.Linear(6, 13, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.shared_block = nn.Linear(6, 6)
        self.again = self.shared_block  # one submodule reachable under two names
        self.double()

    def forward(self, tokens):
        h = torch.tanh(self.mix(self.emb(tokens)))
        return self.head(self.again(self.shared_block(h))).permute(0, 2, 1)


@pytest.mark.parametrize("mode", MODES)
def test_tied_weights_stay_tied(mode):
    reference, model = TiedLM(), TiedLM()
    for replica in replicate(model, ["cpu"] * 3):
        assert replica.head.weight is replica.emb.weight
        assert replica.again is replica.shared_block
    tokens = torch.randint(0, 13, (7, 4), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 13, (7, 4), generator=torch.Generator().manual_seed(1))
    ref_loss = nn.CrossEntropyLoss()(reference(tokens), targets)
    ref_loss.backward()
    loss = DataParallelCriterion(nn.CrossEntropyLoss(), ["cpu"] * 3, execution_mode=mode)(
        DataParallelModel(model, ["cpu"] * 3, execution_mode=mode)(tokens), targets
    )
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-10
    assert model.head.weight is model.emb.weight
    for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert (p.grad - q.grad).abs().max().item() < 1e-10, name


def _accumulate_grad_variables(grad_fn) -> set[int]:
    """ids of the leaf tensors an autograd graph accumulates into."""
    seen, stack, leaves = set(), [grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):
            leaves.add(id(fn.variable))
        stack.extend(f for f, _ in fn.next_functions)
    return leaves


def test_one_device_is_a_plain_call(monkeypatch):
    def no_replicas(*args, **kwargs):
        raise AssertionError("one device must not replicate")

    monkeypatch.setattr(modules_module, "ReplicaSet", no_replicas)
    monkeypatch.setattr(modules_module, "run_replicas", no_replicas)
    model = bn_net()
    seen = []
    model.register_forward_hook(lambda module, args, out: seen.append((module, args[0])))
    x = torch.randn(5, 4, dtype=torch.float64)
    y = torch.randint(0, 2, (5,))
    dp_model = DataParallelModel(model, ["cpu"])
    outputs = dp_model(x)
    assert dp_model.last_split_sizes == (5,)
    assert len(outputs) == 1
    assert seen[0][0] is model and seen[0][1] is x  # the module itself, on the very input tensor
    assert type(outputs[0].grad_fn).__name__ == "AddmmBackward0"
    assert _accumulate_grad_variables(outputs[0].grad_fn) == {id(p) for p in model.parameters()}

    criterion = nn.CrossEntropyLoss()
    loss = DataParallelCriterion(criterion, ["cpu"])(outputs, y)
    assert type(loss.grad_fn).__name__ == "NllLossBackward0"  # the criterion's own result, not a reduction
    assert torch.equal(loss, criterion(outputs[0], y))
    assert model[1].num_batches_tracked.item() == 1


def test_batch_of_one_sample_on_many_devices_is_a_plain_call(monkeypatch):
    monkeypatch.setattr(modules_module, "ReplicaSet", lambda *a, **k: pytest.fail("no replica needed"))
    model = nn.Linear(3, 2)
    seen = []
    model.register_forward_hook(lambda module, args, out: seen.append(module))
    dp_model = DataParallelModel(model, ["cpu"] * 4)
    outputs = dp_model(torch.randn(1, 3))
    assert dp_model.last_split_sizes == (1,) and len(outputs) == 1 and seen == [model]
    loss = DataParallelCriterion(nn.MSELoss(), ["cpu"] * 4)(outputs, torch.zeros(1, 2))
    assert loss.shape == ()


def test_inputs_moved_to_the_one_device_only_when_needed():
    model = nn.Linear(3, 2)
    seen = []
    model.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    x = torch.randn(4, 3)
    DataParallelModel(model, ["cpu:0"])(x)  # "cpu:0" is the same device as "cpu"
    assert seen[-1] is x


def test_one_device_moves_inputs_and_targets_that_are_elsewhere():
    """CPU inputs for a module on another device (here "meta") are moved, as the multi-device scatter would."""
    model = nn.Linear(3, 2, device="meta")
    outputs = DataParallelModel(model, ["meta"])({"x": torch.randn(4, 3)}["x"])
    assert outputs[0].device.type == "meta"
    loss = DataParallelCriterion(nn.MSELoss(), ["meta"])(outputs, torch.zeros(4, 2))
    assert loss.device.type == "meta"


def test_rnn_and_parametrized_modules():
    """An LSTM's cached weight list points at each replica's own tensors; parametrizations replicate too."""
    from torch.nn.utils import parametrizations

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lstm = nn.LSTM(4, 6, batch_first=True)
            self.head = parametrizations.weight_norm(nn.Linear(6, 3))

        def forward(self, x):
            return self.head(self.lstm(x)[0][:, -1])

    reference, model = Net().double(), Net().double()
    x = torch.randn(7, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 3, (7,), generator=torch.Generator().manual_seed(1))
    nn.CrossEntropyLoss()(reference(x), y).backward()
    DataParallelCriterion(nn.CrossEntropyLoss(), ["cpu"] * 3)(
        DataParallelModel(model, ["cpu"] * 3, execution_mode="threads")(x), y
    ).backward()
    for p, q in zip(reference.parameters(), model.parameters(), strict=True):
        assert (p.grad - q.grad).abs().max().item() < 1e-10
    for replica in replicate(model, ["cpu"] * 2, detach=True):
        lstm = replica.lstm
        assert all(w is getattr(lstm, n) for w, n in zip(lstm._flat_weights, lstm._flat_weights_names, strict=True))
        assert not any(w.requires_grad for w in lstm._flat_weights)
    original = model.lstm
    assert all(
        w is getattr(original, n) for w, n in zip(original._flat_weights, original._flat_weights_names, strict=True)
    )


def test_gradients_with_respect_to_the_parameters_through_autograd_grad_need_linked_replicas():
    """What the README says: replicas with their own parameters (threads) sum their gradients onto ``.grad``, so
    ``autograd.grad`` w.r.t. the originals finds no path; ``replicate()`` per call links them, ``create_graph`` too."""
    import lightning_mgpu

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(10, 4, dtype=torch.float64), torch.randint(0, 3, (10,))
    params = list(net.parameters())
    reference = torch.autograd.grad(nn.functional.cross_entropy(net(x), y), params, create_graph=True)
    devices = [torch.device("cpu")] * 3
    replicas = lightning_mgpu.replicate(net, devices)
    chunks = lightning_mgpu.scatter(x, devices)
    outputs = lightning_mgpu.run_replicas(
        [lambda r=r, c=c: r(c) for r, c in zip(replicas, chunks, strict=True)], devices, "threads"
    )
    grads = torch.autograd.grad(nn.functional.cross_entropy(torch.cat(outputs), y), params, create_graph=True)
    for got, expected in zip(grads, reference, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
        assert got.requires_grad  # differentiable again (GradNorm, gradient penalties on the parameters)
    model = DataParallelModel(net, devices, execution_mode="threads")
    criterion = DataParallelCriterion(nn.CrossEntropyLoss(), devices)
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        torch.autograd.grad(criterion(model(x), y), params)
