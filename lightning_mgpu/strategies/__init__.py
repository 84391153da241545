"""Lightning strategies ``parallel_criterion`` and ``dp`` (alias ``data_parallel``): one implementation, and thin
classes per namespace in :mod:`.lightning_pytorch` and :mod:`.pytorch_lightning`. Importing this package imports
neither namespace.
"""
