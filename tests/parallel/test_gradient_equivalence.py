"""DataParallelModel + DataParallelCriterion on N virtual CPU devices give single-device full-batch gradients.

float64, no dropout or BatchNorm, so the only difference is the order of floating-point sums: 1e-10.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from torch import nn

from lightning_mgpu.parallel import DataParallelCriterion, DataParallelModel
from lightning_mgpu.parallel.scatter_gather import split_sizes

TOL = 1e-10
MODES = ("threads", "sequential")


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)).double()


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=2),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(6 * 3 * 3, 3),
    ).double()


MODELS = {"mlp": (mlp, (5,)), "cnn": (cnn, (2, 8, 8))}


def batch(shape: tuple[int, ...], size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, *shape, generator=g, dtype=torch.float64), torch.randint(0, 3, (size,), generator=g)


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def single_device(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    loss = nn.CrossEntropyLoss()(model(x), y)
    loss.backward()
    return loss.detach(), grads(model)


# (N, batch size, kind): divisible by N, not divisible, smaller than N (N=1 has no smaller batch).
CASES = [(n, b, kind) for n in (1, 2, 3, 4) for kind, b in (("divisible", 2 * n), ("indivisible", 2 * n + 1))]
CASES += [(n, n - 1, "smaller") for n in (2, 3, 4)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("n", "batch_size", "kind"), CASES, ids=[f"n{n}-b{b}-{k}" for n, b, k in CASES])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_gradients_equal_single_device(model_name, n, batch_size, kind, mode):
    make, shape = MODELS[model_name]
    reference = make()
    x, y = batch(shape, batch_size)
    ref_loss, ref_grads = single_device(reference, x, y)

    model = make()
    dp_model = DataParallelModel(model, ["cpu"] * n, execution_mode=mode)
    dp_criterion = DataParallelCriterion(nn.CrossEntropyLoss(), ["cpu"] * n, execution_mode=mode)
    outputs = dp_model(x)
    loss = dp_criterion(outputs, y)
    loss.backward()

    expected_sizes = split_sizes(batch_size, n)
    assert dp_model.last_split_sizes == tuple(expected_sizes)
    assert len(outputs) == len(expected_sizes) == min(n, batch_size)
    assert [o.shape[0] for o in outputs] == expected_sizes
    assert abs(loss.item() - ref_loss.item()) < TOL
    assert max_diff(grads(model), ref_grads) < TOL
    assert all(p.grad.dtype == torch.float64 for p in model.parameters())


@pytest.mark.parametrize("mode", MODES)
def test_parameters_equal_after_several_sgd_steps(mode):
    """Gradients accumulate into the originals, so an optimizer on the original parameters trains identically."""
    reference, model = cnn(), cnn()
    dp_model = DataParallelModel(model, ["cpu"] * 3, execution_mode=mode)
    dp_criterion = DataParallelCriterion(nn.CrossEntropyLoss(), ["cpu"] * 3, execution_mode=mode)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step, size in enumerate((10, 7, 2, 9)):
        x, y = batch((2, 8, 8), size, seed=step)
        opt_ref.zero_grad()
        nn.CrossEntropyLoss()(reference(x), y).backward()
        opt_ref.step()
        opt.zero_grad()
        dp_criterion(dp_model(x), y).backward()
        opt.step()
    for p_ref, p in zip(reference.parameters(), model.parameters(), strict=True):
        assert (p_ref - p).abs().max().item() < TOL


@pytest.mark.parametrize("mode", MODES)
def test_keyword_inputs_and_targets(mode):
    """Inputs and targets given as keywords are split the same way as positional ones."""

    class KwModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def forward(self, *, features: torch.Tensor, scale: float) -> torch.Tensor:
            return self.net(features) * scale

    reference, model = KwModel(), KwModel()
    x, y = batch((5,), 9)
    ref_loss = nn.CrossEntropyLoss()(reference(features=x, scale=0.5), y)
    ref_loss.backward()
    dp_model = DataParallelModel(model, ["cpu"] * 4, execution_mode=mode)
    loss = DataParallelCriterion(nn.CrossEntropyLoss(), ["cpu"] * 4, execution_mode=mode)(
        dp_model(features=x, scale=0.5), target=y
    )
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) < TOL
    assert max_diff(grads(model), grads(reference)) < TOL


def test_mean_squared_error_and_sum_reduction():
    """Element-wise losses are weighted by sample counts; reduction="sum" is a plain sum."""
    reference, model = mlp(), mlp()
    x = batch((5,), 10)[0]
    target = torch.randn(10, 3, dtype=torch.float64)
    for reduction in ("mean", "sum"):
        reference.zero_grad()
        model.zero_grad()
        ref_loss = nn.MSELoss(reduction=reduction)(reference(x), target)
        ref_loss.backward()
        loss = DataParallelCriterion(nn.MSELoss(reduction=reduction), ["cpu"] * 4)(
            DataParallelModel(model, ["cpu"] * 4)(x), target
        )
        loss.backward()
        assert abs(loss.item() - ref_loss.item()) < TOL * max(1.0, abs(ref_loss.item()))
        assert max_diff(grads(model), grads(reference)) < TOL


CLASS_WEIGHT = torch.tensor([0.3, 1.0, 2.5], dtype=torch.float64)
TORCH_LOSSES = {  # torch's own losses: what each device's mean divides by comes from its record or its call
    "ignored targets": (nn.CrossEntropyLoss(), {}),
    "class weights and label smoothing": (nn.CrossEntropyLoss(weight=CLASS_WEIGHT, label_smoothing=0.2), {}),
    "functional, weight as a keyword": (nn.functional.cross_entropy, {"weight": CLASS_WEIGHT, "ignore_index": 1}),
    "partial of a sum": (functools.partial(nn.functional.mse_loss, reduction="sum"), "one-hot"),
    "batchmean": (nn.KLDivLoss(reduction="batchmean"), "probabilities"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["training", "no_grad", "detached outputs"])
@pytest.mark.parametrize("loss", sorted(TORCH_LOSSES))
def test_torch_losses_equal_one_device_in_training_and_evaluation(loss, how, mode):
    """Uneven shards (10 over 3), a shard whose targets are all ignored: the whole batch's loss and gradients in
    training, its loss under ``torch.no_grad()`` (no autograd record: the loss calls say their counts) and on
    detached outputs."""
    criterion, kwargs = TORCH_LOSSES[loss]
    reference, model = mlp(), mlp()
    x, y = batch((5,), 10, seed=3)
    y[4:7] = -100  # the second shard (rows 4-6) counts nothing
    head, target = (lambda out: out), y
    if kwargs == "one-hot":
        target = nn.functional.one_hot(y.clamp(min=0), 3).double()
    if kwargs == "probabilities":
        head, target = (lambda out: out.log_softmax(1)), nn.functional.one_hot(y.clamp(min=0), 3).double() * 0.7 + 0.1
    kwargs = kwargs if isinstance(kwargs, dict) else {}
    if kwargs.get("ignore_index") == 1:
        target = y.where(y >= 0, 1)  # the padding value is this call's ignore_index
    dp_model = DataParallelModel(model, ["cpu"] * 3, execution_mode=mode)
    dp_criterion = DataParallelCriterion(criterion, ["cpu"] * 3, execution_mode=mode)
    with torch.set_grad_enabled(how != "no_grad"), warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's own losses are read: no "weighted by samples" warning
        ref_loss = criterion(head(reference(x)), target, **kwargs)
        outputs = [head(o) for o in dp_model(x)]
        loss_value = dp_criterion(
            [o.detach() for o in outputs] if how == "detached outputs" else outputs, target, **kwargs
        )
    assert abs(loss_value.item() - ref_loss.item()) < TOL * max(1.0, abs(ref_loss.item()))
    if how == "training":
        ref_loss.backward()
        loss_value.backward()
        assert all(torch.isfinite(g).all() for g in grads(model))
        assert max_diff(grads(model), grads(reference)) < TOL


def test_a_batch_whose_targets_are_all_ignored_gives_one_devices_nan():
    """torch's mean over no counted target is NaN; the devices' losses combine to the same, as on one device."""
    model, x = mlp(), batch((5,), 6)[0]
    y = torch.full((6,), -100)
    loss = DataParallelCriterion(nn.CrossEntropyLoss(), ["cpu"] * 3)(DataParallelModel(model, ["cpu"] * 3)(x), y)
    assert torch.isnan(loss) and torch.isnan(nn.CrossEntropyLoss()(model(x), y))


def test_model_without_copy_is_unchanged_by_wrapping():
    """Wrapping keeps the original module (no copy): its state dict is the user's, with a `module.` prefix."""
    model = mlp()
    before = copy.deepcopy(model.state_dict())
    dp_model = DataParallelModel(model, ["cpu"] * 2)
    assert dp_model.module is model
    assert set(dp_model.state_dict()) == {f"module.{k}" for k in before}
    dp_model(batch((5,), 4)[0])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
