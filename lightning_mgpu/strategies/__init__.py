"""Lightning strategies ``parallel_criterion`` and ``dp`` (alias ``data_parallel``).

One implementation (:mod:`.single_process`, :mod:`.parallel_criterion`, :mod:`.data_parallel`), written against no
particular Lightning namespace, and a thin class per namespace: :mod:`.lightning_pytorch` for ``lightning.pytorch``,
:mod:`.pytorch_lightning` for ``pytorch_lightning``. Importing this package imports neither.
"""
