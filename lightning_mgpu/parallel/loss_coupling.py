"""Whether a loss couples the samples of a shard: read from its autograd graph, never run.

A loss that mixes rows of the batch (in-batch negatives, batch statistics, a nonlinear function of a batch mean) is
no weighted mean of the shards' losses: it gets no rule, and the strategy says so once.
"""

from __future__ import annotations

from torch import Tensor

from lightning_mgpu.parallel.loss_graph import LOSS_NODES, MEANS, PASS, QUOTIENTS, SUMS, Node, of_parameters, signed

#: Nodes whose result mixes rows of the batch when they run on it in training: per-shard batch statistics.
_BATCH_STATISTICS = frozenset({"NativeBatchNormBackward0", "CudnnBatchNormBackward0", "MiopenBatchNormBackward0"})
#: Reductions that mix the rows they reduce over: any of them over the batch dimension couples samples.
_ACROSS = frozenset(
    f"{name}Backward{n}"
    for name in ("Logsumexp", "Std", "Var", "Max", "Min", "Amax", "Amin", "Median", "Nanmedian", "Sort", "Topk")
    for n in (0, 1)
)
_VIEWS = frozenset({"TBackward0", "PermuteBackward0", *PASS})
#: Nonlinear functions of a scalar: of a reduction over the batch (``sqrt(mse)``), they are no mean of the shards'.
_NONLINEAR = frozenset(
    f"{name}Backward0" for name in ("Sqrt", "Rsqrt", "Exp", "Log", "Log1p", "Pow", "Reciprocal", "Sigmoid", "Tanh")
)


def _short(name: str) -> str:
    return name.removesuffix("Backward0").removesuffix("Backward1")


def coupling(loss: Tensor, samples: int, limit: int = 200_000) -> str | None:
    """What in ``loss``'s graph mixes the rows of a shard of ``samples`` samples (batch statistics, a batch-by-batch
    product, a reduction over the batch dimension before the loss), or ``None``: about a microsecond a node."""
    if loss.grad_fn is None or samples < 2:
        return None
    seen, stack = set(), [(loss.grad_fn, True, None)]
    while stack and len(seen) < limit:
        node, top, through = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        found = _couples(node, samples, top) or (through and top and _of_batch(node, samples, through))
        if found:
            return found
        name = type(node).__name__
        below = top and name not in LOSS_NODES and name not in MEANS and name not in SUMS  # a term's own node
        children = [child for child, _ in node.next_functions]
        quotient = name in QUOTIENTS and len(children) > 1 and children[1] is not None  # of two computed tensors
        through = through or (name if name in _NONLINEAR or quotient else None)
        stack.extend((child, below, through) for child in children)
    return None


def _of_batch(node: Node, samples: int, through: str) -> str | None:
    """A reduction over the batch (a loss function's, a mean or sum over the shard's rows) below ``through``."""
    name = type(node).__name__
    if name in LOSS_NODES or (
        name in MEANS | SUMS
        and (sizes := node._saved_self_sym_sizes)
        and sizes[0] == samples
        and not of_parameters(node, samples)
    ):
        return (
            f"a nonlinear function ({_short(through)}) of a reduction over the batch ({_short(name)}), as RMSE or Dice"
        )
    return None


def _couples(node: Node, samples: int, top: bool) -> str | None:
    name = type(node).__name__
    if name in _BATCH_STATISTICS and getattr(node, "_saved_training", False):
        return "BatchNorm in training mode (each device normalises its shard with the shard's statistics)"
    if name == "MmBackward0":
        rows, cols, other = node._saved_self_sym_sizes[0], node._saved_mat2_sym_sizes[1], node.next_functions[1][0]
        while other is not None and type(other).__name__ in _VIEWS:  # linear's transposed weight: a layer
            other = other.next_functions[0][0]
        if rows == cols == samples and (other is None or type(other).__name__ != "AccumulateGrad"):
            return "a product of the batch with itself (similarities between samples, as in contrastive losses)"
    # At the loss's top, a mean or sum over a dimension is a term; below it, over the batch dimension, it couples.
    if name in _ACROSS or (name in ("MeanBackward1", "SumBackward1") and not top):
        sizes = node._saved_self_sym_sizes if hasattr(node, "_saved_self_sym_sizes") else node._saved_self.shape
        dim = getattr(node, "_saved_dim", None)  # none saved: a reduction over every element
        dims = [0] if dim is None else [signed(d) % len(sizes) for d in (dim if isinstance(dim, tuple) else (dim,))]
        if sizes and sizes[0] == samples and 0 in dims and (len(sizes) > 1 or name in _ACROSS):
            return f"a reduction over the batch dimension ({_short(name)})"
    return None
