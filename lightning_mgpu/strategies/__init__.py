"""Lightning strategies ``parallel_criterion`` and ``dp`` (alias ``data_parallel``): one implementation, and a thin
class per namespace (:mod:`.lightning_pytorch`, :mod:`.pytorch_lightning`). Importing this package imports neither."""
