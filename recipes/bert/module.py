"""``BertPretrainingModule``: the LightningModule of the small-BERT recipe (MLM + NSP).

Strategy compatibility (single device, ``ddp``, and this package's ``dp`` and ``parallel_criterion``):

- Model outputs always come from ``self(...)`` (so ``dp`` can replicate ``forward``) and the losses are computed from
  those outputs outside ``forward`` (on the gathered outputs under ``dp``).
- A step returns ``{"loss", "loss_terms"}``: ``loss_terms = {"mlm": (mlm_loss, n_masked), "nsp": (nsp_loss,
  batch)}``. ``parallel_criterion`` reduces each term with its own weights and sums them, which equals the
  single-device loss exactly (the MLM term is a mean over masked tokens, the NSP term a mean over sequences, so one
  sample-weighted mean of the totals would not be). ``loss`` is their sum, used by single-device and ``ddp``.
- Per-step term losses are logged with ``batch_size`` = their own weight (masked tokens / sequences), so the
  single-process strategies' weighted merge of replica logs gives the single-device value. The **total** training loss
  is logged in ``on_train_batch_end`` from ``outputs["loss"]``, which runs on the root with the already-reduced loss
  under every strategy (exact, not sample-weighted).
- Everything logged per epoch is a ``torchmetrics`` metric (see ``metrics.py``), updated in the steps and logged *as a
  metric object* from the steps, so Lightning computes, synchronises (under DDP) and resets it at epoch end: the term
  losses (``MeanMetric`` weighted by masked tokens / sequences), accuracies, perplexity (exp of the epoch's
  token-weighted MLM loss) and the validation/test loss (MLM mean + NSP mean). Two reasons:

  - No hook computes a metric or issues a collective itself. Under DDP every rank must call the same collectives in
    the same order, and Lightning's progress bar syncs the epoch values on global rank 0 alone, before the module's
    epoch-end hooks run (Lightning issues #21264, #19604): a ``compute()`` in ``on_train_epoch_end`` deadlocked the
    ``ddp`` overlay.
  - Lightning's own epoch mean of a logged tensor with ``batch_size`` and ``sync_dist=True`` is inflated under DDP
    when the ranks' summed batch sizes differ (it mean-reduces an integer count, which floors; Lightning #21859), and
    masked-token counts always differ. The metrics' sums of weights are synchronised exactly.
Optimiser: AdamW, no weight decay on biases and LayerNorm weights (every parameter with fewer than 2 dims). Schedules:
``linear`` (warmup, then linear decay to 0 at the last step), ``noam`` (the seed implementation's
``hidden^-0.5 · min(step^-0.5, step · warmup^-1.5)``, which replaces ``learning_rate`` as the seed did) or ``constant``
(warmup, then flat).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from recipes.bert.masking import IGNORE_INDEX
from recipes.bert.metrics import Perplexity, SumOfMeans
from recipes.bert.model import BertPretrainingModel, BertPretrainingOutput, pretraining_loss

Schedule = Literal["linear", "noam", "constant"]


class WarmupSchedule:
    """LR multiplier for ``LambdaLR`` (a class, not a lambda, so the scheduler's state pickles into checkpoints).

    ``step`` is the number of optimiser steps taken so far (LambdaLR's ``last_epoch``); the learning rate used for
    step ``s`` (0-based) is ``base_lr * self(s)``. ``noam`` counts steps from 1, as the seed did.
    """

    def __init__(self, kind: Schedule, warmup_steps: int, total_steps: int | None = None, hidden_size: int = 256):
        if kind not in ("linear", "noam", "constant"):
            raise ValueError(f"unknown schedule {kind!r}: use 'linear', 'noam' or 'constant'")
        if kind == "linear" and total_steps is None:
            raise ValueError("the linear schedule needs the total number of steps")
        self.kind = kind
        self.warmup_steps = max(0, int(warmup_steps))
        self.total_steps = total_steps
        self.hidden_size = hidden_size

    def __call__(self, step: int) -> float:
        if self.kind == "noam":
            s = step + 1
            warmup = max(1, self.warmup_steps)
            return self.hidden_size**-0.5 * min(s**-0.5, s * warmup**-1.5)
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.kind == "constant":
            return 1.0
        assert self.total_steps is not None
        return max(0.0, (self.total_steps - step) / max(1, self.total_steps - self.warmup_steps))


class BertPretrainingModule(pl.LightningModule):
    """Small BERT pretrained with MLM + NSP (see the module docstring for losses, logging and strategies).

    Args:
        vocab_size: embedding/decoder size; must be >= the tokenizer's vocabulary (checked in ``setup``).
        hidden_size, num_layers, num_heads, intermediate_size, max_position_embeddings: the encoder
            (``max_position_embeddings`` must be >= the datamodule's ``max_seq_length``; checked in ``setup``).
        dropout, attention_dropout: BERT's dropout probabilities.
        tie_word_embeddings: the MLM decoder shares the word-embedding matrix.
        full_logits: compute MLM logits at every position (as ``BertForPreTraining``) instead of the masked ones.
        learning_rate, weight_decay, betas, adam_eps: AdamW (``learning_rate`` is ignored by ``noam``).
        schedule: ``linear`` | ``noam`` | ``constant``.
        warmup_steps: steps of warmup; a value below 1 is a fraction of the total steps.
        total_steps: steps of the linear decay (default: the trainer's estimate for the whole fit).
        attn_implementation: ``transformers`` attention backend (``sdpa``, ``eager``, ...).
    """

    def __init__(
        self,
        vocab_size: int = 30522,
        hidden_size: int = 256,
        num_layers: int = 8,
        num_heads: int = 8,
        intermediate_size: int = 1024,
        max_position_embeddings: int = 512,
        dropout: float = 0.1,
        attention_dropout: float = 0.1,
        tie_word_embeddings: bool = True,
        full_logits: bool = False,
        learning_rate: float = 1e-4,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-6,
        schedule: Schedule = "linear",
        warmup_steps: float = 0.1,
        total_steps: int | None = None,
        attn_implementation: str | None = "sdpa",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = BertPretrainingModel(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            intermediate_size=intermediate_size,
            max_position_embeddings=max_position_embeddings,
            dropout=dropout,
            attention_dropout=attention_dropout,
            tie_word_embeddings=tie_word_embeddings,
            full_logits=full_logits,
            attn_implementation=attn_implementation,
        )
        for stage in ("train", "val", "test"):
            setattr(self, f"{stage}_mlm_acc", MulticlassAccuracy(vocab_size, average="micro", validate_args=False))
            setattr(self, f"{stage}_nsp_acc", MulticlassAccuracy(2, average="micro", validate_args=False))
            setattr(self, f"{stage}_mlm_loss", MeanMetric())
            setattr(self, f"{stage}_nsp_loss", MeanMetric())
            setattr(self, f"{stage}_perplexity", Perplexity())
            if stage != "train":  # train/loss is logged per step and per epoch from the strategy-reduced loss
                setattr(self, f"{stage}_epoch_loss", SumOfMeans(num_terms=2))

    # ------------------------------------------------------------------------------------------------ model
    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> BertPretrainingOutput:
        """The model's outputs (masked-position MLM logits when ``labels`` are given); see ``BertPretrainingModel``."""
        return self.model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, labels=labels)

    def setup(self, stage: str) -> None:
        """Check that the datamodule's data fits the model: clear errors instead of an index or shape error at step 1.

        The tokenizer's vocabulary must fit in the embedding table, and the datamodule's ``max_seq_length`` in the
        position embeddings.
        """
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        try:
            tokenizer_vocab = getattr(datamodule, "vocab_size", None)
        except RuntimeError:  # a datamodule whose tokenizer is not loaded yet: nothing to check
            tokenizer_vocab = None
        if isinstance(tokenizer_vocab, int) and tokenizer_vocab > self.hparams.vocab_size:
            raise ValueError(
                f"the tokenizer has {tokenizer_vocab} tokens but the model's vocab_size is {self.hparams.vocab_size}:"
                " set model.init_args.vocab_size to at least the tokenizer's size"
            )
        max_seq_length = getattr(getattr(datamodule, "hparams", None), "max_seq_length", None)
        positions = self.hparams.max_position_embeddings
        if isinstance(max_seq_length, int) and max_seq_length > positions:
            raise ValueError(
                f"the data's max_seq_length ({max_seq_length}) exceeds the model's max_position_embeddings"
                f" ({positions}): set data.init_args.max_seq_length to at most {positions} or"
                f" model.init_args.max_position_embeddings to at least {max_seq_length}"
            )

    # ------------------------------------------------------------------------------------------------ steps
    def _shared_step(self, batch: dict[str, Tensor], stage: str) -> dict[str, Any]:
        output = self(
            batch["input_ids"],
            attention_mask=batch.get("attention_mask"),
            token_type_ids=batch.get("token_type_ids"),
            labels=batch["labels"],
        )
        nsp_labels = batch["next_sentence_label"]
        losses = pretraining_loss(output, nsp_labels)
        mlm_loss, nsp_loss = losses["mlm_loss"], losses["nsp_loss"]
        n_masked, n_seq = losses["n_masked"], losses["n_sequences"]

        if n_masked > 0:  # torchmetrics rejects empty updates (a data-parallel shard may hold no masked token)
            # argmax before selecting: with full logits this copies (n_masked,) predictions, not (n_masked, vocab).
            mlm_preds, mlm_labels = output.mlm_logits.detach().argmax(-1), output.mlm_labels
            if mlm_preds.dim() == 2:  # full logits: (batch, seq)
                selected = mlm_labels != IGNORE_INDEX
                mlm_preds, mlm_labels = mlm_preds[selected], mlm_labels[selected]
            getattr(self, f"{stage}_mlm_acc").update(mlm_preds, mlm_labels)
            getattr(self, f"{stage}_mlm_loss").update(mlm_loss.detach(), weight=n_masked)
            getattr(self, f"{stage}_perplexity").update(mlm_loss.detach(), weight=n_masked)
        getattr(self, f"{stage}_nsp_acc").update(output.nsp_logits.detach().argmax(-1), nsp_labels)
        getattr(self, f"{stage}_nsp_loss").update(nsp_loss.detach(), weight=n_seq)

        on_step = stage == "train"
        if on_step:  # this batch's terms, weighted by masked tokens (0 for a shard without any) / sequences
            self.log(
                "train/mlm_loss_step",
                mlm_loss.detach(),
                batch_size=n_masked,
                on_step=True,
                on_epoch=False,
                sync_dist=True,
                prog_bar=True,
            )
            self.log(
                "train/nsp_loss_step", nsp_loss.detach(), batch_size=n_seq, on_step=True, on_epoch=False, sync_dist=True
            )
        epoch_suffix = "_epoch" if on_step else ""  # the names Lightning gives values logged per step and epoch
        self.log(f"{stage}/mlm_loss{epoch_suffix}", getattr(self, f"{stage}_mlm_loss"), on_step=False, on_epoch=True)
        self.log(f"{stage}/nsp_loss{epoch_suffix}", getattr(self, f"{stage}_nsp_loss"), on_step=False, on_epoch=True)
        self.log(
            f"{stage}/mlm_acc", getattr(self, f"{stage}_mlm_acc"), on_step=False, on_epoch=True, prog_bar=not on_step
        )
        self.log(
            f"{stage}/nsp_acc", getattr(self, f"{stage}_nsp_acc"), on_step=False, on_epoch=True, prog_bar=not on_step
        )
        self.log(f"{stage}/perplexity", getattr(self, f"{stage}_perplexity"), on_step=False, on_epoch=True)
        if not on_step:
            epoch_loss: SumOfMeans = getattr(self, f"{stage}_epoch_loss")
            epoch_loss.update([mlm_loss, nsp_loss], [n_masked, n_seq])
            self.log(f"{stage}/loss", epoch_loss, on_step=False, on_epoch=True, prog_bar=True)
        return {"loss": losses["loss"], "loss_terms": {"mlm": (mlm_loss, n_masked), "nsp": (nsp_loss, n_seq)}}

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Any]:
        """MLM + NSP loss on one batch; returns ``loss`` and the per-term ``loss_terms`` (see the module docstring)."""
        return self._shared_step(batch, "train")

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Any]:
        """Same losses and metrics as training, logged per epoch."""
        return self._shared_step(batch, "val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Any]:
        """Same losses and metrics as training, logged per epoch."""
        return self._shared_step(batch, "test")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Log the total training loss from the (strategy-reduced) ``outputs["loss"]`` on the root device."""
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None:
            loss = loss.detach() * self.trainer.accumulate_grad_batches  # Lightning hands over loss / accumulation
            self.log(
                "train/loss",
                loss,
                batch_size=len(batch["input_ids"]),
                on_step=True,
                on_epoch=True,
                sync_dist=True,
                prog_bar=True,
            )

    # ------------------------------------------------------------------------------------------------ optimiser
    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW (no decay on biases/LayerNorm) + a per-step ``LambdaLR`` schedule (see the module docstring)."""
        h = self.hparams
        decay = [p for p in self.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.ndim < 2]
        base_lr = 1.0 if h.schedule == "noam" else h.learning_rate
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": h.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=base_lr,
            betas=tuple(h.betas),
            eps=h.adam_eps,
        )
        total = h.total_steps
        warmup = h.warmup_steps
        if total is None and (h.schedule == "linear" or warmup < 1):
            estimate = self.trainer.estimated_stepping_batches
            if math.isfinite(estimate):
                total = int(estimate)
            elif h.schedule == "linear":
                raise ValueError("the linear schedule needs a finite run: set trainer.max_steps or model.total_steps")
        if warmup < 1:
            if total is None:
                raise ValueError("a fractional warmup_steps needs a finite run or model.total_steps")
            warmup = warmup * total
        schedule = WarmupSchedule(h.schedule, round(warmup), total, h.hidden_size)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
