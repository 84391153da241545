"""Code that knows another library than torch and Lightning, registered with the pure-torch layer on import."""

from lightning_mgpu.integrations import transformers

__all__ = ["transformers"]
