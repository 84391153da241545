"""Small-BERT pretraining recipe (masked language model + next-sentence prediction).

Modules, one job each (imported lazily so that, e.g., the benchmark can use the model without ``datasets``):

- ``corpus``: read documents from local text files (or a hub dataset) and write a synthetic, learnable corpus.
- ``tokenizer``: train, save and reload a WordPiece vocabulary with ``tokenizers``, with a record of its training
  inputs so that it is not silently reused for another corpus or settings.
- ``pairs``: build next-sentence-prediction pairs (50% true next sentence, 50% from another document of the split).
- ``masking``: dynamic 80/10/10 masking in a batch collator; per-example seeded masks for validation.
- ``data``: the ``LightningDataModule`` tying corpus, tokenizer, pairs and collator together (checkpoints carry the
  tokenizer).
- ``model``: the BERT encoder with an MLM head that computes logits only at masked positions, and an NSP head.
- ``module``: the ``LightningModule`` (losses, metrics, AdamW with warmup schedules).
"""
