"""The same LightningModule under Lightning's own DDP (CPU, gloo, 2 processes) matches single-device training."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed
from strategy_models import Classifier, clone, flat_params, loader, seeded, trainer
from torch.utils.data import DataLoader, DistributedSampler


class InOrderShards(Classifier):
    """Each rank reads every other sample in order (Lightning's automatic sampler would shuffle training data)."""

    def train_dataloader(self) -> DataLoader:
        data = loader(5).dataset
        sampler = DistributedSampler(data, self.trainer.world_size, self.trainer.global_rank, shuffle=False)
        return DataLoader(data, batch_size=5, sampler=sampler)


@pytest.fixture
def restore_environment():
    saved = dict(os.environ)
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def test_ddp_spawn_matches_single_device_on_the_same_global_batches(restore_environment):
    base = seeded(InOrderShards)
    single, distributed = clone(base), clone(base)
    trainer("auto", 1, max_steps=4, limit_val_batches=0).fit(single, loader(10))
    # Rank r reads samples r, r+2, r+4, ...: 5 per rank per step, the same global batch of 10 as the single device.
    t = trainer("ddp_spawn", 2, max_steps=4, limit_val_batches=0, use_distributed_sampler=False)
    t.fit(distributed)
    assert t.state.finished
    torch.testing.assert_close(flat_params(distributed), flat_params(single), rtol=0, atol=1e-10)
