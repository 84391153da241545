"""The loss's autograd record (:mod:`lightning_mgpu.parallel.loss_graph`): read from shards of a batch, it combines
their losses into the whole batch's loss and gradient exactly, for torch's loss functions, reductions and sums of
differently normalised terms; what mixes a shard's rows is named; what it cannot read it says so."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_mgpu.parallel.loss_combine import combine_losses_by_record
from lightning_mgpu.parallel.loss_coupling import coupling
from lightning_mgpu.parallel.loss_graph import read_loss

N, C = 10, 5
GEN = torch.Generator().manual_seed(0)
X = torch.randn(N, 4, dtype=torch.float64, generator=GEN)
Y = torch.randint(0, C, (N,), generator=GEN).index_fill(0, torch.tensor([1, 2, 7]), -100)
ROWS = torch.randint(0, C, (N, 3), generator=GEN)
ROWS[0, :2] = -100
ROWS[5] = -100
DENSE = torch.rand(N, C, dtype=torch.float64, generator=GEN)
MASK = (torch.rand(N, generator=GEN) > 0.4).double()
CLASS_WEIGHT = torch.rand(C, dtype=torch.float64, generator=GEN) + 0.5

Loss = Callable[[Tensor, tuple[Tensor, ...]], Tensor]


def _ce(logits: Tensor, data: tuple[Tensor, ...], **kwargs) -> Tensor:
    return F.cross_entropy(logits, data[0], **kwargs)


def _masked_sse(z: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """A loss function's sum over the kept rows, over their count (a mean; the count differs between shards)."""
    return F.mse_loss(z * mask[:, None], target * mask[:, None], reduction="sum") / mask.sum()


CASES: dict[str, Loss] = {
    "cross_entropy": lambda z, d: _ce(z, d),
    "class weights": lambda z, d: _ce(z, d, weight=CLASS_WEIGHT),
    "label smoothing": lambda z, d: _ce(z, d, label_smoothing=0.1),
    "weights + smoothing": lambda z, d: _ce(z, d, weight=CLASS_WEIGHT, label_smoothing=0.2),
    "probability targets": lambda z, d: F.cross_entropy(z, d[2].softmax(1)),
    "(N, C, L) inputs": lambda z, d: F.cross_entropy(torch.stack([z, 2 * z, -z], 2), d[1]),
    "ignore_index=250": lambda z, d: F.cross_entropy(z, d[0].where(d[0] != -100, 250), ignore_index=250),
    "mse_loss": lambda z, d: F.mse_loss(z, d[2]),
    "l1_loss": lambda z, d: F.l1_loss(z, d[2]),
    "huber_loss": lambda z, d: F.huber_loss(z, d[2], delta=0.5),
    "smooth_l1_loss": lambda z, d: F.smooth_l1_loss(z, d[2], beta=0.5),
    "binary_cross_entropy": lambda z, d: F.binary_cross_entropy(z.sigmoid(), d[2]),
    "bce with logits, pos_weight": lambda z, d: F.binary_cross_entropy_with_logits(z, d[2], pos_weight=CLASS_WEIGHT),
    "kl_div batchmean": lambda z, d: F.kl_div(z.log_softmax(1), d[2].softmax(1), reduction="batchmean"),
    ".mean()": lambda z, d: z.square().mean(),
    ".sum()": lambda z, d: z.square().sum(),
    "masked mean": lambda z, d: (z.square().sum(1) * d[3]).sum() / d[3].sum(),
    "sum / constant": lambda z, d: z.square().sum() / 4.0,
    "sum / shape[0]": lambda z, d: z.square().sum() / z.shape[0],
    "0.7 mse + 0.3 ce": lambda z, d: 0.7 * F.mse_loss(z, d[2]) + 0.3 * _ce(z, d),
    "tokens + samples (BERT pre-training)": lambda z, d: (
        F.cross_entropy(torch.stack([z, -z, z], 2), d[1]) + _ce(z, (d[0].clamp(min=0),))
    ),
    "ce - 0.1 mean": lambda z, d: _ce(z, d) - 0.1 * z.mean(),
    "ce / 2": lambda z, d: _ce(z, d) / 2,
    "nll sum / own count": lambda z, d: F.nll_loss(z.log_softmax(1), d[0], reduction="sum") / (d[0] != -100).sum(),
    "masked sse / its count + ce": lambda z, d: _masked_sse(z, d[2], (d[0] != -100).double()) + _ce(z, d),
    # From a review: constant factors between a sum and its divisor, reciprocal multipliers, reductions of scalars.
    "0.5 * sse / n": lambda z, d: 0.5 * (z - d[2]).pow(2).sum() / len(z),
    "(bce sum + sse) / n": lambda z, d: (
        (F.binary_cross_entropy_with_logits(z, d[2], reduction="sum") + z.pow(2).sum()) / len(z)
    ),
    "sse * (1 / n)": lambda z, d: (z - d[2]).pow(2).sum() * (1.0 / len(z)),
    "masked mean / 3 (accumulation)": lambda z, d: (z.square().sum(1) * d[3]).sum() / d[3].sum() / 3,
    "sse / 2 / n": lambda z, d: (z - d[2]).pow(2).sum() / 2 / len(z),
    "ce.sum()": lambda z, d: _ce(z, d).sum(),
    "ce.mean()": lambda z, d: _ce(z, d).mean(),
    "stack([ce, mse]).sum()": lambda z, d: torch.stack([_ce(z, d), F.mse_loss(z, d[2])]).sum(),
    "stack([ce, mse]).mean()": lambda z, d: torch.stack([_ce(z, d), F.mse_loss(z, d[2])]).mean(),
}


def _shards_against_the_whole(loss: Loss, shards: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    weight = torch.randn(C, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    data = (Y, ROWS, DENSE, MASK)
    whole = loss(X @ weight.T, data)
    (whole_grad,) = torch.autograd.grad(whole, weight)
    parts = torch.tensor_split(torch.arange(N), shards)  # uneven: 4, 3, 3
    losses = [loss(X[p] @ weight.T, tuple(d[p] for d in data)) for p in parts]
    combined = combine_losses_by_record(losses, [read_loss(x) for x in losses], [len(p) for p in parts], X.device)
    assert combined is not None, [read_loss(x) for x in losses]
    (grad,) = torch.autograd.grad(combined.loss, weight)
    return combined.loss, whole, grad, whole_grad


@pytest.mark.parametrize("shards", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_shards_combine_into_the_whole_batchs_loss_and_gradient(name: str, shards: int):
    loss, whole, grad, whole_grad = _shards_against_the_whole(CASES[name], shards)
    torch.testing.assert_close(loss, whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, whole_grad, rtol=0, atol=1e-12)


ONE_SAMPLE_SHARDS: dict[str, Loss] = {
    "ce(reduction='none').sum()": lambda z, d: _ce(z, d, reduction="none").sum(),
    "ce(reduction='none').mean()": lambda z, d: _ce(z, (d[0].clamp(min=0),), reduction="none").mean(),
    "squares[mask].mean()": lambda z, d: z.square().sum(1)[d[3] > 0].mean(),
    "sse": lambda z, d: (z - d[2]).pow(2).sum(),
}


@pytest.mark.parametrize("shards", [3, N - 1])  # N - 1: shards of one sample, whose .sum() is over one element
@pytest.mark.parametrize("name", list(ONE_SAMPLE_SHARDS))
def test_a_reduction_over_one_element_is_a_shard_of_one_not_a_scalar(name: str, shards: int):
    """From a review: a shard's ``.sum()`` / ``.mean()`` over one element (a last batch of one sample per device, one
    masked element kept) was walked as a scalar's and misread (7.2 off one device)."""
    loss, whole, grad, whole_grad = _shards_against_the_whole(ONE_SAMPLE_SHARDS[name], shards)
    torch.testing.assert_close(loss, whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, whole_grad, rtol=0, atol=1e-12)


def test_each_term_gets_its_own_weight():
    """MLM over tokens plus NSP over samples: per-shard weights of one term would be off (this is what a single
    weight per device did)."""
    weight = torch.ones(C, 4, dtype=torch.float64, requires_grad=True)
    record = read_loss(CASES["tokens + samples (BERT pre-training)"](X @ weight.T, (Y, ROWS, DENSE, MASK)))
    assert [term.name for term in record.terms] == ["NllLoss2DBackward0", "NllLossBackward0"]
    assert int(record.terms[0].count) == int((ROWS != -100).sum()) and int(record.terms[1].count) == N


def test_saved_integers_come_back_signed_and_class_weights_count_per_target():
    logits = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([0, 2, -100, 2])
    (term,) = read_loss(F.cross_entropy(logits, target, weight=torch.tensor([1.0, 2.0, 4.0]).double())).terms
    assert float(term.count) == 1 + 4 + 4


@pytest.mark.parametrize(
    ("name", "loss", "says"),
    [
        (
            "InfoNCE",
            lambda z: F.cross_entropy(F.normalize(z, dim=1) @ F.normalize(z, dim=1).T, torch.arange(N)),
            "product",
        ),
        ("logsumexp over the batch", lambda z: z.logsumexp(0).mean(), "batch dimension"),
        ("x / x.std(0)", lambda z: F.mse_loss(z / z.std(0), DENSE), "batch dimension"),
        ("BatchNorm", lambda z: F.mse_loss(torch.nn.BatchNorm1d(C).double()(z), DENSE), "BatchNorm"),
        ("RMSE", lambda z: F.mse_loss(z, DENSE).sqrt(), "nonlinear function (Sqrt)"),
        ("log of a mean", lambda z: _ce(z, (Y,)).log(), "nonlinear function (Log)"),
        ("Dice", lambda z: 1 - 2 * (z.sigmoid() * DENSE).sum() / (z.sigmoid().sum() + DENSE.sum()), "(Div)"),
    ],
)
def test_a_loss_that_couples_samples_is_named(name, loss, says):
    z = X @ torch.randn(C, 4, dtype=torch.float64, requires_grad=True).T
    assert says in coupling(loss(z), N)


def test_per_sample_losses_and_layers_do_not_count_as_coupling():
    layer = torch.nn.Linear(4, N, bias=False).double()  # output width == batch: not a batch-by-batch product
    assert coupling(F.mse_loss(layer(X), torch.zeros(N, N, dtype=torch.float64)), N) is None
    assert coupling(F.cross_entropy(torch.nn.LayerNorm(4).double()(X) @ torch.ones(4, C).double(), Y), N) is None


def test_nonlinear_functions_of_per_sample_parts_or_of_the_weights_do_not_count_as_coupling():
    """A learned weight of a mean (uncertainty weighting), a focal term, the norm of the weights, a masked mean."""
    weight = torch.randn(C, 4, dtype=torch.float64, requires_grad=True)
    log_var = torch.zeros((), dtype=torch.float64, requires_grad=True)
    z = X @ weight.T
    per_sample = F.cross_entropy(z, Y.clamp(min=0), reduction="none")
    for loss in (
        _ce(z, (Y,)) * torch.exp(-log_var) + log_var,
        ((1 - torch.exp(-per_sample)) ** 2 * per_sample).mean(),
        _ce(z, (Y,)) + 0.1 * weight.pow(2).sum().sqrt(),
        (per_sample * MASK).sum() / MASK.sum(),
    ):
        assert coupling(loss, N) is None


def test_what_it_cannot_read_it_says_and_combines_nothing():
    z = X.clone().requires_grad_()
    losses = [z[:5].abs().max(), z[5:].abs().max()]
    records = [read_loss(x) for x in losses]
    assert records[0].unknown == "MaxBackward1"
    assert combine_losses_by_record(losses, records, [5, 5], X.device) is None
    assert read_loss(z.detach().sum()) is None  # no record at all


@pytest.mark.parametrize("shards", [2, 3])  # even shards (5, 5): each shard's count alike, still a count
def test_a_term_multiplied_by_each_shards_count_is_multiplied_by_the_whole_batchs(shards: int):
    """``criterion(...) * len(y)`` (a sum written as a mean times the count): one device multiplies by the whole
    batch's count, so each shard's share is scaled by it over the shard's own (found by a trial: 0.13 off)."""
    loss, whole, grad, whole_grad = _shards_against_the_whole(lambda z, d: _ce(z, d) * z.shape[0], shards)
    torch.testing.assert_close(loss, whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, whole_grad, rtol=0, atol=1e-12)


def test_a_layer_norm_over_the_last_dimension_is_no_coupling():
    """T5's RMS norm, ``x.pow(2).mean(-1)``: torch saves dim -1 unsigned (2**64 - 1), which is no batch dimension."""
    z = (X @ torch.randn(C, 4, dtype=torch.float64, requires_grad=True).T).reshape(N, 1, C)
    normed = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert coupling(F.mse_loss(normed.squeeze(1), DENSE), N) is None


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_regulariser_of_the_weights_counts_once_as_on_one_device(reduction: str):
    """``loss + λ * sum(p.pow(2).sum() ...)``: every shard computes the same regulariser, which one device adds once
    (as a sum it was added once per shard; its parts, which no saved tensor recomputes, are one remainder)."""
    weight = torch.nn.Parameter(torch.randn(C, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2)))
    bias = torch.nn.Parameter(torch.zeros(C, dtype=torch.float64))

    def loss(x: Tensor, y: Tensor) -> Tensor:
        data = F.cross_entropy(x @ weight.T + bias, y, reduction=reduction)
        return data + 1e-1 * sum(p.pow(2).sum() for p in (weight, bias)) + 1e-2 * weight.abs().mean()

    whole = loss(X, Y)
    whole_grads = torch.autograd.grad(whole, (weight, bias))
    parts = torch.tensor_split(torch.arange(N), 3)
    losses = [loss(X[p], Y[p]) for p in parts]
    records = [read_loss(x) for x in losses]
    assert sum("of the parameters" in term.name for term in records[0].terms) == 3
    combined = combine_losses_by_record(losses, records, [len(p) for p in parts], X.device)
    torch.testing.assert_close(combined.loss, whole, rtol=0, atol=1e-12)
    for got, expected in zip(torch.autograd.grad(combined.loss, (weight, bias)), whole_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_an_activation_penalty_is_no_regulariser_of_the_weights():
    """A penalty on what the batch makes (``h.pow(2).mean()``) depends on the shard: a mean over its elements."""
    weight = torch.randn(C, 4, dtype=torch.float64, requires_grad=True)
    hidden = X @ weight.T
    (term,) = read_loss(hidden.pow(2).mean()).terms
    assert term.name == "MeanBackward0" and term.count == N * C


@pytest.mark.parametrize(
    "name", ["cross_entropy", "masked mean", "tokens + samples (BERT pre-training)", "masked sse / its count + ce"]
)
def test_a_shard_with_nothing_to_count_leaves_no_nan_in_the_gradient(name: str):
    """A shard whose labels are all ignored (or whose mask is empty) has a 0/0 loss; one device never sees it, so
    it must not reach backward (0 times its NaN gradient is NaN)."""
    weight = torch.randn(C, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    ignored = Y.clone()
    ignored[:4] = -100
    rows = ROWS.clone()
    rows[:4] = -100
    mask = MASK.clone()
    mask[:4] = 0
    data = (ignored, rows, DENSE, mask)
    whole = CASES[name](X @ weight.T, data)
    (whole_grad,) = torch.autograd.grad(whole, weight)
    parts = torch.tensor_split(torch.arange(N), 3)  # the first shard, rows 0-3, has nothing to count
    losses = [CASES[name](X[p] @ weight.T, tuple(d[p] for d in data)) for p in parts]
    combined = combine_losses_by_record(losses, [read_loss(x) for x in losses], [len(p) for p in parts], X.device)
    (grad,) = torch.autograd.grad(combined.loss, weight)
    torch.testing.assert_close(combined.loss, whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, whole_grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "loss",
    [lambda z: F.cross_entropy(z, Y.clamp(min=0), reduction="none").logsumexp(0), lambda z: z.square().sum(1).max()],
    ids=["logsumexp over samples", "max over samples"],
)
def test_a_reduction_over_samples_at_the_top_is_named_as_coupling(loss):
    z = X @ torch.randn(C, 4, dtype=torch.float64, requires_grad=True).T
    assert "batch dimension" in coupling(loss(z), N)


def _parameters_against_the_whole(loss: Callable[[Tensor, Tensor, Tensor], Tensor]) -> None:
    """``loss(x, y, idx)`` over shards (3, uneven) against the whole batch: value and the parameters' gradients."""
    torch.manual_seed(4)
    lin = torch.nn.Linear(4, C).double()
    extra = torch.nn.Parameter(torch.randn(N, 4, dtype=torch.float64))
    params = [*lin.parameters(), extra]
    index = torch.arange(N)

    def run(rows: Tensor) -> Tensor:
        return loss(lin, extra, (X[rows], Y[rows].clamp(min=0), index[rows]))

    whole = run(index)
    whole_grads = torch.autograd.grad(whole, params, allow_unused=True)
    parts = torch.tensor_split(index, 3)
    losses = [run(p) for p in parts]
    records = [read_loss(x, len(p)) for x, p in zip(losses, parts, strict=True)]  # as the strategy reads them
    combined = combine_losses_by_record(losses, records, [len(p) for p in parts], X.device)
    torch.testing.assert_close(combined.loss, whole, rtol=0, atol=1e-12)
    for got, expected in zip(torch.autograd.grad(combined.loss, params, allow_unused=True), whole_grads, strict=True):
        assert (got is None) == (expected is None)
        if got is not None:
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "loss",
    [
        lambda lin, extra, b: ((lin(b[0] - extra[0]) - 1).pow(2)).sum(),  # a learned input offset: data, no graph
        lambda lin, extra, b: _ce(lin(b[0]), (b[1],)) + 0.01 * extra[b[2]].pow(2).sum(),  # the rows the batch uses
        lambda lin, extra, b: _ce(lin(b[0]), (b[1],)) + 0.1 * (lin.weight * (X[:C] > 0)).pow(2).sum(),  # a mask
        lambda lin, extra, b: _ce(lin(b[0]), (b[1],)) + 0.1 * (lin.weight - 1).pow(2).sum(),  # EWC's anchor
    ],
    ids=["learned offset", "rows the batch selects", "pruning mask", "anchored weights"],
)
def test_reductions_of_parameters_count_once_only_where_every_shard_computes_the_same(loss):
    """A reduction that reaches parameters only may still read data (``lin(x - mu)``, ``E[idx]``): it counts once
    only where its value is the same on every shard, as a regulariser's (a mask or an anchor included) is."""
    _parameters_against_the_whole(loss)


def test_a_constant_equal_to_the_shard_size_follows_what_earlier_steps_showed():
    """``2.0 * kd`` on the last batch's shards of 2 (a constant equal to each shard's size) reads as a constant where
    an earlier step showed one (shards of 5); with no history a number equal to each shard's size is its count."""
    memory: dict = {}
    weight = torch.randn(C, 4, dtype=torch.float64, requires_grad=True)

    def combined(rows: Tensor, parts: int) -> tuple[Tensor, Tensor]:
        loss = lambda r: 2.0 * F.mse_loss(X[r] @ weight.T, DENSE[r])  # noqa: E731
        shards = torch.tensor_split(rows, parts)
        losses = [loss(p) for p in shards]
        records = [read_loss(x) for x in losses]
        out = combine_losses_by_record(losses, records, [len(p) for p in shards], X.device, False, memory)
        return out.loss, loss(rows)

    got, whole = combined(torch.arange(N), 2)  # shards of 5: 2.0 is no count here
    torch.testing.assert_close(got, whole, rtol=0, atol=1e-12)
    got, whole = combined(torch.arange(4), 2)  # shards of 2: ambiguous, settled by the step before
    torch.testing.assert_close(got, whole, rtol=0, atol=1e-12)


@pytest.mark.parametrize("scale_gradients", [True, False])
def test_a_mean_times_its_count_stays_a_sum_on_shards_of_one_sample(scale_gradients: bool):
    """``ce * len(x)`` (a sum) on the last batch's shards of one sample each is ``ce * 1``: the number is still the
    count an earlier step showed (shards of 4, 3, 3), not a constant 1 (it was averaged: a third of the loss)."""
    memory: dict = {}
    weight = torch.randn(C, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3), requires_grad=True)

    def check(rows: Tensor) -> None:
        loss = lambda r: F.cross_entropy(X[r] @ weight.T, Y[r]) * len(r)  # noqa: E731
        shards = torch.tensor_split(rows, 3)
        losses = [loss(p) for p in shards]
        records = [read_loss(x, len(p)) for x, p in zip(losses, shards, strict=True)]
        out = combine_losses_by_record(losses, records, [len(p) for p in shards], X.device, scale_gradients, memory)
        whole = loss(rows)
        torch.testing.assert_close(out.loss, whole, rtol=0, atol=1e-12)
        expected = torch.autograd.grad(whole, weight)[0]
        torch.testing.assert_close(torch.autograd.grad(out.loss, weight)[0], expected, rtol=0, atol=1e-12)

    check(torch.arange(10))
    check(torch.arange(7, 10))


@pytest.mark.parametrize("shards", [2, 3])
@pytest.mark.parametrize("divide", [True, False])
def test_means_averaged_by_a_number_equal_to_the_shard_size_stay_means(shards: int, divide: bool):
    """CLIP's symmetric loss, ``(ce(z, y) + ce(z.T, y)) / 2``, on shards of 2 samples: the 1/2 equals the inverse of
    the shard size, but a mean divided by its own count would be no loss anyone writes (it was read so, halving the
    loss on 2 devices)."""
    weight = torch.randn(C, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    x, y = X[: 2 * shards], Y[: 2 * shards]

    def loss(xs: Tensor, ys: Tensor) -> Tensor:
        z = xs @ weight.T
        both = F.cross_entropy(z, ys) + F.cross_entropy(2 * z, ys)
        return both / 2 if divide else both * 0.5

    whole = loss(x, y)
    parts = torch.tensor_split(torch.arange(2 * shards), shards)
    losses = [loss(x[p], y[p]) for p in parts]
    combined = combine_losses_by_record(losses, [read_loss(v) for v in losses], [2] * shards, X.device, memory={})
    assert combined is not None
    torch.testing.assert_close(combined.loss, whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(
        torch.autograd.grad(combined.loss, weight)[0], torch.autograd.grad(whole, weight)[0], rtol=0, atol=1e-12
    )
