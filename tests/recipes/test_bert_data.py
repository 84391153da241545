"""BERT recipe data: corpus reading, WordPiece tokenizer, NSP pairs, truncation and dynamic masking."""

from __future__ import annotations

import itertools
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never reach the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import numpy as np
import pytest
import torch

from recipes.bert.corpus import (
    read_text_documents,
    split_documents,
    synthetic_documents,
    write_documents,
    write_synthetic_corpus,
)
from recipes.bert.data import BertPretrainingDataModule
from recipes.bert.masking import IGNORE_INDEX, PretrainingCollator, mask_tokens, non_special_ids
from recipes.bert.pairs import IS_NEXT, NOT_NEXT, build_nsp_pairs, truncate_pair_lengths
from recipes.bert.tokenizer import (
    SPECIAL_TOKENS,
    load_or_train_tokenizer,
    load_tokenizer,
    special_token_ids,
    train_wordpiece,
)

PAD, UNK, CLS, SEP, MASK = range(5)
SPECIALS = (PAD, UNK, CLS, SEP, MASK)


# ------------------------------------------------------------------------------------------------------ masking
def _random_batch(rows: int, width: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[CLS] a [SEP] b [SEP] [PAD]... rows with random lengths; some [UNK]s inside; returns ids and special mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(len(SPECIALS), vocab, (rows, width), generator=g)
    ids[torch.rand(rows, width, generator=g) < 0.02] = UNK
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=g)
    for r, length in enumerate(lengths.tolist()):
        ids[r, 0] = CLS
        ids[r, length // 2] = SEP
        ids[r, length - 1] = SEP
        ids[r, length:] = PAD
    special = torch.isin(ids, torch.tensor(SPECIALS))
    return ids, special


def test_masking_statistics_over_many_tokens() -> None:
    vocab = 1000
    ids, special = _random_batch(rows=500, width=128, vocab=vocab, seed=0)
    masked, labels = mask_tokens(
        ids, special, mask_token_id=MASK, replacement_ids=non_special_ids(vocab, SPECIALS),
        generator=torch.Generator().manual_seed(1),
    )
    selected = labels != IGNORE_INDEX
    eligible = ~special
    assert eligible.sum() > 40_000
    # 15% of the eligible tokens are selected; specials ([UNK] included) and padding never are.
    assert abs(selected.sum().item() / eligible.sum().item() - 0.15) < 0.01
    assert not (selected & special).any()
    assert torch.equal(labels[selected], ids[selected])
    # Unselected tokens are untouched.
    assert torch.equal(masked[~selected], ids[~selected])
    # 80% [MASK], 10% random, 10% unchanged among the selected.
    n = selected.sum().item()
    to_mask = (masked == MASK) & selected
    changed = (masked != ids) & selected & ~to_mask
    kept = (masked == ids) & selected
    assert abs(to_mask.sum().item() / n - 0.8) < 0.02
    assert abs(changed.sum().item() / n - 0.1) < 0.02
    assert abs(kept.sum().item() / n - 0.1) < 0.02
    assert not torch.isin(masked[changed], torch.tensor(SPECIALS)).any()


def test_random_replacements_are_never_special() -> None:
    # A vocabulary of 5 specials + 3 ordinary tokens: drawing from the whole vocabulary would give a special 5/8 times.
    vocab = 8
    ids = torch.randint(5, vocab, (400, 50), generator=torch.Generator().manual_seed(0))
    special = torch.zeros_like(ids, dtype=torch.bool)
    masked, labels = mask_tokens(
        ids, special, mask_token_id=MASK, replacement_ids=non_special_ids(vocab, SPECIALS),
        mask_ratio=0.0, random_ratio=1.0, generator=torch.Generator().manual_seed(1),
    )
    replaced = masked[labels != IGNORE_INDEX]
    assert replaced.numel() > 2000
    assert set(replaced.unique().tolist()) == {5, 6, 7}


def test_collator_pads_masks_and_is_dynamic() -> None:
    examples = [
        {"input_ids": [CLS, 10, 11, SEP, 12, SEP], "token_type_ids": [0, 0, 0, 0, 1, 1], "next_sentence_label": 0},
        {"input_ids": [CLS, 13, SEP, 14, SEP], "token_type_ids": [0, 0, 0, 1, 1], "next_sentence_label": 1},
    ] * 64
    collate = PretrainingCollator(vocab_size=50, pad_token_id=PAD, mask_token_id=MASK, special_ids=SPECIALS)
    torch.manual_seed(0)
    first = collate(examples)
    assert first["input_ids"].shape == (128, 6)
    assert first["attention_mask"][1].tolist() == [1, 1, 1, 1, 1, 0]
    assert first["token_type_ids"][0].tolist() == [0, 0, 0, 0, 1, 1]
    assert first["next_sentence_label"][:2].tolist() == [0, 1]
    assert (first["input_ids"][1, 5] == PAD) and (first["labels"][1, 5] == IGNORE_INDEX)
    selected = first["labels"] != IGNORE_INDEX
    assert not selected[:, [0]].any() and not (selected & (first["attention_mask"] == 0)).any()
    second = collate(examples)  # a new batch of the same examples gets new masks (dynamic masking)
    assert not torch.equal(first["labels"], second["labels"])
    fixed = PretrainingCollator(vocab_size=50, pad_token_id=PAD, mask_token_id=MASK, special_ids=SPECIALS,
                                pad_to_length=8, generator=torch.Generator().manual_seed(3))
    again = PretrainingCollator(vocab_size=50, pad_token_id=PAD, mask_token_id=MASK, special_ids=SPECIALS,
                                pad_to_length=8, generator=torch.Generator().manual_seed(3))
    a, b = fixed(examples), again(examples)
    assert a["input_ids"].shape == (128, 8)
    assert torch.equal(a["labels"], b["labels"]) and torch.equal(a["input_ids"], b["input_ids"])


# ------------------------------------------------------------------------------------------------------ NSP pairs
def test_nsp_pairs_are_balanced_and_negatives_come_from_other_documents() -> None:
    rng = np.random.default_rng(0)
    counts = rng.integers(1, 12, size=600)
    pairs = build_nsp_pairs(counts, seed=3)
    assert len(pairs) == int((counts - 1).sum()) > 2500
    assert abs(pairs.label.mean() - 0.5) < 0.04
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    doc_of = np.searchsorted(starts, np.arange(counts.sum()), side="right") - 1
    assert np.array_equal(doc_of[pairs.first], pairs.document)
    assert np.array_equal(doc_of[pairs.second], pairs.second_document)
    pos = pairs.label == IS_NEXT
    assert np.array_equal(pairs.second[pos], pairs.first[pos] + 1)
    assert (pairs.second_document[pos] == pairs.document[pos]).all()
    neg = pairs.label == NOT_NEXT
    assert (pairs.second_document[neg] != pairs.document[neg]).all()
    # Negatives reach many documents (uniform over the others), and single-sentence documents serve as negatives.
    assert len(np.unique(pairs.second_document[neg])) > 400
    assert np.isin(np.flatnonzero(counts == 1), pairs.second_document[neg]).any()
    # Deterministic in the seed.
    assert np.array_equal(build_nsp_pairs(counts, seed=3).second, pairs.second)
    with pytest.raises(ValueError, match="at least 2 documents"):
        build_nsp_pairs([5], seed=0)


def test_longest_first_truncation_matches_the_reference_loop() -> None:
    def reference(a: int, b: int, budget: int) -> tuple[int, int]:
        while a + b > budget:
            if a > b:
                a -= 1
            else:
                b -= 1
        return a, b

    for a in range(0, 30, 3):
        for b in range(0, 30, 2):
            for budget in range(0, 45, 5):
                assert truncate_pair_lengths(a, b, budget) == reference(a, b, budget), (a, b, budget)


# ------------------------------------------------------------------------------------------------------ corpus
def test_text_loader_splits_documents(tmp_path: Path) -> None:
    first = tmp_path / "part1.txt"
    first.write_text("The cat sat.\n  It purred.  \n\n\n   \nA new document.\nSecond line.\nThird line.\n\n")
    second = tmp_path / "part2.txt"
    second.write_text("Other file, one sentence.\n")
    documents = read_text_documents([first, second], cache_dir=tmp_path / "cache")
    assert documents == [
        ["The cat sat.", "It purred."],
        ["A new document.", "Second line.", "Third line."],
        ["Other file, one sentence."],
    ]
    assert split_documents(["a", "", "b", "c"]) == [["a"], ["b", "c"]]


def test_missing_and_empty_corpus_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "corpus.txt"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        read_text_documents(missing)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n\n")
    with pytest.raises(ValueError, match=str(empty)):
        read_text_documents(empty, cache_dir=tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match=str(missing)):
        BertPretrainingDataModule(corpus=str(missing), work_dir=str(tmp_path / "work")).setup("fit")


def test_synthetic_corpus_is_deterministic_and_chained(tmp_path: Path) -> None:
    docs = synthetic_documents(num_documents=50, num_topics=4, words_per_topic=8, seed=7, noise=0.0)
    assert docs == synthetic_documents(num_documents=50, num_topics=4, words_per_topic=8, seed=7, noise=0.0)
    assert docs != synthetic_documents(num_documents=50, num_topics=4, words_per_topic=8, seed=8, noise=0.0)
    assert len(docs) == 50 and all(4 <= len(d) <= 10 for d in docs)
    for doc in docs:  # the object noun of a sentence is the subject noun of the next one
        for this, nxt in itertools.pairwise(doc):
            assert this.split()[-2] in nxt.split()
    path = write_synthetic_corpus(tmp_path / "syn.txt", num_documents=20, seed=1)
    assert read_text_documents(path, cache_dir=tmp_path / "cache") == synthetic_documents(num_documents=20, seed=1)


# ------------------------------------------------------------------------------------------------------ tokenizer
def test_tokenizer_trains_from_a_file_and_is_reused_from_its_directory(tmp_path: Path) -> None:
    corpus = write_synthetic_corpus(tmp_path / "corpus.txt", num_documents=120, num_topics=4, seed=0)
    texts = [s for doc in read_text_documents(corpus, cache_dir=tmp_path / "cache") for s in doc]
    directory = tmp_path / "tok"
    tokenizer = load_or_train_tokenizer(directory, texts, vocab_size=200, min_frequency=1)
    assert (directory / "tokenizer.json").is_file() and (directory / "vocab.txt").is_file()
    assert 100 < tokenizer.get_vocab_size() <= 200
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    pair = tokenizer.encode(texts[0], texts[1])
    assert pair.ids[0] == CLS and pair.ids.count(SEP) == 2 and UNK not in pair.ids
    assert pair.type_ids[-1] == 1 and pair.type_ids[0] == 0

    # Retraining gives ids in the same canonical order (specials, then sorted tokens); the token set itself may differ
    # by a few tokens tied at the vocabulary-size boundary (the trainer breaks ties in hash-map order), which is why the
    # tokenizer is saved and reused below rather than retrained.
    retrained = train_wordpiece(texts, vocab_size=200, min_frequency=1).get_vocab()
    assert sorted(retrained, key=retrained.__getitem__)[5:] == sorted(t for t in retrained if t not in SPECIAL_TOKENS)
    assert len(retrained.keys() & tokenizer.get_vocab().keys()) >= 0.95 * len(retrained)

    # Reused, not retrained: other texts and another size give back the saved vocabulary.
    reused = load_or_train_tokenizer(directory, ["completely different words"], vocab_size=50)
    assert reused.get_vocab() == tokenizer.get_vocab()
    assert reused.encode(texts[5]).ids == tokenizer.encode(texts[5]).ids

    # A directory with only vocab.txt (e.g. a pretrained BERT's) loads with BERT's pipeline.
    vocab_only = tmp_path / "vocab_only"
    vocab_only.mkdir()
    (vocab_only / "vocab.txt").write_bytes((directory / "vocab.txt").read_bytes())
    assert load_tokenizer(vocab_only).encode(texts[3]).ids == tokenizer.encode(texts[3]).ids
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_tokenizer(tmp_path / "absent")

    # transformers can load the saved directory too (offline), with segment ids.
    from transformers import BertTokenizerFast

    hf = BertTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    encoded = hf(texts[0], texts[1])
    assert encoded["input_ids"] == pair.ids and encoded["token_type_ids"] == pair.type_ids


def test_train_wordpiece_rejects_tiny_vocab() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        train_wordpiece(["a b c"], vocab_size=5)


# ------------------------------------------------------------------------------------------------------ datamodule
def test_datamodule_pairs_follow_documents(tmp_path: Path) -> None:
    """Every example is [CLS] A [SEP] B [SEP]; B is A's successor (label 0) or a sentence of another document."""
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot",
             "golf", "hotel", "india", "juliet", "kilo", "lima"]
    documents = [
        [f"{words[d % 12]} {words[(d // 12) % 12]} {words[i]} {words[(i + d) % 12]}" for i in range(2 + d % 5)]
        for d in range(60)
    ]
    corpus = write_documents(documents, tmp_path / "corpus.txt")
    dm = BertPretrainingDataModule(corpus=str(corpus), work_dir=str(tmp_path / "work"), tokenizer_vocab_size=100,
                                   min_frequency=1, max_seq_length=32, batch_size=16, val_fraction=0.1, seed=5)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.vocab_size <= 100 and dm.special_token_ids.all == SPECIALS
    tokenizer = dm.tokenizer
    where = {}
    for d, doc in enumerate(documents):
        for i, sentence in enumerate(doc):
            where.setdefault(tuple(tokenizer.encode(sentence, add_special_tokens=False).ids), set()).add((d, i))

    val_docs = set()
    for dataset, is_val in ((dm.train_dataset, False), (dm.val_dataset, True)):
        labels = []
        for k in range(len(dataset)):
            item = dataset[k]
            ids = item["input_ids"]
            seps = [j for j, t in enumerate(ids) if t == SEP]
            assert ids[0] == CLS and len(seps) == 2 and seps[1] == len(ids) - 1
            assert item["token_type_ids"] == [0] * (seps[0] + 1) + [1] * (len(ids) - seps[0] - 1)
            (doc_a, i_a), = where[tuple(ids[1 : seps[0]])]
            (doc_b, i_b), = where[tuple(ids[seps[0] + 1 : -1])]
            if item["next_sentence_label"] == IS_NEXT:
                assert (doc_b, i_b) == (doc_a, i_a + 1)
            else:
                assert doc_b != doc_a
            if is_val:
                val_docs.add(doc_a)
            labels.append(item["next_sentence_label"])
        assert set(labels) == {IS_NEXT, NOT_NEXT}
    assert len(val_docs) == 6  # 10% of the 60 documents are held out, whole

    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "token_type_ids", "attention_mask", "labels", "next_sentence_label"}
    assert batch["input_ids"].shape[0] == 16 and batch["input_ids"].shape[1] <= 32
    # Validation masks are seeded: two loaders give the same batches.
    v1, v2 = next(iter(dm.val_dataloader())), next(iter(dm.val_dataloader()))
    assert torch.equal(v1["labels"], v2["labels"])


def test_datamodule_truncates_long_pairs(tmp_path: Path) -> None:
    documents = [[" ".join(f"w{d}x{i}x{j}" for j in range(5 + 7 * i)) for i in range(3)] for d in range(4)]
    corpus = write_documents(documents, tmp_path / "long.txt")
    dm = BertPretrainingDataModule(corpus=str(corpus), work_dir=str(tmp_path / "work"), tokenizer_vocab_size=300,
                                   min_frequency=1, max_seq_length=16, val_fraction=0.0)
    dm.setup("fit")  # prepare_data runs from setup when the tokenizer is missing
    lengths = [len(dm.train_dataset[k]["input_ids"]) for k in range(len(dm.train_dataset))]
    assert max(lengths) == 16 and all(n <= 16 for n in lengths)
    assert len(dm.val_dataset) == 0


def test_synthetic_default_corpus_is_written_once(tmp_path: Path) -> None:
    dm = BertPretrainingDataModule(work_dir=str(tmp_path), tokenizer_vocab_size=400, synthetic_documents=40,
                                   max_seq_length=24)
    dm.prepare_data()
    path = dm.synthetic_corpus_path
    assert path.is_file() and (tmp_path / "wordpiece-400" / "tokenizer.json").is_file()
    stamp = path.stat().st_mtime_ns
    dm.prepare_data()
    assert path.stat().st_mtime_ns == stamp
    dm.setup("fit")
    assert len(dm.train_dataset) > 100
    assert special_token_ids(dm.tokenizer).mask == MASK
