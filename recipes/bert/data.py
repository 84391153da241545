"""``BertPretrainingDataModule``: corpus -> WordPiece tokenizer -> NSP sentence pairs -> masked batches.

Where the text comes from, in order of precedence:

1. ``corpus``: local text file(s), one sentence per line, a blank line between documents (read with ``datasets``);
2. ``hub_dataset``: a Hugging Face hub dataset name (needs the network or its cache);
3. neither: a synthetic, learnable corpus (see ``corpus.synthetic_documents``) written to ``work_dir`` once.

The documents are split into training and validation documents first (seeded, whole documents), and the NSP pairs
are built within each split, so no validation sentence appears in a training pair (not even as a negative's B).

The tokenizer is loaded from ``tokenizer_dir`` if it holds one (a directory saved by an earlier run, or a local
pretrained BERT tokenizer), else trained on the training documents and saved there. ``prepare_data`` (run once per
node) writes the synthetic corpus and the tokenizer; ``setup`` (every process) reads them, tokenizes every sentence
once and builds the pairs deterministically from ``seed``, so all DDP ranks hold the same dataset.

A tokenizer trained by this module is saved with a record of its training inputs (a digest of the training texts,
``tokenizer_vocab_size``, ``min_frequency``, ``lowercase``); ``setup`` refuses to reuse it for other inputs (another
corpus, split or setting) with an error saying what changed: delete the directory or set ``tokenizer_dir`` elsewhere.
It does not retrain silently: training a large vocabulary takes long, and retraining changes token ids.

Checkpoints carry the tokenizer (``state_dict``), because WordPiece training is not deterministic: a run resumed
with a fresh ``work_dir`` or on another machine would otherwise retrain a vocabulary whose ids differ from the
ones the model learnt. On resume, ``load_state_dict`` puts the checkpoint's tokenizer in place (see there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from recipes.bert.corpus import Documents, read_hub_documents, read_text_documents, write_synthetic_corpus
from recipes.bert.masking import PretrainingCollator
from recipes.bert.pairs import SentencePairs, build_nsp_pairs, truncate_pair_lengths
from recipes.bert.tokenizer import (
    SpecialTokenIds,
    Tokenizer,
    check_training_inputs,
    load_tokenizer,
    read_training_inputs,
    same_tokenizer,
    save_tokenizer,
    special_token_ids,
    tokenizer_exists,
    train_wordpiece,
    training_inputs,
)


class TokenizedCorpus:
    """Every sentence of a corpus as token ids (no special tokens), stored flat: ``ids[offsets[i]:offsets[i+1]]``."""

    def __init__(self, documents: Documents, tokenizer: Tokenizer, batch_size: int = 10_000) -> None:
        sentences = [s for doc in documents for s in doc]
        chunks = [
            np.asarray(encoding.ids, dtype=np.int32)
            for start in range(0, len(sentences), batch_size)
            for encoding in tokenizer.encode_batch(sentences[start : start + batch_size], add_special_tokens=False)
        ]
        self.ids = np.concatenate(chunks) if chunks else np.empty(0, dtype=np.int32)
        self.offsets = np.concatenate(([0], np.cumsum([len(c) for c in chunks], dtype=np.int64)))
        self.sentences_per_document = [len(doc) for doc in documents]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sentence(self, index: int) -> np.ndarray:
        """Token ids of sentence ``index`` (global index over all documents)."""
        return self.ids[self.offsets[index] : self.offsets[index + 1]]


class NspPairDataset(Dataset):
    """Map-style dataset of ``[CLS] A [SEP] B [SEP]`` examples, truncated longest-first to ``max_seq_length``.

    Items are dicts of Python lists/ints (cheap to pickle to ``DataLoader`` workers), with their ``index`` (from which
    a seeded ``PretrainingCollator`` derives the validation masks); ``PretrainingCollator`` pads and masks them.
    """

    def __init__(
        self, corpus: TokenizedCorpus, pairs: SentencePairs, special: SpecialTokenIds, max_seq_length: int
    ) -> None:
        if max_seq_length < 5:
            raise ValueError(f"max_seq_length must be at least 5 ([CLS] a [SEP] b [SEP]), got {max_seq_length}")
        self.corpus = corpus
        self.pairs = pairs
        self.special = special
        self.max_seq_length = max_seq_length

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> dict[str, Any]:
        a = self.corpus.sentence(int(self.pairs.first[index]))
        b = self.corpus.sentence(int(self.pairs.second[index]))
        len_a, len_b = truncate_pair_lengths(len(a), len(b), self.max_seq_length - 3)
        cls, sep = self.special.cls, self.special.sep
        input_ids = [cls, *a[:len_a].tolist(), sep, *b[:len_b].tolist(), sep]
        token_type_ids = [0] * (len_a + 2) + [1] * (len_b + 1)
        return {
            "input_ids": input_ids,
            "token_type_ids": token_type_ids,
            "next_sentence_label": int(self.pairs.label[index]),
            "index": index,
        }


class BertPretrainingDataModule(pl.LightningDataModule):
    """MLM + NSP data for BERT pretraining (see the module docstring for sources and caching).

    Args:
        corpus: local text file(s) in BERT's corpus format; overrides ``hub_dataset``.
        hub_dataset, hub_config, hub_split, text_column: a hub dataset whose ``text_column`` holds sentences.
        work_dir: where the synthetic corpus, the default tokenizer directory and the ``datasets`` cache go.
        tokenizer_dir: tokenizer to reuse, or where to save the trained one (default ``work_dir/wordpiece-<vocab>``).
            One trained here is reused only for the same training inputs (see the module docstring).
        tokenizer_vocab_size, min_frequency, lowercase: WordPiece training (the vocabulary may come out smaller; the
            model's ``vocab_size`` must be at least the result). Named apart from the model's ``vocab_size`` because
            Lightning refuses equal hparam names with different values in the model and the datamodule.
        max_seq_length: longest ``[CLS] A [SEP] B [SEP]`` (pairs are truncated longest-first).
        batch_size: per step (per process under DDP; split across devices by the single-process strategies).
        val_fraction: share of *documents* held out for validation (at least two, so that validation negatives come
            from another validation document, when > 0 and there are >= 4 documents).
        mlm_probability, mask_ratio, random_ratio: masking (15% selected; 80% [MASK], 10% random, 10% kept).
            Training masks are dynamic (new at every epoch, distinct across workers); validation masks are a
            function of ``(seed, example index)``: the same at every validation, with any ``num_workers``.
        pad_to_max_length: pad every batch to ``max_seq_length`` instead of its longest sequence.
        seed: fixes the synthetic corpus, the train/val split, the NSP pairs and the validation masks (>= 0).
        synthetic_documents, synthetic_topics, synthetic_words_per_topic: size of the synthetic corpus.
    """

    def __init__(
        self,
        corpus: str | list[str] | None = None,
        hub_dataset: str | None = None,
        hub_config: str | None = None,
        hub_split: str = "train",
        text_column: str = "text",
        work_dir: str = "data/bert",
        tokenizer_dir: str | None = None,
        tokenizer_vocab_size: int = 30522,
        min_frequency: int = 2,
        lowercase: bool = True,
        max_seq_length: int = 128,
        batch_size: int = 32,
        val_batch_size: int | None = None,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        mlm_probability: float = 0.15,
        mask_ratio: float = 0.8,
        random_ratio: float = 0.1,
        pad_to_max_length: bool = False,
        seed: int = 1234,
        synthetic_documents: int = 2000,
        synthetic_topics: int = 16,
        synthetic_words_per_topic: int = 16,
    ) -> None:
        super().__init__()
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.save_hyperparameters()
        self.corpus = corpus
        self.work_dir = Path(work_dir)
        default_dir = self.work_dir / f"wordpiece-{tokenizer_vocab_size}"
        self.tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir else default_dir
        self._default_tokenizer_dir = not tokenizer_dir
        self.tokenizer: Tokenizer | None = None
        self._checkpoint_tokenizer: Tokenizer | None = None  # set by load_state_dict
        self.train_dataset: NspPairDataset | None = None
        self.val_dataset: NspPairDataset | None = None

    # ----------------------------------------------------------------------------------------------- sources
    @property
    def synthetic_corpus_path(self) -> Path:
        """Where the synthetic corpus is written (its name encodes the generator's parameters)."""
        h = self.hparams
        name = f"synthetic-d{h.synthetic_documents}-t{h.synthetic_topics}-w{h.synthetic_words_per_topic}-s{h.seed}.txt"
        return self.work_dir / name

    @property
    def _synthetic(self) -> bool:
        """Neither ``corpus`` nor ``hub_dataset`` is set: the synthetic corpus is the source."""
        return self.corpus is None and self.hparams.hub_dataset is None

    def _write_synthetic_corpus(self) -> None:
        if self._synthetic and not self.synthetic_corpus_path.is_file():
            h = self.hparams
            write_synthetic_corpus(
                self.synthetic_corpus_path,
                num_documents=h.synthetic_documents,
                num_topics=h.synthetic_topics,
                words_per_topic=h.synthetic_words_per_topic,
                seed=h.seed,
            )

    def read_documents(self) -> Documents:
        """All documents of the configured source."""
        cache_dir = self.work_dir / "hf_cache"
        h = self.hparams
        if self.corpus is not None:
            return read_text_documents(self.corpus, cache_dir=cache_dir)
        if h.hub_dataset is not None:
            return read_hub_documents(h.hub_dataset, h.hub_config, h.hub_split, h.text_column, cache_dir=cache_dir)
        return read_text_documents(self.synthetic_corpus_path, cache_dir=cache_dir)

    def _source_description(self) -> str:
        """Where the text comes from and how it is split, for error messages about the tokenizer's inputs."""
        h = self.hparams
        if self.corpus is not None:
            files = [self.corpus] if isinstance(self.corpus, str) else self.corpus
            source = "corpus " + ", ".join(str(Path(f).resolve()) for f in files)
        elif h.hub_dataset is not None:
            source = f"hub dataset {h.hub_dataset} (config {h.hub_config}, split {h.hub_split}, column {h.text_column})"
        else:
            source = f"synthetic corpus {self.synthetic_corpus_path.name}"
        return f"{source} with val_fraction={h.val_fraction}, seed={h.seed}"

    def _val_flags(self, num_documents: int) -> np.ndarray:
        """Seeded document-level train/val split: True for each held-out (validation) document.

        At least two validation documents (NSP negatives of validation pairs come from another validation document)
        and at least two training documents; none when ``val_fraction`` is 0 or there are fewer than 4 documents.
        """
        n = num_documents
        is_val = np.zeros(n, dtype=bool)
        if self.hparams.val_fraction > 0 and n >= 4:
            n_val = min(n - 2, max(2, round(self.hparams.val_fraction * n)))
            is_val[np.random.default_rng(self.hparams.seed).permutation(n)[:n_val]] = True
        return is_val

    def _split_documents(self) -> tuple[Documents, Documents]:
        """Read the source and split it into (training, validation) documents (see ``_val_flags``)."""
        documents = self.read_documents()
        is_val = self._val_flags(len(documents))
        train = [doc for doc, v in zip(documents, is_val, strict=True) if not v]
        val = [doc for doc, v in zip(documents, is_val, strict=True) if v]
        return train, val

    def _tokenizer_inputs(self, train_documents: Documents) -> dict[str, Any]:
        """The record of what the tokenizer is trained on: the training documents' sentences and the settings."""
        h = self.hparams
        texts = (s for doc in train_documents for s in doc)
        return training_inputs(texts, h.tokenizer_vocab_size, h.min_frequency, h.lowercase, self._source_description())

    # ----------------------------------------------------------------------------------------------- hooks
    def prepare_data(self) -> None:
        """Write the synthetic corpus and train + save the tokenizer if they are not there yet (once per node).

        The tokenizer is trained on the training documents only. When a checkpoint's tokenizer was loaded with
        ``load_state_dict`` before this runs, that one is saved instead of training a new one.
        """
        self._write_synthetic_corpus()
        if tokenizer_exists(self.tokenizer_dir):
            return
        train_documents, _ = self._split_documents()
        tokenizer = self._checkpoint_tokenizer
        if tokenizer is None:
            texts = [s for doc in train_documents for s in doc]
            h = self.hparams
            tokenizer = train_wordpiece(texts, h.tokenizer_vocab_size, h.min_frequency, h.lowercase, length=len(texts))
        save_tokenizer(tokenizer, self.tokenizer_dir, self._tokenizer_inputs(train_documents))

    def setup(self, stage: str | None = None) -> None:
        """Check and load the tokenizer, tokenize the corpus and build the train/val pair datasets (idempotent).

        Raises ``TokenizerInputsChanged`` when ``tokenizer_dir`` holds a tokenizer this module trained on other
        inputs than the current ones.
        """
        if self.train_dataset is not None:
            return
        self.prepare_data()  # a no-op when done already (the Trainer calls it first); needed outside a Trainer
        train_documents, val_documents = self._split_documents()
        self._check_tokenizer_inputs(train_documents)
        tokenizer = load_tokenizer(self.tokenizer_dir, lowercase=self.hparams.lowercase)
        if self._checkpoint_tokenizer is not None and not same_tokenizer(tokenizer, self._checkpoint_tokenizer):
            tokenizer = self._install_checkpoint_tokenizer()
        self._build_datasets(tokenizer, train_documents, val_documents)

    def _check_tokenizer_inputs(self, train_documents: Documents) -> None:
        """Refuse a saved tokenizer trained on other inputs; warn about a default-directory one without a record."""
        if read_training_inputs(self.tokenizer_dir) is not None:
            check_training_inputs(self.tokenizer_dir, self._tokenizer_inputs(train_documents))
        elif self._default_tokenizer_dir:
            rank_zero_warn(
                f"the tokenizer in {self.tokenizer_dir} has no record of the corpus and settings it was trained on, so"
                " it is reused unchecked; delete the directory to train one for this run's corpus"
            )

    def _build_datasets(self, tokenizer: Tokenizer, train_documents: Documents, val_documents: Documents) -> None:
        """Tokenize each split and build its NSP pairs within the split (negatives from the same split only)."""
        special = special_token_ids(tokenizer)
        h = self.hparams
        datasets = []
        for documents in (train_documents, val_documents):
            corpus = TokenizedCorpus(documents, tokenizer)
            pairs = build_nsp_pairs(corpus.sentences_per_document, seed=h.seed)
            datasets.append(NspPairDataset(corpus, pairs, special, h.max_seq_length))
        if len(datasets[0]) == 0:
            raise ValueError("the corpus yields no training pairs: documents need at least 2 sentences")
        self.tokenizer = tokenizer
        self.train_dataset, self.val_dataset = datasets

    # ----------------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The loaded tokenizer (its ``tokenizer.json`` text), which Lightning stores in every checkpoint."""
        return {} if self.tokenizer is None else {"tokenizer": self.tokenizer.to_str()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Use the checkpoint's tokenizer, so that token ids mean what they meant when the model was trained.

        Lightning calls this after ``setup`` when resuming. If ``tokenizer_dir`` holds another tokenizer trained by
        this module (retraining, e.g. with a fresh ``work_dir``, gives other ids), the checkpoint's replaces it and
        the datasets are rebuilt; if it holds another tokenizer from elsewhere (a pretrained one), it is left alone
        and ``ValueError`` is raised. Called before ``setup``, the checkpoint's tokenizer is used by ``setup``
        (saved, without training one, when ``tokenizer_dir`` is empty). Checkpoints without a tokenizer are ignored.
        """
        serialized = state_dict.get("tokenizer")
        if serialized is None:
            return
        self._checkpoint_tokenizer = Tokenizer.from_str(serialized)
        if self.tokenizer is None or same_tokenizer(self.tokenizer, self._checkpoint_tokenizer):
            return
        tokenizer = self._install_checkpoint_tokenizer()
        self._build_datasets(tokenizer, *self._split_documents())

    def _install_checkpoint_tokenizer(self) -> Tokenizer:
        """Save the checkpoint's tokenizer over the different one in ``tokenizer_dir``, if this module trained that."""
        tokenizer, directory = self._checkpoint_tokenizer, self.tokenizer_dir
        assert tokenizer is not None
        inputs = read_training_inputs(directory)
        if inputs is None:
            raise ValueError(
                f"the checkpoint was trained with another tokenizer than the one in {directory}, which was not trained"
                " by this data module, so it is not replaced: set tokenizer_dir to the tokenizer the checkpoint was"
                " trained with, or to a new directory (the checkpoint's tokenizer is saved there)"
            )
        rank_zero_warn(
            f"replacing the tokenizer in {directory} with the checkpoint's: the model was trained with that one"
            " (retraining a WordPiece vocabulary can assign other ids)"
        )
        save_tokenizer(tokenizer, directory, inputs)
        return tokenizer

    # ----------------------------------------------------------------------------------------------- loaders
    @property
    def vocab_size(self) -> int:
        """Size of the loaded tokenizer's vocabulary (call ``setup`` first): the model's must be at least this."""
        if self.tokenizer is None:
            raise RuntimeError("call setup() before reading vocab_size")
        return self.tokenizer.get_vocab_size()

    @property
    def special_token_ids(self) -> SpecialTokenIds:
        """Ids of [PAD], [UNK], [CLS], [SEP], [MASK] in the loaded tokenizer."""
        if self.tokenizer is None:
            raise RuntimeError("call setup() before reading special_token_ids")
        return special_token_ids(self.tokenizer)

    def collator(self, generator: torch.Generator | None = None, seed: int | None = None) -> PretrainingCollator:
        """The masking collator for this tokenizer: dynamic masks from torch's global RNG by default, masks from
        ``generator`` (per batch) or from ``(seed, example index)`` (per example); see ``PretrainingCollator``."""
        special = self.special_token_ids
        h = self.hparams
        return PretrainingCollator(
            vocab_size=self.vocab_size,
            pad_token_id=special.pad,
            mask_token_id=special.mask,
            special_ids=special.all,
            mlm_probability=h.mlm_probability,
            mask_ratio=h.mask_ratio,
            random_ratio=h.random_ratio,
            pad_to_length=h.max_seq_length if h.pad_to_max_length else None,
            generator=generator,
            seed=seed,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled pairs with fresh masks every epoch (each worker's masks from its own RNG seed)."""
        assert self.train_dataset is not None, "call setup() first"
        return DataLoader(
            self.train_dataset,
            batch_size=self.hparams.batch_size,
            shuffle=True,
            num_workers=self.hparams.num_workers,
            collate_fn=self.collator(),
            persistent_workers=self.hparams.num_workers > 0,
            drop_last=False,
        )

    def val_dataloader(self) -> DataLoader:
        """Held-out documents' pairs, each masked from ``(seed, its index)``: the same masks at every validation."""
        assert self.val_dataset is not None, "call setup() first"
        return DataLoader(
            self.val_dataset,
            batch_size=self.hparams.val_batch_size or self.hparams.batch_size,
            shuffle=False,
            num_workers=self.hparams.num_workers,
            collate_fn=self.collator(seed=self.hparams.seed),
        )
