"""Next-sentence-prediction pairs: which sentence is A, which is B, and the label.

Labels follow ``transformers`` (``BertForPreTraining``): 0 = B is the true next sentence, 1 = B is a random sentence.
For every sentence that has a successor in its document, a fair coin decides between the successor (label 0) and a
uniformly chosen sentence of a uniformly chosen *other* document (label 1; never the same document, unlike the
seed implementation, whose "random" line could be the true pair). Pairs are fixed by ``seed`` — identical on every
DDP rank — while masking stays dynamic (see ``masking``).

Negatives are drawn from the documents given, so build training and validation pairs separately (one call per
split, as the data module does): pairs built over the whole corpus would put held-out sentences into training pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

IS_NEXT = 0
NOT_NEXT = 1


@dataclass(frozen=True)
class SentencePairs:
    """Pairs as parallel arrays of global sentence indices (into the flattened corpus) and labels."""

    first: np.ndarray  # sentence A
    second: np.ndarray  # sentence B
    label: np.ndarray  # IS_NEXT / NOT_NEXT
    document: np.ndarray  # document of sentence A
    second_document: np.ndarray  # document of sentence B

    def __len__(self) -> int:
        return len(self.first)

    def subset(self, keep: np.ndarray) -> SentencePairs:
        """The pairs selected by a boolean mask or index array."""
        arrays = (self.first, self.second, self.label, self.document, self.second_document)
        return SentencePairs(*(a[keep] for a in arrays))


def build_nsp_pairs(
    sentences_per_document: Sequence[int], seed: int = 0, next_probability: float = 0.5
) -> SentencePairs:
    """Build one pair per sentence that has a successor in its document (see the module docstring).

    Sentence ``j`` of document ``d`` has global index ``offset[d] + j`` (documents laid out one after another).
    Needs at least two documents (negatives come from another one); no documents give no pairs (an empty split).
    """
    counts = np.asarray(sentences_per_document, dtype=np.int64)
    if counts.ndim != 1 or (counts < 1).any():
        raise ValueError("every document needs at least one sentence")
    if len(counts) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return SentencePairs(empty, empty, empty, empty, empty)
    if len(counts) < 2:
        raise ValueError(f"next-sentence pairs need at least 2 documents, got {len(counts)}")
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    rng = np.random.default_rng(seed)

    pairs_per_doc = counts - 1
    document = np.repeat(np.arange(len(counts)), pairs_per_doc)
    position = np.arange(pairs_per_doc.sum()) - np.repeat(np.cumsum(pairs_per_doc) - pairs_per_doc, pairs_per_doc)
    first = starts[document] + position

    is_next = rng.random(len(first)) < next_probability
    other = rng.integers(0, len(counts) - 1, size=len(first))
    other = other + (other >= document)  # uniform over the other documents, never the same one
    random_sentence = starts[other] + np.floor(rng.random(len(first)) * counts[other]).astype(np.int64)

    second = np.where(is_next, first + 1, random_sentence)
    second_document = np.where(is_next, document, other)
    label = np.where(is_next, IS_NEXT, NOT_NEXT).astype(np.int64)
    return SentencePairs(first, second, label, document, second_document)


def truncate_pair_lengths(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """Longest-first truncation: the lengths after removing tokens one at a time from the longer of A and B
    (from B on a tie, as BERT's ``truncate_seq_pair``) until ``len_a + len_b <= budget``. Closed form, O(1)."""
    if budget < 0:
        raise ValueError("budget must be >= 0")
    excess = len_a + len_b - budget
    if excess <= 0:
        return len_a, len_b
    if len_a > len_b:
        cut = min(excess, len_a - len_b)
        len_a, excess = len_a - cut, excess - cut
    else:
        cut = min(excess, len_b - len_a)
        len_b, excess = len_b - cut, excess - cut
    # Now equal (or done): alternate, B first.
    return len_a - excess // 2, len_b - (excess - excess // 2)
