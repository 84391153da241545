"""lightning-mgpu: single-process multi-GPU training for PyTorch Lightning 2."""

__version__ = "0.1.0"
