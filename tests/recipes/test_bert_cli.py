"""The BERT recipe's configs through LightningCLI in-process (``lightning_mgpu.cli.main(args=[...])``): the seed
config builds the article's model, and data that does not fit the model is a clear error.

Training under every strategy overlay, as users run it (a fresh process, progress bar on), is in
``tests/cli/test_recipe_matrix.py``.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest

from recipes.bert.corpus import write_synthetic_corpus
from recipes.bert.tokenizer import save_tokenizer, train_wordpiece

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "bert" / "quickstart.yaml"
SEED = REPO / "configs" / "bert" / "seed.yaml"

# Driving LightningCLI with args= under pytest makes it warn that pytest's own argv is also present.
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")


@pytest.fixture(scope="module")
def corpus_and_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A small synthetic corpus and its tokenizer, made once: the runs reuse the saved tokenizer.

    Saved without a record of its training inputs, as a pretrained tokenizer would be, so the data module uses it
    whatever its own tokenizer settings are.
    """
    root = tmp_path_factory.mktemp("bert_cli")
    corpus = write_synthetic_corpus(root / "corpus.txt", num_documents=120, num_topics=4, seed=0)
    tokenizer_dir = root / "tokenizer"
    texts = [line.strip() for line in corpus.read_text().splitlines() if line.strip()]
    save_tokenizer(train_wordpiece(texts, vocab_size=400, min_frequency=1), tokenizer_dir)
    return corpus, tokenizer_dir


def _args(config: Path, overlay: str, corpus: Path, tokenizer_dir: Path, out: Path) -> list[str]:
    """Two training steps (2 batches of 8) and one validation batch, written under ``out``."""
    return [
        "fit",
        "-c",
        str(config),
        "-c",
        str(REPO / "configs" / "strategies" / f"{overlay}.yaml"),
        f"--data.init_args.corpus={corpus}",
        f"--data.init_args.tokenizer_dir={tokenizer_dir}",
        f"--data.init_args.work_dir={out / 'work'}",
        "--data.init_args.batch_size=8",
        "--data.init_args.max_seq_length=32",
        "--data.init_args.num_workers=0",
        "--model.init_args.vocab_size=400",
        "--trainer.accelerator=cpu",
        "--trainer.precision=32-true",
        "--trainer.max_epochs=1",
        "--trainer.max_steps=-1",
        "--trainer.limit_train_batches=2",
        "--trainer.limit_val_batches=1",
        "--trainer.val_check_interval=1.0",
        "--trainer.log_every_n_steps=1",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={out}",
        f"--trainer.logger.init_args.save_dir={out}",
    ]


def test_seed_config_builds_the_article_model(corpus_and_tokenizer: tuple[Path, Path], tmp_path: Path) -> None:
    """seed.yaml instantiates (without training): 8 layers x 256 hidden, vocab 30522, seq 163, batch 64, Noam."""
    from lightning_mgpu.cli import main

    corpus, _ = corpus_and_tokenizer
    cli = main(
        args=[
            "-c",
            str(SEED),
            f"--data.init_args.corpus={corpus}",
            f"--data.init_args.work_dir={tmp_path}",
            "--trainer.accelerator=cpu",
            "--trainer.precision=32-true",
        ],
        run=False,
    )
    model, data = cli.model, cli.datamodule
    assert model.hparams.num_layers == 8 and model.hparams.hidden_size == 256 and model.hparams.num_heads == 8
    assert model.hparams.vocab_size == data.hparams.tokenizer_vocab_size == 30522
    assert data.hparams.max_seq_length == 163 and data.hparams.batch_size == 64
    assert model.hparams.schedule == "noam" and model.hparams.warmup_steps == 10000
    assert sum(p.numel() for p in model.parameters()) == 14_426_940  # = transformers' BertForPreTraining


def test_tokenizer_larger_than_the_model_vocab_is_a_clear_error(
    corpus_and_tokenizer: tuple[Path, Path], tmp_path: Path
) -> None:
    from lightning_mgpu.cli import main

    corpus, tokenizer_dir = corpus_and_tokenizer
    args = _args(QUICKSTART, "single", corpus, tokenizer_dir, tmp_path)
    args.append("--model.init_args.vocab_size=50")
    with pytest.raises(ValueError, match="vocab_size"):
        main(args=args)


def test_sequences_longer_than_the_position_embeddings_are_a_clear_error(
    corpus_and_tokenizer: tuple[Path, Path], tmp_path: Path
) -> None:
    from lightning_mgpu.cli import main

    corpus, tokenizer_dir = corpus_and_tokenizer
    args = _args(QUICKSTART, "single", corpus, tokenizer_dir, tmp_path)  # max_seq_length=32
    args.append("--model.init_args.max_position_embeddings=16")
    with pytest.raises(ValueError, match=r"max_seq_length \(32\) exceeds the model's max_position_embeddings \(16\)"):
        main(args=args)
