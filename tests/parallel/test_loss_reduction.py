"""Per-device losses reduced on the root: count weighting makes them equal to the whole-batch loss."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

from lightning_mgpu.parallel import DataParallelCriterion, DataParallelModel, reduce_losses

TOL = 1e-10
VOCAB, DIM, SEQ = 11, 8, 5
MODES = ("threads", "sequential")


class TokenModel(nn.Module):
    """Per-token logits laid out as CrossEntropyLoss wants them: (batch, classes, seq)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, VOCAB)
        self.double()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(self.emb(tokens))).permute(0, 2, 1)


def token_batch(valid_per_row: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and targets where row i has ``valid_per_row[i]`` non-ignored targets (the rest are -100)."""
    g = torch.Generator().manual_seed(seed)
    rows = len(valid_per_row)
    tokens = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    for i, valid in enumerate(valid_per_row):
        targets[i, valid:] = -100
    return tokens, targets


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def run_both(criterion_factory, tokens, targets, n, mode="sequential"):
    """(single-device loss, grads), (data-parallel loss, grads, per-device outputs)."""
    reference = TokenModel()
    ref_loss = criterion_factory()(reference(tokens), targets)
    ref_loss.backward()
    model = TokenModel()
    outputs = DataParallelModel(model, ["cpu"] * n, execution_mode=mode)(tokens)
    loss = DataParallelCriterion(criterion_factory(), ["cpu"] * n, execution_mode=mode)(outputs, targets)
    loss.backward()
    return (ref_loss, grads(reference)), (loss, grads(model), outputs)


@pytest.mark.parametrize("mode", MODES)
def test_token_cross_entropy_needs_count_weights(mode):
    # 3 devices, 2 rows each: 10, 3 and 6 valid tokens.
    tokens, targets = token_batch([5, 5, 2, 1, 5, 1])
    (ref_loss, ref_grads), (loss, dp_grads, outputs) = run_both(
        lambda: nn.CrossEntropyLoss(ignore_index=-100), tokens, targets, 3, mode
    )
    assert abs(loss.item() - ref_loss.item()) < TOL
    assert max_diff(dp_grads, ref_grads) < TOL

    shards = targets.tensor_split(3)
    losses = [nn.CrossEntropyLoss()(o, t) for o, t in zip(outputs, shards, strict=True)]
    counts = [int((t != -100).sum()) for t in shards]
    assert counts == [10, 3, 6]
    weighted = reduce_losses(losses, counts, reduction="weighted")
    equal = reduce_losses(losses, counts, reduction="replica_mean")  # the 2018 DataParallelCriterion / Lightning 1.x dp
    assert abs(weighted.item() - ref_loss.item()) < TOL
    assert abs(equal.item() - ref_loss.item()) > 1e-3
    assert abs(equal.item() - sum(losses).item() / 3) < TOL


@pytest.mark.parametrize("mode", MODES)
def test_class_weighted_cross_entropy(mode):
    weight = torch.linspace(0.2, 3.0, VOCAB, dtype=torch.float64)
    tokens, targets = token_batch([5, 4, 2, 1, 5, 3, 2], seed=3)
    (ref_loss, ref_grads), (loss, dp_grads, _) = run_both(
        lambda: nn.CrossEntropyLoss(weight=weight, ignore_index=-100), tokens, targets, 3, mode
    )
    assert abs(loss.item() - ref_loss.item()) < TOL
    assert max_diff(dp_grads, ref_grads) < TOL


class PerSequenceMean(nn.CrossEntropyLoss):
    """Each sequence's mean token loss, then the mean over sequences: a per-sample mean, though its class is a
    CrossEntropyLoss whose ``ignore_index`` the forward uses its own way."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        per_token = nn.functional.cross_entropy(logits, targets, reduction="none", ignore_index=self.ignore_index)
        valid = targets != self.ignore_index
        return ((per_token * valid).sum(1) / valid.sum(1)).mean()


@pytest.mark.parametrize("mode", MODES)
def test_a_loss_subclass_with_its_own_forward_is_not_counted_by_its_options(mode):
    """Its ``ignore_index`` says nothing about what its forward averages over: weighted by samples (the documented
    default), which is exact for this per-sequence mean; counting its non-ignored targets was off."""
    tokens, targets = token_batch([5, 5, 2, 1, 5, 1])
    (ref_loss, ref_grads), (loss, dp_grads, _) = run_both(PerSequenceMean, tokens, targets, 3, mode)
    assert abs(loss.item() - ref_loss.item()) < TOL
    assert max_diff(dp_grads, ref_grads) < TOL


def test_class_weighted_cross_entropy_with_label_smoothing():
    weight = torch.linspace(0.5, 2.0, VOCAB, dtype=torch.float64)
    tokens, targets = token_batch([5, 1, 3, 4, 2], seed=4)
    (ref_loss, ref_grads), (loss, dp_grads, _) = run_both(
        lambda: nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1), tokens, targets, 2
    )
    assert abs(loss.item() - ref_loss.item()) < TOL
    assert max_diff(dp_grads, ref_grads) < TOL


@pytest.mark.parametrize(
    ("criterion", "kwargs"),
    [
        (nn.functional.cross_entropy, {}),  # torch's default ignore_index=-100
        (functools.partial(nn.functional.cross_entropy, ignore_index=3), {}),
        (nn.functional.cross_entropy, {"ignore_index": 3, "weight": torch.linspace(0.5, 2.0, VOCAB).double()}),
        (nn.functional.cross_entropy, {"reduction": "sum"}),
        (lambda logits, target: nn.functional.nll_loss(logits.log_softmax(1), target), {}),  # read from its record
    ],
)
def test_functional_cross_entropy_is_weighted_by_its_valid_targets(criterion, kwargs):
    tokens, targets = token_batch([5, 5, 2, 1, 5, 1])
    call_kwargs = kwargs
    if 3 in (call_kwargs.get("ignore_index"), getattr(criterion, "keywords", {}).get("ignore_index")):
        targets[targets == -100] = 3  # the padding value is this call's ignore_index
    reference = TokenModel()
    ref_loss = criterion(reference(tokens), targets, **call_kwargs)
    ref_loss.backward()
    model = TokenModel()
    outputs = DataParallelModel(model, ["cpu"] * 3)(tokens)
    loss = DataParallelCriterion(criterion, ["cpu"] * 3)(outputs, targets, **call_kwargs)
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) < TOL
    assert max_diff(grads(model), grads(reference)) < TOL


@pytest.mark.parametrize("mode", MODES)
def test_shard_without_valid_tokens_does_not_poison(mode):
    # Device 1 (rows 2-3) holds no valid target: its own loss is 0/0 = NaN.
    tokens, targets = token_batch([5, 3, 0, 0, 2, 4])
    (ref_loss, ref_grads), (loss, dp_grads, outputs) = run_both(lambda: nn.CrossEntropyLoss(), tokens, targets, 3, mode)
    assert math.isnan(nn.CrossEntropyLoss()(outputs[1], targets[2:4]).item())
    assert math.isfinite(loss.item())
    assert abs(loss.item() - ref_loss.item()) < TOL
    assert all(torch.isfinite(g).all() for g in dp_grads)
    assert max_diff(dp_grads, ref_grads) < TOL


def test_reduce_losses_drops_zero_weight_nan():
    a = torch.tensor(2.0, requires_grad=True)
    b = torch.tensor(float("nan"), requires_grad=True)
    loss = reduce_losses([a, b * 1], [4, 0])
    loss.backward()
    assert loss.item() == 2.0
    assert a.grad.item() == 1.0
    assert b.grad is None  # not even connected to the graph


def test_reduce_losses_weighting_and_dtypes():
    losses = [torch.tensor(1.0), torch.tensor(4.0)]
    assert reduce_losses(losses, [3, 1]).item() == pytest.approx(1.75)
    assert reduce_losses(losses, [torch.tensor(3), torch.tensor(1.0)]).item() == pytest.approx(1.75)
    assert reduce_losses(losses).item() == pytest.approx(2.5)  # no weights: equal weights
    assert reduce_losses(losses, [3, 1], reduction="replica_mean").item() == pytest.approx(2.5)
    assert reduce_losses(losses, reduction="sum").item() == pytest.approx(5.0)
    half = [t.to(torch.bfloat16) for t in losses]
    assert reduce_losses(half, [3, 1]).dtype == torch.float32  # weighted in at least float32
    assert reduce_losses([torch.tensor([[2.0]])], [1]).shape == ()  # one-element losses are scalars


@pytest.mark.parametrize("mode", MODES)
def test_reduction_none_gathers_per_sample_losses(mode):
    tokens, targets = token_batch([5, 4, 2, 1, 5, 3, 2], seed=5)
    reference, model = TokenModel(), TokenModel()
    ref = nn.CrossEntropyLoss(reduction="none")(reference(tokens), targets)
    outputs = DataParallelModel(model, ["cpu"] * 4, execution_mode=mode)(tokens)
    per_sample = DataParallelCriterion(nn.CrossEntropyLoss(reduction="none"), ["cpu"] * 4, execution_mode=mode)(
        outputs, targets
    )
    assert per_sample.shape == ref.shape == targets.shape
    assert (per_sample - ref).abs().max().item() < TOL
    ref.sum().backward()
    per_sample.sum().backward()
    assert max_diff(grads(model), grads(reference)) < TOL


class TripletNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 4)).double()

    def forward(self, anchor, positive, negative):
        return self.embed(anchor), self.embed(positive), self.embed(negative)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", [2, 3])
def test_multi_input_criterion_triplet(mode, n):
    """A plain-tuple output is unpacked into the criterion's arguments; there are no targets to split."""
    g = torch.Generator().manual_seed(0)
    a, p, q = (torch.randn(7, 6, generator=g, dtype=torch.float64) for _ in range(3))
    reference, model = TripletNet(), TripletNet()
    ref_loss = nn.TripletMarginLoss(margin=2.0)(*reference(a, p, q))
    ref_loss.backward()
    outputs = DataParallelModel(model, ["cpu"] * n, execution_mode=mode)(a, p, q)
    assert all(isinstance(o, tuple) and len(o) == 3 for o in outputs)
    loss = DataParallelCriterion(nn.TripletMarginLoss(margin=2.0), ["cpu"] * n, execution_mode=mode)(outputs)
    loss.backward()
    assert ref_loss.item() > 0
    assert abs(loss.item() - ref_loss.item()) < TOL
    assert max_diff(grads(model), grads(reference)) < TOL


def test_custom_weight_fn_and_functional_criterion():
    """A function as criterion, with weight_fn returning the normaliser the function uses."""

    def masked_mse(output, target, mask):
        return ((output - target) ** 2 * mask[:, None]).sum() / mask.sum()

    torch.manual_seed(1)
    reference = nn.Linear(3, 2).double()
    model = nn.Linear(3, 2).double()
    model.load_state_dict(reference.state_dict())
    x, target = torch.randn(9, 3, dtype=torch.float64), torch.randn(9, 2, dtype=torch.float64)
    mask = torch.tensor([1, 1, 0, 0, 0, 1, 1, 1, 0], dtype=torch.float64)
    ref_loss = masked_mse(reference(x), target, mask)
    ref_loss.backward()
    criterion = DataParallelCriterion(masked_mse, ["cpu"] * 3, weight_fn=lambda out, t: t[1].sum())
    loss = criterion(DataParallelModel(model, ["cpu"] * 3)(x), target, mask)
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) < TOL
    assert max_diff(grads(model), grads(reference)) < TOL


def test_criterion_with_buffer_is_replicated_not_shared():
    """A criterion holding tensors (class weights) is replicated per device; a stateless one is called as is."""
    calls = []

    class Recording(nn.CrossEntropyLoss):
        def forward(self, logits, target):
            calls.append(self)
            return super().forward(logits, target)

    weighted = Recording(weight=torch.ones(VOCAB, dtype=torch.float64))
    tokens, targets = token_batch([5, 5, 5, 5])
    outputs = DataParallelModel(TokenModel(), ["cpu"] * 2)(tokens)
    DataParallelCriterion(weighted, ["cpu"] * 2)(outputs, targets)
    assert len(calls) == 2 and calls[0] is not weighted and calls[1] is not weighted
    assert calls[0].weight is weighted.weight  # replica 0 shares the buffers
    calls.clear()
    plain = Recording()
    DataParallelCriterion(plain, ["cpu"] * 2)(outputs, targets)
    assert calls == [plain, plain]


def _flat_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A user's own token-mean loss: opaque to DataParallelCriterion."""
    return nn.functional.cross_entropy(logits.permute(0, 2, 1).reshape(-1, VOCAB), targets.reshape(-1))


class _Opaque(torch.autograd.Function):
    """A token cross-entropy computed in a custom autograd Function: its record is one node the reader cannot read."""

    @staticmethod
    def forward(ctx, logits, targets):
        ctx.save_for_backward(logits, targets)
        return _flat_cross_entropy(logits, targets)

    @staticmethod
    def backward(ctx, grad):
        logits, targets = ctx.saved_tensors
        with torch.enable_grad():
            leaf = logits.detach().requires_grad_()
            (out,) = torch.autograd.grad(_flat_cross_entropy(leaf, targets), leaf, grad)
        return out, None


def test_a_loss_of_your_own_is_read_from_its_record_with_no_weight_fn(recwarn):
    """A function of the user's calling torch's losses (a token mean over -100 labels) equals one device, unsaid, in
    training and evaluation; one whose record says nothing is said once to be sample-weighted, and the weight_fn
    the message suggests equals one device."""
    tokens, targets = token_batch([5, 5, 2, 1, 5, 1])
    reference = TokenModel()
    ref_loss = _flat_cross_entropy(reference(tokens), targets)
    model = DataParallelModel(TokenModel(), ["cpu"] * 3)
    criterion = DataParallelCriterion(_flat_cross_entropy, ["cpu"] * 3)
    assert abs(criterion(model(tokens), targets).item() - ref_loss.item()) < TOL
    with torch.no_grad():
        assert abs(criterion(model(tokens), targets).item() - ref_loss.item()) < TOL
    assert not [w for w in recwarn if "sample count" in str(w.message)]

    opaque = DataParallelCriterion(_Opaque.apply, ["cpu"] * 3)
    with pytest.warns(UserWarning, match=r"loss by its sample count.*does not say.*weight_fn=") as said:
        loss = opaque(model(tokens), targets)
        opaque(model(tokens), targets)
    assert len([w for w in said if "sample count" in str(w.message)]) == 1
    assert abs(loss.item() - ref_loss.item()) > 1e-3  # sample weights: not one device's token mean
    fixed = DataParallelCriterion(_Opaque.apply, ["cpu"] * 3, weight_fn=lambda o, t: (t[0] != -100).sum())
    assert abs(fixed(model(tokens), targets).item() - ref_loss.item()) < TOL


def test_a_criterion_whose_equality_builds_an_object_keeps_its_keywords_split():
    # torchmetrics' Metric (and symbolic objects) answer == with an object: F.cross_entropy is recognised by identity,
    # so such a criterion's per-sample keyword is split with the outputs, not mistaken for a class weight.
    class WeightedSquares:
        def __eq__(self, other):
            return ["an expression"]

        __hash__ = object.__hash__

        def __call__(self, output, target, weight):
            return ((output - target) ** 2 * weight).mean()

    output, target, weight = torch.arange(4.0), torch.zeros(4), torch.tensor([1.0, 2.0, 3.0, 4.0])
    criterion = DataParallelCriterion(WeightedSquares(), ["cpu", "cpu"], weight_fn=lambda o, t: len(o))
    loss = criterion([output[:2], output[2:]], target, weight=weight)
    torch.testing.assert_close(loss, WeightedSquares()(output, target, weight))


@pytest.mark.parametrize("classes", [6, 3], ids=["as-many-classes-as-samples", "fewer-classes"])
@pytest.mark.parametrize("mode", MODES)
def test_pos_weight_passed_as_a_keyword_goes_whole_as_torch_defines_it_per_class(mode, classes):
    """``F.binary_cross_entropy_with_logits(..., pos_weight=w)``: one weight per class by torch's contract, so it is
    not split like the targets, even when there are as many classes as samples."""
    torch.manual_seed(0)
    net = nn.Linear(5, classes).double()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 2, (6, classes)).double()
    pos_weight = torch.linspace(0.5, 3.0, classes, dtype=torch.float64)
    reference = nn.functional.binary_cross_entropy_with_logits(net(x), y, pos_weight=pos_weight)
    criterion = DataParallelCriterion(nn.functional.binary_cross_entropy_with_logits, ["cpu"] * 2, execution_mode=mode)
    loss = criterion(DataParallelModel(net, ["cpu"] * 2, execution_mode=mode)(x), y, pos_weight=pos_weight)
    assert abs(loss.item() - reference.item()) < TOL


def test_a_keyword_option_that_cannot_be_split_is_refused_with_the_fix_that_works():
    """``weight=`` of ``F.binary_cross_entropy_with_logits`` may be per sample or per class; a per-class one cannot be
    split like the targets: the error says to build the loss module with it, and that module gives one device's loss."""
    torch.manual_seed(0)
    net = nn.Linear(5, 3).double()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.rand(6, 3, dtype=torch.float64)
    weight = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    criterion = DataParallelCriterion(nn.functional.binary_cross_entropy_with_logits, ["cpu"] * 2)
    with pytest.raises(ValueError, match=r"kwargs\['weight'\].*nn\.BCEWithLogitsLoss\(weight=\.\.\.\)"):
        criterion(DataParallelModel(net, ["cpu"] * 2)(x), y, weight=weight)
    reference = nn.functional.binary_cross_entropy_with_logits(net(x), y, weight=weight)
    loss = DataParallelCriterion(nn.BCEWithLogitsLoss(weight=weight), ["cpu"] * 2)(
        DataParallelModel(net, ["cpu"] * 2)(x), y
    )
    assert abs(loss.item() - reference.item()) < TOL
