"""A tiny token model (float64) and the losses ``ExactLoss`` is tested with, the reference (one device, plain PyTorch,
the whole global batch per step), and, run as a script, the DDP cases (``strategy="ddp"`` re-runs this script per
rank; rank 0 prints one ``CASE {json}`` line per case).

Data: 36 sequences of 12 tokens, 1 to 12 of them not ignored; 3 optimizer steps of 12 sequences.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_mgpu  # noqa: F401  (registers the strategies, as a user's project does)

VOCAB, LENGTH, WIDTH = 5, 12, 4
LABELS = VOCAB  # the sequence logits also shift every token's logits: DDP sees every parameter used
SEQUENCES, GLOBAL_BATCH, LR = 36, 12, 0.5
CLASS_WEIGHTS = (0.2, 1.0, 3.0, 0.5, 2.0)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (SEQUENCES, LENGTH), generator=g)
    targets = torch.randint(0, VOCAB, (SEQUENCES, LENGTH), generator=g)
    lengths = torch.randint(1, LENGTH + 1, (SEQUENCES,), generator=g)
    targets[torch.arange(LENGTH) >= lengths[:, None]] = -100
    labels = torch.randint(0, LABELS, (SEQUENCES,), generator=g)
    return TensorDataset(tokens, targets, labels)


class TokenNet(nn.Module):
    """Per-token logits (shifted by the sequence's) and per-sequence logits (mean-pooled)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.tokens = nn.Linear(WIDTH, VOCAB)
        self.sequence = nn.Linear(WIDTH, LABELS)
        self.register_buffer("class_weights", torch.tensor(CLASS_WEIGHTS))
        self.double()

    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        hidden = self.embed(tokens).tanh()
        sequence = self.sequence(hidden.mean(1))
        return self.tokens(hidden) + 0.5 * sequence[:, None, :], sequence


def _token_ce(net: TokenNet, token_logits: Tensor, targets: Tensor, **kwargs: Any) -> Tensor:
    return F.cross_entropy(token_logits.reshape(-1, VOCAB), targets.reshape(-1), **kwargs)


def token_mean(net: TokenNet, batch: Any) -> Tensor:
    """The mean over non-ignored tokens (ignore_index)."""
    tokens, targets, _ = batch
    return _token_ce(net, net(tokens)[0], targets)


def weighted(net: TokenNet, batch: Any) -> Tensor:
    """Class-weighted cross-entropy over non-ignored tokens: divides by the summed weights of the counted targets."""
    tokens, targets, _ = batch
    return _token_ce(net, net(tokens)[0], targets, weight=net.class_weights)


def sample_mean(net: TokenNet, batch: Any) -> Tensor:
    """A plain per-sample mean: each sequence's summed token loss, averaged over sequences."""
    tokens, targets, _ = batch
    per_token = F.cross_entropy(net(tokens)[0].transpose(1, 2), targets, reduction="none")
    return per_token.sum(1).mean()


def masked_by_hand(net: TokenNet, batch: Any) -> Tensor:
    """The token mean written as ``(loss * mask).sum() / mask.sum()``: a tensor divisor."""
    tokens, targets, _ = batch
    mask = (targets != -100).double()
    per_token = F.cross_entropy(net(tokens)[0].transpose(1, 2), targets.clamp(min=0), reduction="none")
    return (per_token * mask).sum() / mask.sum()


def token_sum(net: TokenNet, batch: Any) -> Tensor:
    """A sum over tokens (scaled, to keep SGD's steps small)."""
    tokens, targets, _ = batch
    return 0.01 * _token_ce(net, net(tokens)[0], targets, reduction="sum")


def two_terms(net: TokenNet, batch: Any) -> Tensor:
    """A token mean plus a sequence mean (as BERT's MLM + NSP): two different counts."""
    tokens, targets, labels = batch
    token_logits, sequence_logits = net(tokens)
    return _token_ce(net, token_logits, targets) + 0.5 * F.cross_entropy(sequence_logits, labels)


def unknown(net: TokenNet, batch: Any) -> Tensor:
    """A loss the reader cannot explain (a square of the mean)."""
    return token_mean(net, batch).pow(2)


LOSSES: dict[str, Callable[[TokenNet, Any], Tensor]] = {
    f.__name__: f for f in (token_mean, weighted, sample_mean, masked_by_hand, token_sum, two_terms, unknown)
}


def flat(module: nn.Module) -> Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def reference(loss: str, global_batch: int = GLOBAL_BATCH) -> Tensor:
    """One device, plain PyTorch: each optimizer step on the whole global batch (of 12 sequences unless said)."""
    net, data = TokenNet(), dataset()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(SEQUENCES // global_batch):
        batch = data[step * global_batch : (step + 1) * global_batch]
        optimizer.zero_grad()
        LOSSES[loss](net, batch).backward()
        optimizer.step()
    return flat(net)


def module_class(namespace: str = "lightning.pytorch") -> type:
    L = importlib.import_module(namespace)

    class TokenModule(L.LightningModule):
        """The token net trained with ``loss``; logs the step's loss as one device does."""

        def __init__(self, loss: str) -> None:
            super().__init__()
            self.loss_name = loss
            self.net = TokenNet()

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            loss = LOSSES[self.loss_name](self.net, batch)
            self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=True)
            return loss

        def train_dataloader(self) -> DataLoader:
            # Rank r reads sequences r, r+2, ... in order: every step's global batch is the reference's 12 sequences
            # (Lightning's own sampler would shuffle training data).
            world, rank = self.trainer.world_size, self.trainer.global_rank
            sampler = DistributedSampler(dataset(), world, rank, shuffle=False) if world > 1 else None
            return DataLoader(dataset(), batch_size=self.batch_size, sampler=sampler)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    return TokenModule


def fit(
    loss: str,
    batch_size: int,
    accumulate: int = 1,
    strategy: Any = "auto",
    devices: int = 1,
    exact: bool = True,
    namespace: str = "lightning.pytorch",
    root: str | Path | None = None,
    **options: Any,
) -> tuple[Any, Any]:
    """Train one epoch (3 optimizer steps of 12 sequences in all) with ``ExactLoss(**options)`` unless not ``exact``;
    returns the trainer and the module."""
    L = importlib.import_module(namespace)
    module = module_class(namespace)(loss)
    module.batch_size = batch_size
    exact_loss = importlib.import_module("lightning_mgpu.callbacks.exact_loss")
    callback = exact_loss.exact_loss_class(namespace)(**options)
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=strategy,
        devices=devices,
        max_epochs=1,
        accumulate_grad_batches=accumulate,
        callbacks=[callback] if exact else [],
        default_root_dir=root,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module)
    return trainer, module


#: The DDP cases (2 processes, gloo): name -> fit's arguments.
DDP_CASES: dict[str, dict[str, Any]] = {
    **{f"{loss}/ddp": dict(loss=loss, batch_size=6) for loss in ("token_mean", "weighted", "sample_mean")},
    **{f"{loss}/ddp+acc": dict(loss=loss, batch_size=3, accumulate=2) for loss in ("token_mean", "weighted")},
    "sample_mean/ddp+acc": dict(loss="sample_mean", batch_size=3, accumulate=2),
    "two_terms/ddp": dict(loss="two_terms", batch_size=6),
    "two_terms/ddp+acc": dict(loss="two_terms", batch_size=3, accumulate=2),
    "token_mean/ddp+acc/pytorch_lightning": dict(
        loss="token_mean", batch_size=3, accumulate=2, namespace="pytorch_lightning"
    ),
    "token_mean/ddp+acc/without": dict(loss="token_mean", batch_size=3, accumulate=2, exact=False),
}


def run_ddp_cases(root: str) -> None:
    """Each case under ``strategy="ddp"`` on 2 CPU processes; rank 0 prints the distance to the reference."""
    import warnings

    all_reduce, calls = torch.distributed.all_reduce, [0]

    def counted(*args: Any, **kwargs: Any) -> Any:  # every all-reduce of the fit, Lightning's own included
        calls[0] += 1
        return all_reduce(*args, **kwargs)

    torch.distributed.all_reduce = counted
    for name, case in DDP_CASES.items():
        calls[0] = 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer, module = fit(**case, strategy="ddp", devices=2, root=Path(root) / name.replace("/", "_"))
        if trainer.is_global_zero:
            said = [str(w.message) for w in caught if "ExactLoss" in str(w.message)]
            error = float((flat(module) - reference(case["loss"])).abs().max())
            result = {"name": name, "error": error, "said": said, "all_reduces": calls[0]}
            print("CASE " + json.dumps(result), flush=True)
    torch.distributed.destroy_process_group()  # else gloo's threads can abort the interpreter's exit


if __name__ == "__main__":
    run_ddp_cases(sys.argv[1])
