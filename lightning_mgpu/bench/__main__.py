"""``python -m lightning_mgpu.bench``: see :mod:`lightning_mgpu.bench.cli`."""

import sys

from lightning_mgpu.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
