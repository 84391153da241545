"""What evaluation's loss calls divide by, read from their own arguments while they run.

Evaluation runs without autograd, so its losses carry no graph for :mod:`.loss_graph` to read. While a replica's
evaluation step runs, :class:`LossCalls` (a ``TorchFunctionMode``) notes each output of torch's functional losses
with what its mean divides by; a logged or returned value that is such an output merges by it. Every call runs once,
as written: the mode only reads.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_mgpu.parallel.loss_graph import count_targets


def _class_loss_count(bound: dict[str, Any]) -> Any:
    inputs, target = bound["input"], bound["target"]
    if target.is_floating_point():  # probabilities: a mean over samples (and positions)
        return inputs.numel() // inputs.shape[1] if inputs.dim() > 1 else 1
    return count_targets(target, bound.get("weight"), bound.get("ignore_index", -100))


def _elements(bound: dict[str, Any]) -> int:
    return torch.broadcast_shapes(bound["input"].shape, bound["target"].shape).numel()


#: The functional losses whose calls evaluation records, and what their mean divides by, from their arguments.
_CALL_COUNTS: dict[Any, Callable[[dict[str, Any]], Any]] = {
    F.cross_entropy: _class_loss_count,
    F.nll_loss: _class_loss_count,
    **dict.fromkeys(
        (F.mse_loss, F.l1_loss, F.huber_loss, F.smooth_l1_loss, F.binary_cross_entropy),
        _elements,
    ),
    F.binary_cross_entropy_with_logits: _elements,
}


class LossCalls(TorchFunctionMode):
    """Records, while active, the outputs of torch's functional losses with what their mean divides by (``None``
    for a sum), read from the call's own arguments: evaluation runs without autograd, so its losses carry no graph
    to read. Only reading: every call runs once, as written."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[int, tuple[Tensor, Any]] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        count = _CALL_COUNTS.get(func)
        if count is not None and isinstance(output, Tensor) and output.dim() == 0:
            bound = inspect.signature(func).bind(*args, **kwargs).arguments
            reduction = bound.get("reduction", "mean")
            if reduction in ("mean", "sum"):
                self.counts[id(output)] = (output, None if reduction == "sum" else count(bound))
        return output

    def count_of(self, value: Any) -> tuple[bool, Any]:
        """Whether ``value`` is a recorded loss output, and its count (``None``: a sum)."""
        found = self.counts.get(id(value))
        return (found is not None and found[0] is value), (found[1] if found is not None else None)


def recorded_weights(values: Sequence[Any], calls: Sequence[LossCalls]) -> list[Any] | None:
    """Each shard's count for ``values`` that its loss calls recorded (``"sum"`` for sums), or ``None`` where a
    value is not a recorded loss output."""
    found = [recorded.count_of(value) for value, recorded in zip(values, calls, strict=True)]
    if not all(seen for seen, _ in found):
        return None
    counts = [count for _, count in found]
    return ["sum"] * len(counts) if any(count is None for count in counts) else counts
