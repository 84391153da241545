"""WordPiece vocabulary: train one from the corpus with ``tokenizers``, save it next to the run, reload it.

The raw ``tokenizers.Tokenizer`` is used (not a ``transformers`` wrapper): it is fast, stable across ``transformers``
4 and 5, and the recipe builds ``[CLS] A [SEP] B [SEP]`` and the segment ids itself. The saved directory holds
``tokenizer.json`` and ``vocab.txt``, so ``transformers.BertTokenizerFast.from_pretrained(dir)`` loads it too.
A local pretrained BERT tokenizer directory (with ``tokenizer.json`` or just ``vocab.txt``) is loaded the same way.

A trained tokenizer is saved with ``training_inputs.json``: a digest of the training texts and the trainer settings.
Reusing the directory for other inputs raises :class:`TokenizerInputsChanged` (saying what changed) instead of
silently tokenizing a new corpus with a vocabulary learnt from another one. A directory without that file (a
pretrained tokenizer, or one saved before the file existed) is reused as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

#: Special tokens in id order: a trained vocabulary has [PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4.
SPECIAL_TOKENS: tuple[str, ...] = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
TOKENIZER_FILE = "tokenizer.json"
VOCAB_FILE = "vocab.txt"
TRAINING_INPUTS_FILE = "training_inputs.json"
#: Training-input entries that determine the vocabulary (``source`` only describes the texts for error messages).
_COMPARED_INPUTS: tuple[str, ...] = ("texts_sha256", "vocab_size", "min_frequency", "lowercase")


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
    runs reuse the saved tokenizer (:func:`load_or_train_tokenizer`) instead of retraining, and checkpoints carry it
    (``BertPretrainingDataModule.state_dict``). ``length`` (the number of texts) only drives progress estimates.
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


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, so concurrent readers and writers see whole files."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def save_tokenizer(
    tokenizer: Tokenizer, directory: str | os.PathLike[str], inputs: dict[str, Any] | None = None
) -> Path:
    """Save ``tokenizer.json``, ``vocab.txt`` and the :func:`training_inputs` record ``inputs`` into ``directory``.

    Without ``inputs`` any earlier record is removed (it would describe another tokenizer). Every file is replaced
    atomically and ``tokenizer.json`` comes last, so its presence means "complete" and several processes may save
    the same tokenizer at once (DDP ranks restoring it from a checkpoint).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if inputs is None:
        (directory / TRAINING_INPUTS_FILE).unlink(missing_ok=True)
    else:
        _write_atomic(directory / TRAINING_INPUTS_FILE, json.dumps(inputs, indent=1, sort_keys=True))
    prefix = f"tmp{os.getpid()}"
    tokenizer.model.save(str(directory), prefix)  # writes <prefix>-vocab.txt
    (directory / f"{prefix}-{VOCAB_FILE}").replace(directory / VOCAB_FILE)
    _write_atomic(directory / TOKENIZER_FILE, tokenizer.to_str(pretty=True))
    return directory


def texts_digest(texts: Iterable[str], chunk: int = 10_000) -> tuple[str, int]:
    """SHA-256 of the texts joined by newlines (texts are single lines), and their number.

    Content, not file paths or times: a corpus copied to another machine or path still matches.
    """
    digest = hashlib.sha256()
    count = 0
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == chunk:  # joining in chunks: C speed without a second copy of the whole corpus
            digest.update(("\n".join(batch) + "\n").encode("utf-8"))
            count, batch = count + len(batch), []
    if batch:
        digest.update(("\n".join(batch) + "\n").encode("utf-8"))
    return digest.hexdigest(), count + len(batch)


def training_inputs(
    texts: Iterable[str], vocab_size: int, min_frequency: int, lowercase: bool, source: str = "the given texts"
) -> dict[str, Any]:
    """What determines a trained vocabulary: the training texts' digest and the trainer settings.

    ``source`` describes where the texts came from; it only makes :class:`TokenizerInputsChanged` readable.
    """
    sha256, count = texts_digest(texts)
    return {
        "texts_sha256": sha256,
        "num_texts": count,
        "source": source,
        "vocab_size": vocab_size,
        "min_frequency": min_frequency,
        "lowercase": lowercase,
    }


def read_training_inputs(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The training inputs saved with the tokenizer in ``directory``, or None when it has none on record."""
    path = Path(directory) / TRAINING_INPUTS_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


class TokenizerInputsChanged(ValueError):
    """A saved tokenizer was trained on other texts or settings than the ones it is being reused for."""


def _describe_changes(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One line per compared training input that differs, e.g. ``min_frequency: 2 -> 1``."""
    changes = []
    for key in _COMPARED_INPUTS:
        if recorded.get(key) == current.get(key):
            continue
        if key == "texts_sha256":
            changes.append(
                f"training texts: {recorded.get('num_texts')} lines from {recorded.get('source')}"
                f" -> {current.get('num_texts')} lines from {current.get('source')}"
            )
        else:
            changes.append(f"{key}: {recorded.get(key)!r} -> {current.get(key)!r}")
    return changes


def check_training_inputs(directory: str | os.PathLike[str], current: dict[str, Any]) -> None:
    """Raise :class:`TokenizerInputsChanged` when ``directory``'s tokenizer was trained on inputs other than
    ``current`` (a :func:`training_inputs` dict); do nothing when it has no inputs on record."""
    recorded = read_training_inputs(directory)
    if recorded is None:
        return
    changes = _describe_changes(recorded, current)
    if changes:
        raise TokenizerInputsChanged(
            f"the tokenizer in {directory} was trained on other inputs than this run's ("
            + "; ".join(changes)
            + f"). To train a new one, delete {directory} or set tokenizer_dir to another directory; to keep using"
            " it, restore the inputs it was trained on."
        )


def same_tokenizer(first: Tokenizer, second: Tokenizer) -> bool:
    """Whether two tokenizers are identical (vocabulary with its ids, normaliser, pipeline)."""
    return json.loads(first.to_str()) == json.loads(second.to_str())


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
    texts: Sequence[str] | None,
    vocab_size: int = 30522,
    min_frequency: int = 2,
    lowercase: bool = True,
) -> Tokenizer:
    """Reuse the tokenizer in ``directory`` if there is one, else train it on ``texts`` and save it there.

    With ``texts``, a reused tokenizer must have been trained on the same texts and settings (when it has them on
    record): otherwise :class:`TokenizerInputsChanged` is raised. ``texts=None`` reuses whatever is there.
    """
    inputs = None if texts is None else training_inputs(texts, vocab_size, min_frequency, lowercase)
    if tokenizer_exists(directory):
        if inputs is not None:
            check_training_inputs(directory, inputs)
        return load_tokenizer(directory, lowercase=lowercase)
    if texts is None:
        raise FileNotFoundError(f"no tokenizer in {directory} and no texts to train one")
    tokenizer = train_wordpiece(texts, vocab_size=vocab_size, min_frequency=min_frequency, lowercase=lowercase)
    save_tokenizer(tokenizer, directory, inputs)
    return tokenizer
