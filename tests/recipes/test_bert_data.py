"""BERT recipe data: corpus reading, WordPiece tokenizer, NSP pairs, truncation and dynamic masking."""

from __future__ import annotations

import itertools
import json
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
    Tokenizer,
    TokenizerInputsChanged,
    load_or_train_tokenizer,
    load_tokenizer,
    read_training_inputs,
    save_tokenizer,
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
        ids,
        special,
        mask_token_id=MASK,
        replacement_ids=non_special_ids(vocab, SPECIALS),
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
        ids,
        special,
        mask_token_id=MASK,
        replacement_ids=non_special_ids(vocab, SPECIALS),
        mask_ratio=0.0,
        random_ratio=1.0,
        generator=torch.Generator().manual_seed(1),
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
    fixed = PretrainingCollator(
        vocab_size=50,
        pad_token_id=PAD,
        mask_token_id=MASK,
        special_ids=SPECIALS,
        pad_to_length=8,
        generator=torch.Generator().manual_seed(3),
    )
    again = PretrainingCollator(
        vocab_size=50,
        pad_token_id=PAD,
        mask_token_id=MASK,
        special_ids=SPECIALS,
        pad_to_length=8,
        generator=torch.Generator().manual_seed(3),
    )
    a, b = fixed(examples), again(examples)
    assert a["input_ids"].shape == (128, 8)
    assert torch.equal(a["labels"], b["labels"]) and torch.equal(a["input_ids"], b["input_ids"])


def test_seeded_collator_masks_each_example_from_its_index() -> None:
    """With a seed, an example's mask depends on (seed, index) only: not on its batch, position or padding."""

    def example(index: int, length: int = 40) -> dict:
        return {
            "input_ids": [CLS, *range(10, 10 + length), SEP],
            "token_type_ids": [0] * (length + 2),
            "next_sentence_label": 0,
            "index": index,
        }

    collate = PretrainingCollator(vocab_size=100, pad_token_id=PAD, mask_token_id=MASK, special_ids=SPECIALS, seed=7)
    first = collate([example(i) for i in range(32)])
    # Identical token ids, distinct indices: distinct masks.
    assert len({tuple(row.tolist()) for row in first["labels"]}) == 32
    # Example 5 again, in another batch, at another row, padded to another width: the same mask and inputs.
    again = collate([example(100, length=60), example(5)])
    assert torch.equal(again["labels"][1, :42], first["labels"][5])
    assert torch.equal(again["input_ids"][1, :42], first["input_ids"][5])
    assert (again["labels"][1, 42:] == IGNORE_INDEX).all()
    other_seed = PretrainingCollator(vocab_size=100, pad_token_id=PAD, mask_token_id=MASK, special_ids=SPECIALS, seed=8)
    assert not torch.equal(other_seed([example(5)])["labels"][0], first["labels"][5])
    with pytest.raises(ValueError, match="index"):
        collate([{k: v for k, v in example(0).items() if k != "index"}])
    with pytest.raises(ValueError, match="not both"):
        PretrainingCollator(
            vocab_size=100,
            pad_token_id=PAD,
            mask_token_id=MASK,
            special_ids=SPECIALS,
            seed=1,
            generator=torch.Generator(),
        )


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

    # Reused, not retrained, for the same texts and settings (or no texts); refused for other ones.
    reused = load_or_train_tokenizer(directory, texts, vocab_size=200, min_frequency=1)
    assert reused.get_vocab() == tokenizer.get_vocab()
    assert reused.encode(texts[5]).ids == tokenizer.encode(texts[5]).ids
    assert load_or_train_tokenizer(directory, None).get_vocab() == tokenizer.get_vocab()
    with pytest.raises(TokenizerInputsChanged, match=r"training texts: \d+ lines .* -> 1 lines"):
        load_or_train_tokenizer(directory, ["completely different words"], vocab_size=200, min_frequency=1)
    with pytest.raises(TokenizerInputsChanged, match="vocab_size: 200 -> 50") as raised:
        load_or_train_tokenizer(directory, texts, vocab_size=50, min_frequency=1)
    assert "training texts" not in str(raised.value) and f"delete {directory}" in str(raised.value)

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
    words = [
        "alpha",
        "bravo",
        "charlie",
        "delta",
        "echo",
        "foxtrot",
        "golf",
        "hotel",
        "india",
        "juliet",
        "kilo",
        "lima",
    ]
    documents = [
        [f"{words[d % 12]} {words[(d // 12) % 12]} {words[i]} {words[(i + d) % 12]}" for i in range(2 + d % 5)]
        for d in range(60)
    ]
    corpus = write_documents(documents, tmp_path / "corpus.txt")
    dm = BertPretrainingDataModule(
        corpus=str(corpus),
        work_dir=str(tmp_path / "work"),
        tokenizer_vocab_size=100,
        min_frequency=1,
        max_seq_length=32,
        batch_size=16,
        val_fraction=0.1,
        seed=5,
    )
    dm.prepare_data()
    dm.setup("fit")
    assert dm.vocab_size <= 100 and dm.special_token_ids.all == SPECIALS
    tokenizer = dm.tokenizer
    where = {}
    for d, doc in enumerate(documents):
        for i, sentence in enumerate(doc):
            where.setdefault(tuple(tokenizer.encode(sentence, add_special_tokens=False).ids), set()).add((d, i))

    docs_used = {"train": set(), "val": set()}  # documents of sentences A and B of each split's pairs
    for dataset, split in ((dm.train_dataset, "train"), (dm.val_dataset, "val")):
        labels = []
        for k in range(len(dataset)):
            item = dataset[k]
            ids = item["input_ids"]
            seps = [j for j, t in enumerate(ids) if t == SEP]
            assert ids[0] == CLS and len(seps) == 2 and seps[1] == len(ids) - 1
            assert item["token_type_ids"] == [0] * (seps[0] + 1) + [1] * (len(ids) - seps[0] - 1)
            ((doc_a, i_a),) = where[tuple(ids[1 : seps[0]])]
            ((doc_b, i_b),) = where[tuple(ids[seps[0] + 1 : -1])]
            if item["next_sentence_label"] == IS_NEXT:
                assert (doc_b, i_b) == (doc_a, i_a + 1)
            else:
                assert doc_b != doc_a
            docs_used[split] |= {doc_a, doc_b}
            labels.append(item["next_sentence_label"])
        assert set(labels) == {IS_NEXT, NOT_NEXT}
    # 10% of the 60 documents are held out, whole: no sentence of theirs is in a training pair, not even as the B of a
    # negative, and validation negatives come from validation documents.
    assert len(docs_used["val"]) == 6
    assert not docs_used["train"] & docs_used["val"]
    assert len(docs_used["train"]) == 54

    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "token_type_ids", "attention_mask", "labels", "next_sentence_label"}
    assert batch["input_ids"].shape[0] == 16 and batch["input_ids"].shape[1] <= 32
    # Validation masks are seeded: two loaders give the same batches.
    v1, v2 = next(iter(dm.val_dataloader())), next(iter(dm.val_dataloader()))
    assert torch.equal(v1["labels"], v2["labels"])


def test_datamodule_truncates_long_pairs(tmp_path: Path) -> None:
    documents = [[" ".join(f"w{d}x{i}x{j}" for j in range(5 + 7 * i)) for i in range(3)] for d in range(4)]
    corpus = write_documents(documents, tmp_path / "long.txt")
    dm = BertPretrainingDataModule(
        corpus=str(corpus),
        work_dir=str(tmp_path / "work"),
        tokenizer_vocab_size=300,
        min_frequency=1,
        max_seq_length=16,
        val_fraction=0.0,
    )
    dm.setup("fit")  # prepare_data runs from setup when the tokenizer is missing
    lengths = [len(dm.train_dataset[k]["input_ids"]) for k in range(len(dm.train_dataset))]
    assert max(lengths) == 16 and all(n <= 16 for n in lengths)
    assert len(dm.val_dataset) == 0


def test_synthetic_default_corpus_is_written_once(tmp_path: Path) -> None:
    dm = BertPretrainingDataModule(
        work_dir=str(tmp_path), tokenizer_vocab_size=400, synthetic_documents=40, max_seq_length=24
    )
    dm.prepare_data()
    path = dm.synthetic_corpus_path
    assert path.is_file() and (tmp_path / "wordpiece-400" / "tokenizer.json").is_file()
    stamp = path.stat().st_mtime_ns
    dm.prepare_data()
    assert path.stat().st_mtime_ns == stamp
    dm.setup("fit")
    assert len(dm.train_dataset) > 100
    assert special_token_ids(dm.tokenizer).mask == MASK


# ------------------------------------------------------------------------------------------------------ masks
@pytest.fixture(scope="module")
def synthetic_work_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A work_dir with a small synthetic corpus and its tokenizer, prepared once for the masking tests."""
    work_dir = tmp_path_factory.mktemp("bert_masks")
    _small_datamodule(work_dir).prepare_data()
    return work_dir


def _small_datamodule(work_dir: Path, **overrides) -> BertPretrainingDataModule:
    settings = {
        "work_dir": str(work_dir),
        "tokenizer_vocab_size": 300,
        "synthetic_documents": 200,
        "max_seq_length": 32,
        "batch_size": 8,
        "val_fraction": 0.1,
        "seed": 3,
    }
    return BertPretrainingDataModule(**{**settings, **overrides})


def _selected(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["labels"] != IGNORE_INDEX


def _original_ids(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The token ids before masking (the labels hold them at the selected positions)."""
    return torch.where(_selected(batch), batch["labels"], batch["input_ids"])


def test_validation_masks_are_the_same_at_every_pass_and_with_workers(synthetic_work_dir: Path) -> None:
    dm = _small_datamodule(synthetic_work_dir)
    dm.setup("fit")
    loader = dm.val_dataloader()  # Lightning requests it once per fit and iterates it at every validation
    first, second = list(loader), list(loader)
    assert len(first) > 5 and sum(int(_selected(b).sum()) for b in first) > 100
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a["labels"], b["labels"]) and torch.equal(a["input_ids"], b["input_ids"])

    with_workers = _small_datamodule(synthetic_work_dir, num_workers=2)
    with_workers.setup("fit")
    for a, b in zip(first, with_workers.val_dataloader(), strict=True):
        assert torch.equal(a["labels"], b["labels"]) and torch.equal(a["input_ids"], b["input_ids"])


def test_training_masks_differ_between_workers(synthetic_work_dir: Path) -> None:
    """Batches 0 and 1 come from workers 0 and 1: their masks must come from different random streams."""
    dm = _small_datamodule(synthetic_work_dir, num_workers=2, pad_to_max_length=True)
    dm.setup("fit")
    batches = iter(dm.train_dataloader())
    first, second = next(batches), next(batches)
    # Positions where both batches hold an ordinary token: the same stream would select exactly the same ones there.
    both = ~torch.isin(_original_ids(first), torch.tensor(SPECIALS))
    both &= ~torch.isin(_original_ids(second), torch.tensor(SPECIALS))
    assert both.sum() > 100
    assert not torch.equal(_selected(first) & both, _selected(second) & both)


# ------------------------------------------------------------------------------------------------------ stale tokenizer
def _write_corpus(path: Path, words: list[str], documents: int = 12) -> Path:
    """Documents of 4 sentences built from ``words`` (every sentence distinct)."""
    docs = [
        [f"{words[d % len(words)]} {words[(d + i) % len(words)]} {words[i]} number{d}x{i} ." for i in range(4)]
        for d in range(documents)
    ]
    return write_documents(docs, path)


def test_tokenizer_trained_for_other_inputs_is_refused(tmp_path: Path) -> None:
    botany = _write_corpus(tmp_path / "botany.txt", ["chlorophyll", "photosynthesis", "stomata", "xylem", "phloem"])
    physics = _write_corpus(tmp_path / "physics.txt", ["quark", "gluon", "boson", "fermion", "lepton"])
    work = tmp_path / "work"
    settings = {"work_dir": str(work), "tokenizer_vocab_size": 200, "min_frequency": 1, "max_seq_length": 32}
    first = BertPretrainingDataModule(corpus=str(botany), **settings)
    first.setup("fit")
    vocab = first.tokenizer.get_vocab()
    assert "chlorophyll" in vocab and (work / "wordpiece-200" / "training_inputs.json").is_file()

    # Another corpus in the same work_dir: refused, naming both sources and what to do.
    with pytest.raises(TokenizerInputsChanged, match="training texts") as raised:
        BertPretrainingDataModule(corpus=str(physics), **settings).setup("fit")
    message = str(raised.value)
    assert str(botany) in message and str(physics) in message
    assert f"delete {work / 'wordpiece-200'}" in message and "tokenizer_dir" in message
    # Another setting, or another split of the same corpus: refused too.
    with pytest.raises(TokenizerInputsChanged, match="min_frequency: 1 -> 2"):
        BertPretrainingDataModule(corpus=str(botany), **{**settings, "min_frequency": 2}).setup("fit")
    with pytest.raises(TokenizerInputsChanged, match="lowercase: True -> False"):
        BertPretrainingDataModule(corpus=str(botany), lowercase=False, **settings).setup("fit")
    with pytest.raises(TokenizerInputsChanged, match=r"seed=1234 -> .* seed=9"):
        BertPretrainingDataModule(corpus=str(botany), seed=9, **settings).setup("fit")

    # The same text under another path (a copy, another machine) is the same input: reused.
    copy = tmp_path / "elsewhere" / "botany.txt"
    copy.parent.mkdir()
    copy.write_bytes(botany.read_bytes())
    reused = BertPretrainingDataModule(corpus=str(copy), **settings)
    reused.setup("fit")
    assert reused.tokenizer.get_vocab() == vocab

    # Another tokenizer_dir trains the new corpus its own vocabulary.
    other = BertPretrainingDataModule(corpus=str(physics), tokenizer_dir=str(tmp_path / "physics-tok"), **settings)
    other.setup("fit")
    assert "quark" in other.tokenizer.get_vocab() and "quark" not in vocab


# ------------------------------------------------------------------------------------------------------ checkpoints
def _renumbered(tokenizer: Tokenizer) -> Tokenizer:
    """The same tokens with the ordinary ones' ids reversed: what a retraining that broke ties otherwise gives."""
    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    ordinary = sorted((t for t in vocab if t not in SPECIAL_TOKENS), key=vocab.__getitem__)
    reversed_ids = zip(reversed(ordinary), [vocab[t] for t in ordinary], strict=True)
    data["model"]["vocab"] = {**{t: vocab[t] for t in SPECIAL_TOKENS}, **dict(reversed_ids)}
    return Tokenizer.from_str(json.dumps(data))


def test_checkpoint_tokenizer_replaces_a_retrained_one_and_never_a_foreign_one(
    synthetic_work_dir: Path, tmp_path: Path
) -> None:
    original = _small_datamodule(synthetic_work_dir)
    original.setup("fit")
    state = original.state_dict()
    vocab, example = original.tokenizer.get_vocab(), original.train_dataset[0]

    # Loaded before setup into an empty work_dir: saved there instead of training a new tokenizer.
    fresh = _small_datamodule(tmp_path / "fresh")
    fresh.load_state_dict(state)
    fresh.setup("fit")
    assert fresh.tokenizer.get_vocab() == vocab and fresh.train_dataset[0] == example
    assert load_tokenizer(fresh.tokenizer_dir).get_vocab() == vocab
    assert (fresh.tokenizer_dir / "training_inputs.json").is_file()

    # Loaded after setup (as Lightning does) over a tokenizer this module trained with other ids: replaced, and the
    # datasets are rebuilt with the checkpoint's ids.
    retrained = _small_datamodule(tmp_path / "retrained")
    retrained.prepare_data()
    directory = retrained.tokenizer_dir
    save_tokenizer(_renumbered(load_tokenizer(directory)), directory, read_training_inputs(directory))
    retrained.setup("fit")
    assert retrained.train_dataset[0]["input_ids"] != example["input_ids"]
    with pytest.warns(UserWarning, match="replacing the tokenizer"):
        retrained.load_state_dict(state)
    assert retrained.tokenizer.get_vocab() == vocab and retrained.train_dataset[0] == example
    assert load_tokenizer(directory).get_vocab() == vocab

    # A tokenizer this module did not train (no record: e.g. a pretrained one) is never overwritten.
    foreign_dir = save_tokenizer(_renumbered(original.tokenizer), tmp_path / "pretrained")
    foreign = _small_datamodule(synthetic_work_dir, tokenizer_dir=str(foreign_dir))
    foreign.setup("fit")
    with pytest.raises(ValueError, match=f"another tokenizer than the one in {foreign_dir}"):
        foreign.load_state_dict(state)
    assert load_tokenizer(foreign_dir).get_vocab() != vocab
    # A checkpoint from before the tokenizer was stored changes nothing.
    foreign.load_state_dict({})


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_resuming_with_a_fresh_work_dir_restores_the_checkpoint_tokenizer(
    synthetic_work_dir: Path, tmp_path: Path, one_thread: None
) -> None:
    """Fit 2 steps, then resume in another work_dir whose retrained tokenizer numbers tokens otherwise."""
    import lightning.pytorch as pl

    from recipes.bert.module import BertPretrainingModule

    def fit(datamodule: BertPretrainingDataModule, steps: int, ckpt_path: Path | None = None) -> pl.Trainer:
        pl.seed_everything(0, verbose=False)
        model = BertPretrainingModule(
            vocab_size=300,
            hidden_size=16,
            num_layers=1,
            num_heads=2,
            intermediate_size=32,
            max_position_embeddings=32,
            total_steps=10,
        )
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=steps,
            limit_val_batches=1,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        trainer.fit(model, datamodule, ckpt_path=ckpt_path)
        return trainer

    first = _small_datamodule(synthetic_work_dir)
    trainer = fit(first, steps=2)
    checkpoint = tmp_path / "two_steps.ckpt"
    trainer.save_checkpoint(checkpoint)

    resumed = _small_datamodule(tmp_path / "elsewhere")
    resumed.prepare_data()
    directory = resumed.tokenizer_dir
    save_tokenizer(_renumbered(load_tokenizer(directory)), directory, read_training_inputs(directory))
    with pytest.warns(UserWarning, match="replacing the tokenizer"):
        trainer = fit(resumed, steps=4, ckpt_path=checkpoint)
    assert trainer.global_step == 4 and torch.isfinite(trainer.callback_metrics["train/loss_step"])
    assert resumed.tokenizer.get_vocab() == first.tokenizer.get_vocab()
    assert load_tokenizer(directory).get_vocab() == first.tokenizer.get_vocab()
    assert resumed.train_dataset[0] == first.train_dataset[0]
