"""``python -m benchmarks.compare``: see :mod:`benchmarks.compare.cli`."""

import sys

from benchmarks.compare.cli import main

if __name__ == "__main__":
    sys.exit(main())
