"""Test-wide settings: quiet Lightning, deterministic CPU math."""

import logging

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)


@pytest.fixture(autouse=True)
def _deterministic_threads():
    # Two intra-op threads on CI's two cores; the tests compare numbers, not speed.
    previous = torch.get_num_threads()
    torch.set_num_threads(min(previous, 2))
    yield
    torch.set_num_threads(previous)
