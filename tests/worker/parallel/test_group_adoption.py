"""A data-parallel-attention group adopts peers' sessions (issue 46), on a real gloo group of
two ranks over a real node store: a dead group's session of each rank is taken over by a live
group of the same layout, each on the rank named (the other rank than the one it ran on), through
rank 0's ``AsyncEngine`` and the worker's ``peer_adopter``; each stream goes on with exactly a
single process's uncached tokens after what the caller received, no prompt token is computed,
and a session the store does not hold is refused with ``not_found`` after the rank's step."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.kv_host_store import KVHostStoreClient
from tests import hf_tiny, ranks
from tests.group import run_group
from tests.kv_host_store.conftest import store_client


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("glm")
    hf_tiny.save_hub_style(hf_tiny.build(hf_tiny.glm_config(), seed=5), path)
    return path


@pytest.fixture
def store() -> Iterator[KVHostStoreClient]:
    with store_client("group-adoption") as client:
        yield client


def test_a_data_parallel_group_adopts_a_dead_groups_sessions_on_the_ranks_named(
    checkpoint: Path, store: KVHostStoreClient
) -> None:
    leader, follower = run_group(ranks.adoption, 2, checkpoint, store.target)
    assert leader["got"] == leader["want"]
    assert all(len(tokens) == 24 - 5 for tokens in leader["got"].values())
    assert leader["refused"] == "not_found"
    assert leader["prefilled"] == follower["prefilled"] == 0  # adopted: no prompt recomputed
    assert leader["resumed"] == follower["resumed"] == 1
    stats = store.stats()
    assert stats.adoptions == 2 and stats.owners_fenced == 2
