"""Unit tests of the loss rule (:mod:`lightning_mgpu.strategies.loss_normalization`): what each rule counts, and what
static knowledge says for each model and loss module, without training anything."""

from __future__ import annotations

import pytest
import torch
from hf_models import build_model
from torch import nn

from lightning_mgpu.strategies.loss_normalization import LossNormalization, call_weight, known_rule, uncombinable_loss

LABELS = torch.tensor([[5, 6, -100, -100], [7, -100, 8, 9]])


def test_a_token_count_skips_ignored_labels():
    assert LossNormalization.parse("tokens:labels").count({"labels": LABELS}).item() == 5


def test_a_shifted_count_leaves_out_the_first_position_of_each_row():
    # causal LMs predict token t+1 from t: row 0 counts 6 (1 valid after the first), row 1 counts 8, 9 (2)
    assert LossNormalization.parse("shifted_tokens:labels").count({"labels": LABELS}).item() == 3


def test_a_declared_ignore_index_is_the_one_counted():
    labels = {"mask": torch.tensor([[1, 255, 2], [-100, 255, 3]])}
    assert LossNormalization.parse("tokens:mask:255").count(labels).item() == 4  # -100 is a label here


def test_class_weights_weight_the_count_and_positions_name_tuple_items():
    rule = LossNormalization("tokens", (1,), ignore_index=-1, class_weight=(0.5, 2.0, 4.0))
    batch = (torch.zeros(4, 2), torch.tensor([0, 2, -1, 2]))
    assert rule.count(batch).item() == pytest.approx(0.5 + 4.0 + 4.0)


@pytest.mark.parametrize(
    "spec", ["samples", "sum", "replica_mean", "tokens:labels", "shifted_tokens:a.0", "tokens:mask:255", "tokens:1:-1"]
)
def test_parse_and_spec_round_trip(spec):
    assert LossNormalization.parse(spec).spec() == spec


def test_parse_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="loss_reduction must be one of"):
        LossNormalization.parse("tokens")
    with pytest.raises(ValueError, match="'tokens:labels:255' for an ignore index other than -100"):
        LossNormalization.parse("tokens:labels:none")
    assert LossNormalization.parse("auto") is None


@pytest.mark.parametrize(
    ("task", "labels", "expected"),
    [
        ("masked_lm", LABELS, "tokens:labels"),
        ("causal_lm", LABELS, "shifted_tokens:labels"),
        ("token_classification", LABELS, "tokens:labels"),
        ("sequence_classification", torch.tensor([1, -100]), "tokens:labels"),
        ("sequence_classification", torch.tensor([[0.0, 1.0, 0.0]]), "samples"),  # multi-label: BCE over all outputs
        ("t5", LABELS, "tokens:labels"),  # decoder targets: not shifted
        ("bart", LABELS, "tokens:labels"),
        ("roberta_masked_lm", LABELS, "tokens:labels"),
    ],
)
def test_transformers_models_say_their_rule(task, labels, expected):
    module = nn.ModuleDict({"model": build_model(task, dtype=torch.float32)})
    rule, source = known_rule(module, {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": labels})
    assert rule.spec() == expected
    assert type(module["model"]).__name__ in source


def test_without_labels_in_the_batch_a_model_says_nothing():
    module = nn.ModuleDict({"model": build_model("masked_lm", dtype=torch.float32)})
    assert known_rule(module, {"input_ids": torch.zeros(2, 4, dtype=torch.long)}) is None


def test_pretraining_has_no_rule_and_a_message_naming_loss_terms():
    module = nn.ModuleDict({"model": build_model("pretraining", dtype=torch.float32)})
    assert known_rule(module, {"labels": LABELS}) is None
    assert "loss_terms" in uncombinable_loss(module)


@pytest.mark.parametrize(
    ("criterion", "expected"),
    [
        (nn.CrossEntropyLoss(), "tokens:1"),
        (nn.NLLLoss(ignore_index=-1), "tokens:1:-1"),  # the spec that selects it names its ignore index
        (nn.CrossEntropyLoss(reduction="sum"), "sum"),
        (nn.MSELoss(), "samples"),
        (nn.BCEWithLogitsLoss(reduction="sum"), "sum"),
    ],
)
def test_loss_modules_say_their_rule(criterion, expected):
    module = nn.ModuleDict({"net": nn.Linear(2, 3), "criterion": criterion})
    rule, _ = known_rule(module, (torch.zeros(4, 2), torch.tensor([0, 1, 2, 0])))
    assert rule.spec() == expected
    if isinstance(criterion, nn.NLLLoss):
        assert rule.ignore_index == -1


def test_disagreeing_or_unreduced_loss_modules_say_nothing():
    batch = (torch.zeros(4, 2), torch.tensor([0, 1, 2, 0]))
    both = nn.ModuleDict({"a": nn.CrossEntropyLoss(), "b": nn.MSELoss(reduction="sum")})
    assert known_rule(both, batch) is None
    assert known_rule(nn.ModuleDict({"a": nn.CrossEntropyLoss(reduction="none")}), batch) is None


class ValidationOnlyCriterion(nn.Module):
    """Holds a summing loss for validation; trains with a per-sample mean written in the step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 3)
        self.val_criterion = nn.CrossEntropyLoss(reduction="sum")

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return self.val_criterion(self.net(x), y)


class TrainingCriterionInAHelper(ValidationOnlyCriterion):
    def training_step(self, batch, batch_idx):
        return self.shared_step(batch)

    def shared_step(self, batch):
        x, y = batch
        return self.val_criterion(self.net(x), y)


class CriterionInForward(ValidationOnlyCriterion):
    """The step calls ``self(x, y)``; ``forward`` computes the loss with a module that ignores -1."""

    def __init__(self) -> None:
        super().__init__()
        self.criterion = nn.CrossEntropyLoss(ignore_index=-1)

    def forward(self, x, y):
        return self.criterion(self.net(x), y)

    def training_step(self, batch, batch_idx):
        return self(*batch)


def test_a_loss_module_called_in_forward_through_self_says_its_rule():
    rule, source = known_rule(CriterionInForward(), (torch.zeros(4, 2), torch.tensor([0, 1, -1, 0])))
    assert rule.spec() == "tokens:1:-1" and "CrossEntropyLoss" in source


def test_a_loss_module_the_training_step_never_names_decides_nothing():
    batch = (torch.zeros(4, 2), torch.tensor([0, 1, 2, 0]))
    assert known_rule(ValidationOnlyCriterion(), batch) is None
    rule, _ = known_rule(TrainingCriterionInAHelper(), batch)  # named in a method the step calls
    assert rule.spec() == "sum"


# --- num_items_in_batch ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("task", "expected"), [("causal_lm", "sum"), ("masked_lm", "tokens:labels")])
def test_num_items_in_batch_makes_a_model_that_divides_by_it_sum(task, expected):
    """GPT-2 hands it to its loss function (a sum over tokens divided by the count given): each shard's loss is a part
    of one sum. BERT's MLM head computes its own mean and ignores it. Read from the batch and from one call."""
    model = build_model(task, dtype=torch.float32)
    counted = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": LABELS, "num_items_in_batch": 5}
    rule, source = known_rule(nn.ModuleDict({"model": model}), counted)
    assert rule.spec() == expected and ("num_items_in_batch" in source) == (expected == "sum")
    assert (call_weight(model, (), counted, None) == "sum") == (expected == "sum")
    assert call_weight(model, (), {**counted, "num_items_in_batch": None}, None) != "sum"


class CountPassedInTheStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = build_model("causal_lm", dtype=torch.float32)
        self.items = 5

    def training_step(self, batch, batch_idx):
        return self.model(**batch, num_items_in_batch=self.items).loss

    def validation_step(self, batch, batch_idx):
        return self.model(**{k: v for k, v in batch.items() if k != "num_items_in_batch"}).loss


def test_a_count_named_in_the_steps_code_does_not_decide_what_one_call_passes_does():
    """The code's text says nothing about which count reaches the model (a comment, a default, a shard's own count):
    the rule stays the task's, and each call's weight is read from what it passed: the batch's count makes it a part
    of a sum, its own tokens' count a token mean."""
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": LABELS}
    assert known_rule(CountPassedInTheStep(), batch)[0].spec() == "shifted_tokens:labels"
    model = CountPassedInTheStep().model
    own = int((LABELS[:, 1:] != -100).sum())
    assert call_weight(model, (), {**batch, "num_items_in_batch": own + 3}, None) == "sum"
    assert int(call_weight(model, (), {**batch, "num_items_in_batch": torch.tensor(own)}, None)) == own


# --- loss modules with a forward of their own ------------------------------------------------------------------------
class ShiftedCE(nn.CrossEntropyLoss):
    def forward(self, logits, labels):
        return super().forward(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


class RenamedCE(nn.CrossEntropyLoss):
    """A subclass that keeps torch's forward: its options still say what it counts."""


def test_a_subclass_with_its_own_forward_says_no_mean_but_still_a_sum():
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": LABELS}
    assert known_rule(nn.ModuleDict({"criterion": ShiftedCE()}), batch) is None
    assert known_rule(nn.ModuleDict({"criterion": ShiftedCE(reduction="sum")}), batch)[0].spec() == "sum"
    assert known_rule(nn.ModuleDict({"criterion": RenamedCE()}), batch)[0].spec() == "tokens:labels"
    logits = torch.zeros(2, 4, 3)
    assert call_weight(ShiftedCE(), (logits, LABELS), {}, None) is None
    assert call_weight(ShiftedCE(reduction="sum"), (logits, LABELS), {}, None) == "sum"
    assert call_weight(RenamedCE(), (logits.flatten(0, 1), LABELS.flatten()), {}, None).item() == 5


# --- what one call of a loss module averages over -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("criterion", "args", "expected"),
    [
        (nn.MSELoss(), (torch.zeros(6, 3, 4), torch.zeros(6, 3, 4)), 72),  # sequence first (T, N, H): elements
        (nn.MSELoss(), (torch.zeros(3, 4), torch.zeros(3, 1)), 12),  # a broadcast target
        (nn.BCEWithLogitsLoss(), (torch.zeros(3, 5), torch.zeros(3, 5)), 15),
        (nn.CTCLoss(), (torch.zeros(6, 3, 5), torch.ones(3, 2, dtype=torch.long)), 3),  # (T, N, C): N samples
        (nn.TripletMarginLoss(), (torch.zeros(3, 8), torch.zeros(3, 8)), 3),  # one value per sample
        (nn.KLDivLoss(reduction="batchmean"), (torch.zeros(3, 5), torch.zeros(3, 5)), 3),
        (nn.CrossEntropyLoss(), (torch.zeros(3, 5, 7), torch.zeros(3, 5, 7)), 21),  # probabilities: samples x positions
    ],
    ids=["mse-seq-first", "mse-broadcast", "bce", "ctc", "triplet", "kl-batchmean", "ce-probabilities"],
)
def test_a_loss_modules_call_counts_what_its_mean_divides_by(criterion, args, expected):
    """Per call, the count of the unreduced output's values, from the inputs' shapes: the first dimension is not
    always the batch (CTC's and a sequence-first RNN's inputs are (T, N, ...))."""
    assert call_weight(criterion, args, {}, None) == expected
