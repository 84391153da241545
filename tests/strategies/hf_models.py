"""Shared pieces of the loss-normalisation tests (issue 10): tiny ``transformers`` models built from configs (no
downloads) with padded batches, a small MLP whose loss is chosen by name, and a ``fit`` that records what the
equivalence checks compare (per-step combined losses, logged values, final parameters, warnings, the INFO decision).

Every ``transformers`` batch is a dict as a tokenizer's collator makes it: ``input_ids`` and ``attention_mask`` padded
on the right to one length, per-sample lengths that differ, and ``labels`` holding ``-100`` wherever the loss must not
look (padding, unmasked MLM positions), so that a token mean is not a per-sample mean.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import lightning_mgpu  # noqa: F401  (registers the strategies with both Lightning namespaces)

STEPS = 5
VOCAB = 61
SEQ = 12
N_LABELS = 3
IGNORE = -100
PAD = 0

#: ``loss_reduction`` each task's ``.loss`` corresponds to: what static knowledge of the model must say.
EXPECTED_RULE = {
    "masked_lm": "tokens:labels",
    "causal_lm": "shifted_tokens:labels",
    "token_classification": "tokens:labels",
    "sequence_classification": "tokens:labels",  # one label per sample; -100 labels are ignored by the loss
}
TASKS = tuple(EXPECTED_RULE)
#: Heads a new user tries that the tasks above do not cover: seq2seq (decoder labels), RoBERTa, DistilBERT.
MORE_HEADS = {
    "t5": "tokens:labels",
    "bart": "tokens:labels",
    "roberta_masked_lm": "tokens:labels",
    "distilbert_sequence_classification": "tokens:labels",
}


# --- transformers models --------------------------------------------------------------------------------------------
def _bert_config(dropout: bool) -> Any:
    from transformers import BertConfig

    p = {} if dropout else {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    return BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=2 * SEQ,
        type_vocab_size=2,
        num_labels=N_LABELS,
        pad_token_id=PAD,
        attn_implementation="eager",
        **p,
    )


def _gpt2_config(dropout: bool) -> Any:
    from transformers import GPT2Config

    p = {} if dropout else {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    return GPT2Config(
        vocab_size=VOCAB,
        n_embd=16,
        n_layer=1,
        n_head=2,
        n_positions=2 * SEQ,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=PAD,
        attn_implementation="eager",
        **p,
    )


def _t5_config() -> Any:
    from transformers import T5Config

    return T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, dropout_rate=0.0,
        decoder_start_token_id=PAD, pad_token_id=PAD, eos_token_id=1,
    )  # fmt: skip


def _bart_config() -> Any:
    from transformers import BartConfig

    return BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=2 * SEQ,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=PAD, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
    )  # fmt: skip


def _roberta_config() -> Any:
    from transformers import RobertaConfig

    return RobertaConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=2 * SEQ + 2, pad_token_id=1, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="eager",
    )  # fmt: skip


def _distilbert_config() -> Any:
    from transformers import DistilBertConfig

    return DistilBertConfig(
        vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2, hidden_dim=32, max_position_embeddings=2 * SEQ,
        num_labels=N_LABELS, dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0, pad_token_id=PAD,
    )  # fmt: skip


def build_model(task: str, dropout: bool = False, seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    """A freshly initialised tiny model for ``task`` (seeded; float64 unless ``dtype`` says otherwise)."""
    import transformers

    builders: dict[str, Callable[[], nn.Module]] = {
        "masked_lm": lambda: transformers.BertForMaskedLM(_bert_config(dropout)),
        "causal_lm": lambda: transformers.GPT2LMHeadModel(_gpt2_config(dropout)),
        "token_classification": lambda: transformers.BertForTokenClassification(_bert_config(dropout)),
        "sequence_classification": lambda: transformers.BertForSequenceClassification(_bert_config(dropout)),
        "pretraining": lambda: transformers.BertForPreTraining(_bert_config(dropout)),
        "t5": lambda: transformers.T5ForConditionalGeneration(_t5_config()),
        "bart": lambda: transformers.BartForConditionalGeneration(_bart_config()),
        "roberta_masked_lm": lambda: transformers.RobertaForMaskedLM(_roberta_config()),
        "distilbert_sequence_classification": lambda: transformers.DistilBertForSequenceClassification(
            _distilbert_config()
        ),
    }
    torch.manual_seed(seed)
    return builders[task]().to(dtype)


class PaddedTokens(Dataset):
    """``n`` samples for ``task``, each padded to :data:`SEQ`, with per-sample lengths and label counts that vary."""

    def __init__(self, task: str, n: int, seed: int = 0, natural: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(3, SEQ + 1, (n,), generator=g)
        if not natural:
            lengths[:2] = torch.tensor([SEQ, 4])  # the first shard of every split holds rows of unequal length
        valid = torch.arange(SEQ)[None, :] < lengths[:, None]
        ids = torch.randint(3, VOCAB, (n, SEQ), generator=g)
        self.items: dict[str, torch.Tensor] = {
            "input_ids": torch.where(valid, ids, PAD),
            "attention_mask": valid.long(),
        }
        if task in ("masked_lm", "pretraining", "roberta_masked_lm"):
            chosen = (torch.rand(n, SEQ, generator=g) < 0.3) & valid
            chosen[:, 0] = True  # at least one label per sample; counts still vary
            self.items["labels"] = torch.where(chosen, ids, IGNORE)
            self.items["input_ids"] = torch.where(chosen, 2, self.items["input_ids"])  # [MASK] = 2
            if task == "pretraining":
                self.items["next_sentence_label"] = torch.randint(0, 2, (n,), generator=g)
        elif task == "causal_lm":
            self.items["labels"] = torch.where(valid, ids, IGNORE)  # the model shifts them by one position
        elif task == "token_classification":
            self.items["labels"] = torch.where(valid, torch.randint(0, N_LABELS, (n, SEQ), generator=g), IGNORE)
        elif task == "sequence_classification":
            self.items["labels"] = torch.randint(0, N_LABELS, (n,), generator=g)
        elif task == "distilbert_sequence_classification":  # some samples unlabelled (-100): ignored by the loss
            labels = torch.randint(0, N_LABELS, (n,), generator=g)
            self.items["labels"] = torch.where(torch.rand(n, generator=g) < 0.3, IGNORE, labels)
        elif task in ("t5", "bart"):  # decoder targets of per-sample lengths, padded with -100
            target_lengths = torch.randint(1, SEQ // 2 + 1, (n,), generator=g)
            target = torch.randint(3, VOCAB, (n, SEQ // 2), generator=g)
            self.items["labels"] = torch.where(
                torch.arange(SEQ // 2)[None, :] < target_lengths[:, None], target, IGNORE
            )
        else:
            raise ValueError(task)

    def __len__(self) -> int:
        return len(self.items["input_ids"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.items.items()}


def token_loader(task: str, batch_size: int, steps: int = STEPS, seed: int = 0, natural: bool = False) -> DataLoader:
    """Exactly ``steps`` full batches of ``batch_size`` (``natural``: lengths as drawn, nothing arranged)."""
    data = PaddedTokens(task, batch_size * steps, seed, natural)
    return DataLoader(data, batch_size=batch_size, shuffle=False)


def make_hf_module(ns: ModuleType, task: str, style: str = "model", dropout: bool = False, lr: float = 0.5, **kw: Any):
    """A LightningModule of namespace ``ns`` (``lightning.pytorch`` or ``pytorch_lightning``) around a tiny model.

    ``style="model"``: ``training_step`` returns ``self.model(**batch).loss`` (what users write);
    ``style="forward"``: ``forward`` calls the model and the step returns ``self(**batch).loss`` (what ``dp`` needs).
    """

    class HFModule(ns.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(task, dropout=dropout, **kw)

        def forward(self, **batch: torch.Tensor) -> Any:
            return self.model(**batch)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            out = self(**batch) if style == "forward" else self.model(**batch)
            self.log("loss", out.loss, on_step=True, on_epoch=True)
            return out.loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=lr)

    HFModule.__name__ = HFModule.__qualname__ = f"HF_{task}_{style}"
    return HFModule()


# --- a small MLP with a loss chosen by name --------------------------------------------------------------------------
N_IN, N_OUT = 5, 3
#: Forward calls of every MLP, replicas included (the experiment's cost is counted with it).
FORWARD_CALLS = {"n": 0}


def _median_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none").median()  # no weighting of shard losses reproduces a median


MLP_LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "handwritten_sum": lambda out, y: ((out - y) ** 2).sum(),
    "mse_sum": nn.MSELoss(reduction="sum"),
    "ce_sum": lambda out, y: F.cross_entropy(out, y, reduction="sum"),
    "ce_mean": F.cross_entropy,
    "ce_ignore_index": lambda out, y: F.cross_entropy(out, y, ignore_index=IGNORE),
    "median": _median_loss,
    "clamped": lambda out, y: F.cross_entropy(out, y).clamp(max=1e3),  # a node the reader does not know (Clamp)
    "squared": lambda out, y: F.cross_entropy(out, y) ** 2,  # a nonlinear function of the batch's mean
}
REGRESSION = ("handwritten_sum", "mse_sum")


def mlp_data(loss: str, n: int, seed: int = 0, ignored: slice | None = None) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_IN, generator=g, dtype=torch.float64)
    if loss in REGRESSION:
        y = torch.randn(n, N_OUT, generator=g, dtype=torch.float64)
    else:
        y = torch.randint(0, N_OUT, (n,), generator=g)
        if ignored is not None:
            y[ignored] = IGNORE
    return TensorDataset(x, y)


def mlp_loader(loss: str, batch_size: int, steps: int = STEPS, ignored: slice | None = None) -> DataLoader:
    return DataLoader(mlp_data(loss, batch_size * steps, ignored=ignored), batch_size=batch_size, shuffle=False)


def make_mlp(ns: ModuleType, loss: str, lr: float = 0.05, output: str = "loss", seed: int = 0):
    """An MLP (no dropout, no BatchNorm) trained on ``MLP_LOSSES[loss]``, logging the loss as ``"loss"``.

    ``output="loss_weight"`` returns ``{"loss", "loss_weight"}`` with the sample count.
    """

    class MLP(ns.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(N_IN, 8), nn.Tanh(), nn.Linear(8, N_OUT))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            FORWARD_CALLS["n"] += 1
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            value = MLP_LOSSES[loss](self(x), y)
            self.log("loss", value, on_step=True, on_epoch=True)
            if output == "loss_weight":
                return {"loss": value, "loss_weight": len(x)}
            return value

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=lr)

    MLP.__name__ = MLP.__qualname__ = f"MLP_{loss}"
    torch.manual_seed(seed)
    return MLP().to(torch.float64)


# --- fitting and what a run leaves behind ----------------------------------------------------------------------------
@dataclass
class Run:
    params: torch.Tensor
    losses: list[float]  # the combined loss the optimizer stepped on, per step
    logged: list[dict[str, float]]  # trainer.callback_metrics after each step
    final: dict[str, float]  # trainer.callback_metrics after fit
    warnings: list[str]
    info: list[str]
    module: Any
    trainer: Any

    def normalisation_warnings(self) -> list[str]:
        return [w for w in self.warnings if "normalised" in w or "loss_reduction" in w]

    def unreplicated_warnings(self) -> list[str]:
        return [w for w in self.warnings if "ran on one device" in w]

    def decisions(self) -> list[str]:
        return [m for m in self.info if "combined accordingly" in m]


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def captured_info(logger_name: str) -> Iterator[list[str]]:
    """INFO records of ``logger_name`` (tests/conftest.py sets Lightning's loggers to ERROR; raised here, restored)."""
    logger = logging.getLogger(logger_name)
    handler, level = _ListHandler(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _recorder(ns: ModuleType) -> Any:
    class Recorder(ns.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.logged: list[dict[str, float]] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            loss = outputs["loss"] if isinstance(outputs, Mapping) else outputs
            self.losses.append(float(loss))
            self.logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    return Recorder()


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().double() for p in module.parameters()])


def fit(module: Any, strategy: Any, devices: int, loader: DataLoader, root: Any, ns: ModuleType = L, **kw: Any) -> Run:
    """Fit ``STEPS`` steps with Lightning's default callbacks (checkpointing into ``root``, progress bar, summary)."""
    recorder = _recorder(ns)
    trainer = ns.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        default_root_dir=str(root),
        callbacks=[recorder],
        **kw,
    )
    with captured_info(ns.__name__) as info, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader)
    assert trainer.global_step == STEPS
    return Run(
        params=flat_params(module),
        losses=recorder.losses,
        logged=recorder.logged,
        final={k: float(v) for k, v in trainer.callback_metrics.items()},
        warnings=[str(w.message) for w in caught],
        info=list(info),
        module=module,
        trainer=trainer,
    )


def assert_equal_runs(got: Run, expected: Run, atol: float = 1e-10, rtol: float = 0.0) -> None:
    """Same final parameters, same per-step optimized losses, same logged values (per step and at the end)."""
    torch.testing.assert_close(got.params, expected.params, rtol=rtol, atol=atol)
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(expected.losses), rtol=rtol, atol=atol)
    assert len(got.logged) == len(expected.logged) == STEPS
    for step, (g, e) in enumerate(zip(got.logged, expected.logged, strict=True)):
        assert g.keys() == e.keys(), step
        for name in e:
            assert abs(g[name] - e[name]) <= atol + rtol * abs(e[name]), (step, name, g[name], e[name])
    assert got.final.keys() == expected.final.keys()
    for name in expected.final:
        assert abs(got.final[name] - expected.final[name]) <= atol + rtol * abs(expected.final[name]), name
