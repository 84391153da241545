"""WordPiece vocabulary: train one from the corpus with ``tokenizers``, save it next to the run, reload it.

The raw ``tokenizers.Tokenizer`` is used (not a ``transformers`` wrapper): it is fast, stable across ``transformers``
4 and 5, and the recipe builds ``[CLS] A [SEP] B [SEP]`` and the segment ids itself. The saved directory holds
``tokenizer.json`` and ``vocab.txt``, so ``transformers.BertTokenizerFast.from_pretrained(dir)`` loads it too.
A local pretrained BERT tokenizer directory (with ``tokenizer.json`` or just ``vocab.txt``) is loaded the same way.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

#: Special tokens in id order: a trained vocabulary has [PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4.
SPECIAL_TOKENS: tuple[str, ...] = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
TOKENIZER_FILE = "tokenizer.json"
VOCAB_FILE = "vocab.txt"


@dataclass(frozen=True)
class SpecialTokenIds:
    """Ids of BERT's special tokens in a given vocabulary."""

    pad: int
    unk: int
    cls: int
    sep: int
    mask: int

    @property
    def all(self) -> tuple[int, ...]:
        """Every special id: these are never selected for masking nor drawn as random replacements."""
        return (self.pad, self.unk, self.cls, self.sep, self.mask)


def special_token_ids(tokenizer: Tokenizer) -> SpecialTokenIds:
    """Look up the special tokens; raise ``ValueError`` naming any the vocabulary lacks."""
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    missing = [token for token, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"tokenizer vocabulary lacks the special tokens {missing}")
    return SpecialTokenIds(*(int(ids[t]) for t in SPECIAL_TOKENS))  # type: ignore[arg-type]


def _bert_pipeline(tokenizer: Tokenizer, lowercase: bool) -> Tokenizer:
    """BERT's normaliser, pre-tokeniser, decoder and ``[CLS] A [SEP] B [SEP]`` template (segment ids 0/1)."""
    tokenizer.normalizer = normalizers.BertNormalizer(clean_text=True, lowercase=lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    if cls_id is not None and sep_id is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS]:0 $A:0 [SEP]:0",
            pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
        )
    return tokenizer


def train_wordpiece(
    texts: Iterable[str],
    vocab_size: int = 30522,
    min_frequency: int = 2,
    lowercase: bool = True,
    length: int | None = None,
) -> Tokenizer:
    """Train a BERT WordPiece vocabulary of at most ``vocab_size`` tokens (fewer if the corpus is small).

    Ids are in a canonical order (specials, then the tokens sorted). The token set can differ between two trainings on
    the same texts by a few tokens tied at the ``vocab_size`` boundary (the trainer breaks ties in hash-map order), so
    runs reuse the saved tokenizer (:func:`load_or_train_tokenizer`) instead of retraining. ``length`` (the number of
    texts) only drives progress estimates.
    """
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}")
    tokenizer = _bert_pipeline(Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100)), lowercase)
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        continuing_subword_prefix="##",
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    # The trainer's ids follow hash-map order; WordPiece encoding depends only on the token set, so renumber in a
    # canonical order: specials first, then the tokens sorted.
    vocab = tokenizer.get_vocab()
    ordered = list(SPECIAL_TOKENS) + sorted(t for t in vocab if t not in SPECIAL_TOKENS)
    model = models.WordPiece({t: i for i, t in enumerate(ordered)}, unk_token="[UNK]", max_input_chars_per_word=100)
    return _bert_pipeline(Tokenizer(model), lowercase)


def save_tokenizer(tokenizer: Tokenizer, directory: str | os.PathLike[str]) -> Path:
    """Save ``tokenizer.json`` and ``vocab.txt`` into ``directory`` (created); returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f"{TOKENIZER_FILE}.tmp{os.getpid()}"
    tokenizer.save(str(tmp))
    tokenizer.model.save(str(directory))  # writes vocab.txt
    tmp.replace(directory / TOKENIZER_FILE)  # last and atomic: its presence means "complete"
    return directory


def tokenizer_exists(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a loadable tokenizer (``tokenizer.json`` or ``vocab.txt``)."""
    directory = Path(directory)
    return (directory / TOKENIZER_FILE).is_file() or (directory / VOCAB_FILE).is_file()


def load_tokenizer(directory: str | os.PathLike[str], lowercase: bool = True) -> Tokenizer:
    """Load a tokenizer saved by :func:`save_tokenizer` or a pretrained BERT tokenizer directory.

    ``tokenizer.json`` is preferred; a directory with only ``vocab.txt`` gets BERT's pipeline (``lowercase`` applies
    then only). Raises ``FileNotFoundError`` naming the directory when neither file exists.
    """
    directory = Path(directory)
    if (directory / TOKENIZER_FILE).is_file():
        tokenizer = Tokenizer.from_file(str(directory / TOKENIZER_FILE))
    elif (directory / VOCAB_FILE).is_file():
        model = models.WordPiece.from_file(str(directory / VOCAB_FILE), unk_token="[UNK]")
        tokenizer = _bert_pipeline(Tokenizer(model), lowercase)
    else:
        raise FileNotFoundError(f"no tokenizer in {directory} (expected {TOKENIZER_FILE} or {VOCAB_FILE})")
    tokenizer.no_padding()
    tokenizer.no_truncation()
    special_token_ids(tokenizer)  # fail early on a vocabulary without BERT's special tokens
    return tokenizer


def load_or_train_tokenizer(
    directory: str | os.PathLike[str],
    texts: Iterable[str] | None,
    vocab_size: int = 30522,
    min_frequency: int = 2,
    lowercase: bool = True,
) -> Tokenizer:
    """Reuse the tokenizer in ``directory`` if there is one, else train it on ``texts`` and save it there."""
    if tokenizer_exists(directory):
        return load_tokenizer(directory, lowercase=lowercase)
    if texts is None:
        raise FileNotFoundError(f"no tokenizer in {directory} and no texts to train one")
    tokenizer = train_wordpiece(texts, vocab_size=vocab_size, min_frequency=min_frequency, lowercase=lowercase)
    save_tokenizer(tokenizer, directory)
    return tokenizer
