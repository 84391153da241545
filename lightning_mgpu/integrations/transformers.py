"""What the replicas need to know of ``transformers``, kept out of the pure-torch layer: it installs its
output-capturing hooks on a model's first ``output_hidden_states`` call and marks it. Replicas share the originals'
hook dicts but copy their attributes, so unmarked replicas would install the hooks again, onto the originals too
(hidden states returned twice): the hooks are installed on the originals before replicas are built."""

from __future__ import annotations

import sys

from torch import nn

from lightning_mgpu.parallel.replicas import before_building_replicas


def install_output_capturing_hooks(module: nn.Module) -> None:
    """Install ``transformers``' output-capturing hooks on the outermost of its models in ``module``, as their first
    call with ``output_hidden_states=True`` would; nothing for other versions or modules."""
    if "transformers" not in sys.modules:
        return  # a transformers model in the tree means the library is imported
    from transformers import PreTrainedModel

    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # a transformers version without lazily installed hooks
        return
    inside: set[int] = set()
    for sub in module.modules():  # parents come before their children
        if id(sub) not in inside and isinstance(sub, PreTrainedModel):
            inside.update(id(m) for m in sub.modules())
            maybe_install_capturing_hooks(sub)


before_building_replicas(install_output_capturing_hooks)
