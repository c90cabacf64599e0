"""A GPU engine cuts torch's CPU pool to one thread unless OMP_NUM_THREADS sets it."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine.threads import limit_host_threads


@pytest.fixture
def pool():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_pool_is_cut_to_one_thread(pool, monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    limit_host_threads()
    assert torch.get_num_threads() == 1


def test_omp_num_threads_wins(pool, monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    limit_host_threads()
    assert torch.get_num_threads() == 2
