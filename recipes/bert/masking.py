"""Dynamic MLM masking in the batch collator (new masks every time a batch is built, so every epoch).

Selection follows BERT: each non-special, non-padding token is selected with probability ``mlm_probability`` (15%);
a selected token becomes ``[MASK]`` with probability ``mask_ratio`` (80%), a random *non-special* token with
probability ``random_ratio`` (10%) and stays unchanged otherwise (10%). Labels are the original ids at selected
positions and ``-100`` elsewhere. ``transformers``' ``DataCollatorForLanguageModeling`` draws random replacements
from the whole vocabulary, special tokens included; this one never does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

IGNORE_INDEX = -100


def mask_tokens(
    input_ids: Tensor,
    special_tokens_mask: Tensor,
    *,
    mask_token_id: int,
    replacement_ids: Tensor,
    mlm_probability: float = 0.15,
    mask_ratio: float = 0.8,
    random_ratio: float = 0.1,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Return ``(masked_input_ids, labels)``; ``input_ids`` is not modified.

    ``special_tokens_mask`` is True where a token must never be selected (special tokens and padding);
    ``replacement_ids`` is the 1-D tensor of ids a random replacement is drawn from (the non-special vocabulary).
    """
    if not 0.0 <= mlm_probability <= 1.0 or mask_ratio < 0 or random_ratio < 0 or mask_ratio + random_ratio > 1:
        raise ValueError("need mlm_probability in [0, 1], mask_ratio >= 0, random_ratio >= 0, their sum <= 1")
    if replacement_ids.numel() == 0:
        raise ValueError("replacement_ids is empty: the vocabulary has no non-special token")
    device = input_ids.device
    probability = torch.full(input_ids.shape, mlm_probability, device=device)
    probability.masked_fill_(special_tokens_mask, 0.0)
    selected = torch.bernoulli(probability, generator=generator).bool()
    labels = input_ids.masked_fill(~selected, IGNORE_INDEX)

    # One uniform draw per token splits the selected ones into [MASK] / random / unchanged.
    u = torch.rand(input_ids.shape, generator=generator, device=device)
    to_mask = selected & (u < mask_ratio)
    to_random = selected & (u >= mask_ratio) & (u < mask_ratio + random_ratio)
    random_tokens = replacement_ids.to(device)[
        torch.randint(replacement_ids.numel(), input_ids.shape, generator=generator, device=device)
    ]
    masked = input_ids.masked_fill(to_mask, mask_token_id)
    masked = torch.where(to_random, random_tokens, masked)
    return masked, labels


def non_special_ids(vocab_size: int, special_ids: Sequence[int]) -> Tensor:
    """All ids in ``range(vocab_size)`` except ``special_ids``: the pool random replacements are drawn from."""
    keep = torch.ones(vocab_size, dtype=torch.bool)
    keep[torch.tensor(list(special_ids), dtype=torch.long)] = False
    return torch.arange(vocab_size)[keep]


class PretrainingCollator:
    """Pad NSP pair examples into a batch and mask it.

    Each example is a dict with ``input_ids`` and ``token_type_ids`` (lists of ints, ``[CLS] A [SEP] B [SEP]``) and
    ``next_sentence_label`` (int). The batch is a dict of tensors, all with the batch on dim 0 (what the
    single-process strategies split): ``input_ids``, ``token_type_ids``, ``attention_mask``, ``labels`` (MLM targets,
    ``-100`` where not selected) and ``next_sentence_label``.

    Sequences are padded to the longest in the batch, or to ``pad_to_length`` when given (fixed shapes, e.g. for
    benchmarks). ``generator`` makes the masks reproducible (validation); by default torch's global RNG is used
    (seeded by ``seed_everything``; ``DataLoader`` seeds its workers from it), whose state advances with every batch,
    so training masks change every epoch.
    """

    def __init__(
        self,
        vocab_size: int,
        pad_token_id: int,
        mask_token_id: int,
        special_ids: Sequence[int],
        mlm_probability: float = 0.15,
        mask_ratio: float = 0.8,
        random_ratio: float = 0.1,
        pad_to_length: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self.pad_token_id = pad_token_id
        self.mask_token_id = mask_token_id
        self.special_ids = torch.tensor(sorted(set(special_ids) | {pad_token_id}), dtype=torch.long)
        self.replacement_ids = non_special_ids(vocab_size, self.special_ids.tolist())
        self.mlm_probability = mlm_probability
        self.mask_ratio = mask_ratio
        self.random_ratio = random_ratio
        self.pad_to_length = pad_to_length
        self.generator = generator

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, Tensor]:
        """Build the batch (see the class docstring)."""
        if not examples:
            raise ValueError("cannot collate an empty list of examples")
        lengths = [len(e["input_ids"]) for e in examples]
        width = max(lengths)
        if self.pad_to_length is not None:
            if width > self.pad_to_length:
                raise ValueError(f"example of length {width} exceeds pad_to_length={self.pad_to_length}")
            width = self.pad_to_length
        batch = len(examples)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        token_type_ids = torch.zeros((batch, width), dtype=torch.long)
        for row, (example, length) in enumerate(zip(examples, lengths, strict=True)):
            input_ids[row, :length] = torch.as_tensor(example["input_ids"], dtype=torch.long)
            token_type_ids[row, :length] = torch.as_tensor(example["token_type_ids"], dtype=torch.long)
        attention_mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).long()
        masked, labels = mask_tokens(
            input_ids,
            torch.isin(input_ids, self.special_ids),  # padding holds pad_token_id, one of special_ids
            mask_token_id=self.mask_token_id,
            replacement_ids=self.replacement_ids,
            mlm_probability=self.mlm_probability,
            mask_ratio=self.mask_ratio,
            random_ratio=self.random_ratio,
            generator=self.generator,
        )
        return {
            "input_ids": masked,
            "token_type_ids": token_type_ids,
            "attention_mask": attention_mask,
            "labels": labels,
            "next_sentence_label": torch.tensor([int(e["next_sentence_label"]) for e in examples], dtype=torch.long),
        }
