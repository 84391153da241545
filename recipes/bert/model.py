"""BERT for pretraining (MLM + NSP) as a plain ``nn.Module``: no Lightning here.

The encoder is ``transformers``' ``BertModel`` (with its tanh pooler for NSP). The MLM head — BERT's
dense + GELU + LayerNorm transform followed by the vocabulary decoder, tied to the word embeddings by default — runs
**only on the masked positions** by default: the hidden states are selected with the label mask *before* the head,
so the ``batch × seq × vocab`` logits tensor (1.2 GiB in fp32 at batch 64, seq 163, vocab 30522; half of the model's
FLOPs) never exists; only ``n_masked × vocab`` does (~15% of it). ``full_logits=True`` computes every position, as
``BertForPreTraining`` does (for the equivalence test and the benchmark); the loss is identical.

``forward`` returns a :class:`BertPretrainingOutput` whose tensors all have dim 0 = batch or = masked-token count,
so a data-parallel gather (concatenating replica outputs along dim 0, in order) yields exactly what the model returns
on the whole batch: the selected logits and the selected labels stay aligned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn
from transformers import BertConfig, BertModel

from recipes.bert.masking import IGNORE_INDEX


@dataclass
class BertPretrainingOutput:
    """Model outputs.

    ``mlm_logits``: ``(n_masked, vocab)`` (masked-only head) or ``(batch, seq, vocab)`` (full logits, or no labels).
    ``mlm_labels``: the targets aligned with ``mlm_logits`` rows: ``(n_masked,)`` or ``(batch, seq)`` with -100 at
    unselected positions; None when no labels were given. ``nsp_logits``: ``(batch, 2)``.
    """

    mlm_logits: Tensor
    nsp_logits: Tensor
    mlm_labels: Tensor | None = None


class MaskedLMHead(nn.Module):
    """BERT's MLM head: dense + GELU + LayerNorm, then a decoder to the vocabulary (weight tied by the owner)."""

    def __init__(self, hidden_size: int, vocab_size: int, layer_norm_eps: float = 1e-12) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.activation = nn.GELU()
        self.layer_norm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.decoder = nn.Linear(hidden_size, vocab_size)

    def forward(self, hidden_states: Tensor) -> Tensor:
        """Logits over the vocabulary for each row (any leading shape)."""
        return self.decoder(self.layer_norm(self.activation(self.dense(hidden_states))))


class BertPretrainingModel(nn.Module):
    """BERT encoder + masked-only MLM head + NSP head (see the module docstring).

    Defaults are the seed article's small BERT: 8 layers, 8 heads, hidden 256, FFN 1024, 512 positions.
    """

    def __init__(
        self,
        vocab_size: int = 30522,
        hidden_size: int = 256,
        num_layers: int = 8,
        num_heads: int = 8,
        intermediate_size: int = 1024,
        max_position_embeddings: int = 512,
        type_vocab_size: int = 2,
        dropout: float = 0.1,
        attention_dropout: float = 0.1,
        tie_word_embeddings: bool = True,
        full_logits: bool = False,
        pad_token_id: int = 0,
        initializer_range: float = 0.02,
        layer_norm_eps: float = 1e-12,
        attn_implementation: str | None = "sdpa",
    ) -> None:
        super().__init__()
        self.config = BertConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            intermediate_size=intermediate_size,
            max_position_embeddings=max_position_embeddings,
            type_vocab_size=type_vocab_size,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=attention_dropout,
            pad_token_id=pad_token_id,
            initializer_range=initializer_range,
            layer_norm_eps=layer_norm_eps,
            tie_word_embeddings=tie_word_embeddings,
        )
        if attn_implementation is not None:
            self.config._attn_implementation = attn_implementation
        self.full_logits = full_logits
        self.bert = BertModel(self.config, add_pooling_layer=True)
        self.mlm_head = MaskedLMHead(hidden_size, vocab_size, layer_norm_eps)
        self.nsp_head = nn.Linear(hidden_size, 2)
        for module in (self.mlm_head, self.nsp_head):
            module.apply(self._init_weights)
        if tie_word_embeddings:
            self.mlm_head.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def _init_weights(self, module: nn.Module) -> None:
        """BERT's initialisation: N(0, initializer_range) weights, zero biases, unit LayerNorm."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> BertPretrainingOutput:
        """Encode and apply the heads.

        With ``labels`` (``-100`` = not selected) and ``full_logits`` False, the MLM head runs only on the selected
        positions, taken in row-major order (the order of ``labels[labels != -100]``).
        """
        encoded = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        nsp_logits = self.nsp_head(encoded.pooler_output)
        hidden = encoded.last_hidden_state
        if labels is None or self.full_logits:
            return BertPretrainingOutput(self.mlm_head(hidden), nsp_logits, labels)
        selected = labels != IGNORE_INDEX
        return BertPretrainingOutput(self.mlm_head(hidden[selected]), nsp_logits, labels[selected])


def masked_lm_loss(logits: Tensor, labels: Tensor) -> tuple[Tensor, int]:
    """Cross-entropy averaged over the selected (label != -100) tokens, and their count.

    Works for both heads (``(n, V)`` with ``(n,)`` labels, or ``(B, L, V)`` with ``(B, L)``). With no selected token
    the loss is a graph-connected 0, not NaN, so a data-parallel replica whose shard has no masked token contributes
    nothing (its weight, the count, is 0 too).
    """
    vocab = logits.shape[-1]
    flat_logits, flat_labels = logits.reshape(-1, vocab), labels.reshape(-1)
    if flat_logits.shape[0] != flat_labels.shape[0]:
        raise ValueError(f"MLM logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not align")
    count = int((flat_labels != IGNORE_INDEX).sum())
    total = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / max(count, 1), count


def next_sentence_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy over sequences. Both labels count (no ``ignore_index``): the seed implementation's single
    ``NLLLoss(ignore_index=0)`` silently dropped every "IsNext" example, and its NSP never learned."""
    return F.cross_entropy(logits, labels)


def pretraining_loss(output: BertPretrainingOutput, nsp_labels: Tensor) -> dict[str, Tensor | int]:
    """Both losses and their sum: ``{"loss", "mlm_loss", "nsp_loss", "n_masked", "n_sequences"}``."""
    if output.mlm_labels is None:
        raise ValueError("the model was called without labels: no MLM loss")
    mlm, n_masked = masked_lm_loss(output.mlm_logits, output.mlm_labels)
    nsp = next_sentence_loss(output.nsp_logits, nsp_labels)
    return {"loss": mlm + nsp, "mlm_loss": mlm, "nsp_loss": nsp, "n_masked": n_masked, "n_sequences": len(nsp_labels)}


__all__ = [
    "BertPretrainingModel",
    "BertPretrainingOutput",
    "MaskedLMHead",
    "masked_lm_loss",
    "next_sentence_loss",
    "pretraining_loss",
]
