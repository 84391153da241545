"""Pretraining corpus: documents of sentences, read from text files or a hub dataset, or generated synthetically.

The on-disk format is BERT's: one sentence per line, a blank line between documents. A corpus is returned as a list
of documents, each a list of sentence strings. Next-sentence prediction needs document boundaries (negatives must come
from *another* document), which is why this module keeps them instead of returning a flat list of lines.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

Documents = list[list[str]]


def split_documents(lines: Iterable[str]) -> Documents:
    """Group lines into documents: a blank (or whitespace-only) line ends a document; lines are stripped."""
    documents: Documents = []
    current: list[str] = []
    for line in lines:
        text = line.strip()
        if text:
            current.append(text)
        elif current:
            documents.append(current)
            current = []
    if current:
        documents.append(current)
    return documents


def _as_paths(files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    if isinstance(files, (str, os.PathLike)):
        return [Path(files)]
    return [Path(f) for f in files]


def check_corpus_files(files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Return the corpus paths, or raise ``FileNotFoundError`` naming the first missing one (or an empty list)."""
    paths = _as_paths(files)
    if not paths:
        raise FileNotFoundError("BERT corpus: no corpus file given")
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"BERT corpus file not found: {path}")
    return paths


def read_text_documents(
    files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    cache_dir: str | os.PathLike[str] | None = None,
) -> Documents:
    """Read local text files with ``datasets``' ``text`` loader and split them into documents.

    Files are concatenated in the order given; end each file with a blank line if documents must not span files.
    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` (naming the paths) when there is no text.
    ``datasets`` reads local files without the network; its Arrow cache goes to ``cache_dir`` when given.
    """
    paths = check_corpus_files(files)
    from datasets import load_dataset  # local import: ``datasets`` costs ~1 s and only the data path needs it

    dataset = load_dataset(
        "text",
        data_files={"train": [str(p) for p in paths]},
        split="train",
        cache_dir=None if cache_dir is None else str(cache_dir),
    )
    documents = split_documents(dataset["text"])
    if not documents:
        names = ", ".join(str(p) for p in paths)
        raise ValueError(f"BERT corpus is empty (no non-blank lines): {names}")
    return documents


def read_hub_documents(
    name: str,
    config: str | None = None,
    split: str = "train",
    text_column: str = "text",
    cache_dir: str | os.PathLike[str] | None = None,
) -> Documents:
    """Read a dataset from the Hugging Face hub (or its local cache) whose ``text_column`` holds one sentence per row.

    Blank rows separate documents, as in the text format (e.g. ``wikitext``). Needs the network unless the dataset
    is cached; set ``HF_DATASETS_OFFLINE=1`` to use the cache only.
    """
    from datasets import load_dataset

    dataset = load_dataset(name, config, split=split, cache_dir=None if cache_dir is None else str(cache_dir))
    if text_column not in dataset.column_names:
        raise ValueError(f"hub dataset {name!r} has no column {text_column!r} (columns: {dataset.column_names})")
    documents = split_documents(dataset[text_column])
    if not documents:
        raise ValueError(f"hub dataset {name!r} (split {split!r}) contains no text")
    return documents


# --------------------------------------------------------------------------------------------- synthetic corpus
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def _make_words(rng: random.Random, count: int, taken: set[str]) -> list[str]:
    """``count`` new pronounceable pseudo-words of 2-3 syllables, unique across calls (``taken`` is updated)."""
    words: list[str] = []
    while len(words) < count:
        syllables = rng.choice((2, 2, 3))
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))
        if word not in taken:
            taken.add(word)
            words.append(word)
    return words


def synthetic_documents(
    num_documents: int = 2000,
    num_topics: int = 16,
    words_per_topic: int = 16,
    min_sentences: int = 4,
    max_sentences: int = 10,
    noise: float = 0.1,
    seed: int = 0,
) -> Documents:
    """Generate documents with learnable structure for offline runs and tests.

    Each topic has its own nouns, adjectives and verbs (``words_per_topic`` of each). A document picks a topic, a
    sentence template and a stride ``s``; its k-th sentence is about noun ``n_k = (n_0 + k*s) mod W`` and mentions
    ``n_{k+1}`` as the object, e.g. ``the <adj(n_k)> <noun(n_k)> <verb(n_k)> the <noun(n_{k+1})> .`` so that

    - MLM can be learned: a noun's adjective and verb are fixed (adjectives randomised with probability ``noise``),
      the template's function words are predictable, and the object follows from the subject and the stride;
    - NSP can be learned: the true next sentence starts with the previous object and shares the topic and template,
      while a sentence from another document almost always has another topic, template or chain.
    """
    if num_documents < 1 or num_topics < 1 or words_per_topic < 2:
        raise ValueError("synthetic corpus needs num_documents >= 1, num_topics >= 1 and words_per_topic >= 2")
    if not 1 <= min_sentences <= max_sentences:
        raise ValueError("synthetic corpus needs 1 <= min_sentences <= max_sentences")
    rng = random.Random(seed)
    taken: set[str] = {"the", "a", "and", "then", "so"}
    topics = [
        (
            _make_words(rng, words_per_topic, taken),  # nouns
            _make_words(rng, words_per_topic, taken),  # adjectives
            _make_words(rng, words_per_topic, taken),  # verbs
        )
        for _ in range(num_topics)
    ]
    templates = (
        "the {adj} {noun} {verb} the {obj} .",
        "a {adj} {noun} then {verb} a {obj} .",
        "so the {noun} that is {adj} {verb} {obj} .",
    )
    documents: Documents = []
    for _ in range(num_documents):
        nouns, adjectives, verbs = rng.choice(topics)
        template = rng.choice(templates)
        stride = rng.randint(1, 3)
        subject = rng.randrange(words_per_topic)
        sentences = []
        for _ in range(rng.randint(min_sentences, max_sentences)):
            obj = (subject + stride) % words_per_topic
            adjective = adjectives[rng.randrange(words_per_topic)] if rng.random() < noise else adjectives[subject]
            sentences.append(template.format(adj=adjective, noun=nouns[subject], verb=verbs[subject], obj=nouns[obj]))
            subject = obj
        documents.append(sentences)
    return documents


def write_documents(documents: Documents, path: str | os.PathLike[str]) -> Path:
    """Write documents in the corpus format (one sentence per line, blank line after each document)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        for document in documents:
            f.write("\n".join(document))
            f.write("\n\n")
    tmp.replace(path)  # atomic: a concurrent reader never sees a half-written corpus
    return path


def write_synthetic_corpus(path: str | os.PathLike[str], **kwargs: int | float) -> Path:
    """Generate :func:`synthetic_documents` (``kwargs`` are its parameters) and write them to ``path``."""
    return write_documents(synthetic_documents(**kwargs), path)  # type: ignore[arg-type]
