"""Test-wide settings: quiet Lightning, deterministic CPU math, one CPU share per pytest worker."""

import logging
import os

import pytest
import torch

# pytest-xdist runs the suite in two worker processes on CI's two cores: one intra-op thread each, since torch's
# thread pool stalls when another process competes for the cores. Run alone (``-n 0``), a test may use two.
_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2


def pytest_configure(config: pytest.Config) -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)


@pytest.fixture(autouse=True)
def _deterministic_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(min(previous, _THREADS))
    yield
    torch.set_num_threads(previous)
