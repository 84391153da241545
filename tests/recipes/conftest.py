"""Fixtures shared by the recipe tests."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op thread for compute-heavy tests that check results, not speed.

    With two OpenMP threads on two cores, another busy process makes every parallel region wait at its barrier:
    measured 46 s instead of 6.7 s (one thread) for the same small training run. One thread costs little on idle
    cores and keeps such tests a few seconds either way.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
