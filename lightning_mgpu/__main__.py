"""Entry point for ``python -m lightning_mgpu fit -c config.yaml``."""

from lightning_mgpu.cli import main

if __name__ == "__main__":
    main()
