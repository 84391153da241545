"""Dynamic MLM masking in the batch collator (new masks every time a batch is built, so every epoch).

Selection follows BERT: each non-special, non-padding token is selected with probability ``mlm_probability`` (15%);
a selected token becomes ``[MASK]`` with probability ``mask_ratio`` (80%), a random *non-special* token with
probability ``random_ratio`` (10%) and stays unchanged otherwise (10%). Labels are the original ids at selected
positions and ``-100`` elsewhere. ``transformers``' ``DataCollatorForLanguageModeling`` draws random replacements
from the whole vocabulary, special tokens included; this one never does.

Validation needs the opposite of dynamic masking: the same masks at every validation run, whatever the batching and
the number of ``DataLoader`` workers. A collator given a ``seed`` masks each example with its own generator seeded
from ``(seed, example["index"])``, so an example's mask depends on nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
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


def example_generator(seed: int, index: int) -> torch.Generator:
    """A generator for example ``index`` under ``seed``: statistically independent streams for distinct pairs.

    ``SeedSequence`` hashes the pair (``seed + index`` would give example ``i`` under seed ``s + 1`` the stream of
    example ``i + 1`` under ``s``); 32 bits, because the CPU generator's Mersenne Twister uses only those.
    """
    if seed < 0 or index < 0:
        raise ValueError(f"seed and example index must be >= 0, got seed={seed}, index={index}")
    state = np.random.SeedSequence([seed, index]).generate_state(1, dtype=np.uint32)[0]
    return torch.Generator().manual_seed(int(state))


def non_special_ids(vocab_size: int, special_ids: Sequence[int]) -> Tensor:
    """All ids in ``range(vocab_size)`` except ``special_ids``: the pool random replacements are drawn from."""
    keep = torch.ones(vocab_size, dtype=torch.bool)
    keep[torch.tensor(list(special_ids), dtype=torch.long)] = False
    return torch.arange(vocab_size)[keep]


class PretrainingCollator:
    """Pad NSP pair examples into a batch and mask it.

    Each example is a dict with ``input_ids`` and ``token_type_ids`` (lists of ints, ``[CLS] A [SEP] B [SEP]``),
    ``next_sentence_label`` (int) and, for a collator with a ``seed``, ``index`` (the example's dataset index). The
    batch is a dict of tensors, all with the batch on dim 0 (what the single-process strategies split): ``input_ids``,
    ``token_type_ids``, ``attention_mask``, ``labels`` (MLM targets, ``-100`` where not selected) and
    ``next_sentence_label``.

    Sequences are padded to the longest in the batch, or to ``pad_to_length`` when given (fixed shapes, e.g. for
    benchmarks). Where the random draws come from:

    - by default, torch's global RNG (training: dynamic masking). Its state advances with every batch, so masks
      change every epoch; ``DataLoader`` seeds each worker's RNG differently (``base_seed + worker_id``), so workers
      do not repeat each other's masks; ``seed_everything`` makes the whole sequence reproducible.
    - ``seed``: each example is masked with :func:`example_generator` ``(seed, example["index"])`` (validation): its
      mask is the same at every pass, with any batch size, padding or number of workers.
    - ``generator``: one generator for the whole batch (reproducible from the generator's state; tests, benchmarks).
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
        seed: int | None = None,
    ) -> None:
        if generator is not None and seed is not None:
            raise ValueError("give the collator a generator (one per batch) or a seed (one per example), not both")
        if seed is not None and seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.pad_token_id = pad_token_id
        self.mask_token_id = mask_token_id
        self.special_ids = torch.tensor(sorted(set(special_ids) | {pad_token_id}), dtype=torch.long)
        self.replacement_ids = non_special_ids(vocab_size, self.special_ids.tolist())
        self.mlm_probability = mlm_probability
        self.mask_ratio = mask_ratio
        self.random_ratio = random_ratio
        self.pad_to_length = pad_to_length
        self.generator = generator
        self.seed = seed

    def _mask(self, input_ids: Tensor, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
        """``mask_tokens`` with this collator's settings; specials and padding are never selected."""
        return mask_tokens(
            input_ids,
            torch.isin(input_ids, self.special_ids),  # padding holds pad_token_id, one of special_ids
            mask_token_id=self.mask_token_id,
            replacement_ids=self.replacement_ids,
            mlm_probability=self.mlm_probability,
            mask_ratio=self.mask_ratio,
            random_ratio=self.random_ratio,
            generator=generator,
        )

    def _mask_each_example(
        self, input_ids: Tensor, lengths: Sequence[int], examples: Sequence[dict[str, Any]]
    ) -> tuple[Tensor, Tensor]:
        """Mask row by row, each row's unpadded tokens with the generator of ``(self.seed, example["index"])``."""
        assert self.seed is not None
        masked = input_ids.clone()
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        for row, (example, length) in enumerate(zip(examples, lengths, strict=True)):
            if "index" not in example:
                raise ValueError("a collator with a seed masks each example by its 'index': the examples lack one")
            generator = example_generator(self.seed, int(example["index"]))
            row_masked, row_labels = self._mask(input_ids[row : row + 1, :length], generator)
            masked[row, :length] = row_masked[0]
            labels[row, :length] = row_labels[0]
        return masked, labels

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
        if self.seed is None:
            masked, labels = self._mask(input_ids, self.generator)
        else:
            masked, labels = self._mask_each_example(input_ids, lengths, examples)
        return {
            "input_ids": masked,
            "token_type_ids": token_type_ids,
            "attention_mask": attention_mask,
            "labels": labels,
            "next_sentence_label": torch.tensor([int(e["next_sentence_label"]) for e in examples], dtype=torch.long),
        }
