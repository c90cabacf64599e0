"""The tiny checkpoints with an appended MTP layer that the MTP tests share, a recorder of an
engine's drafts, and the check that a speculating session survives its worker."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests import hf_tiny, hf_tiny_v4
from tests.worker.mtp_reference import MTPReference, V4MTPReference

if TYPE_CHECKING:
    from services.worker.engine.engine import Engine

FAMILIES = {"deepseek_v32": hf_tiny.v32_config, "glm_moe_dsa": hf_tiny.glm_config}


def mtp_checkpoint(name: str, factory: pytest.TempPathFactory) -> tuple[MTPReference, Path]:
    """(the reference, a checkpoint saved hub-style with a random MTP layer appended); GLM
    sharded and with ``index_share_for_mtp_iteration``."""
    target = hf_tiny.build(FAMILIES[name](), seed=5)
    path = factory.mktemp(name)
    hf_tiny.save_hub_style(target, path, max_shard_size="40KB" if name == "glm_moe_dsa" else None)
    mtp = hf_tiny.mtp_layer(target, seed=6, tmp=factory.mktemp(f"{name}-mtp"))
    extra = {"index_share_for_mtp_iteration": True} if name == "glm_moe_dsa" else {}
    hf_tiny.append_mtp(path, mtp, **extra)
    return MTPReference(target, mtp), path


def v4_mtp_checkpoint(
    factory: pytest.TempPathFactory, names: str = "hub"
) -> tuple[V4MTPReference, Path]:
    """(the reference, a tiny DeepSeek-V4 checkpoint saved hub-style with a random MTP layer
    appended under ``mtp.0.``, in DeepSeek's names or transformers' module names)."""
    target = hf_tiny_v4.build(hf_tiny_v4.v4_config(), seed=5)
    path = hf_tiny_v4.save_hub_style(target, factory.mktemp(f"v4-{names}"))
    mtp = hf_tiny_v4.mtp_layer(seed=6, tmp=factory.mktemp("v4-mtp"), names=names)
    hf_tiny.append_mtp(path, mtp)
    return V4MTPReference(target, mtp), path


def record_drafts(engine: Engine, log: dict[tuple[int, int], list[int]]) -> None:
    """Makes ``engine``'s drafter record each proposal in ``log`` by (tokens committed, anchor
    token): the drafts of two engines compare position by position."""
    drafter = engine.speculator.drafter
    propose = drafter.propose

    def recorded(slots, anchors, num_committed, widths=None, *args, **kw):
        prop = propose(slots, anchors, num_committed, widths, *args, **kw)
        for r, (a, n) in enumerate(zip(anchors, num_committed, strict=True)):
            log[(n, a)] = prop.tokens[r, : prop.widths[r] - 1].tolist()
        return prop

    drafter.propose = recorded


def check_speculating_resume(
    engine: Callable[..., Engine], prompts: list[list[int]], max_tokens: int
) -> None:
    """An engine speculating with an MTP layer (``engine(owner=..., host=...)``) is dropped
    mid-stream; its successor adopts the sessions from the host store and continues them,
    token for token as an uninterrupted run (greedy, and seeded sampling), without computing a
    prompt token, drafting at every step what the uninterrupted run drafted (its whole context
    came back)."""
    from services.worker.durable.host_link import HostLink
    from services.worker.hierarchy.local_store import LocalHostStore
    from services.worker.request.request import SamplingParams
    from tests.worker.model import serving

    store = LocalHostStore(64 << 20)
    params = [
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(
            temperature=0.9, top_p=0.95, seed=11, max_tokens=max_tokens, ignore_eos=True
        ),
    ]
    drafts: dict[str, dict[tuple[int, int], list[int]]] = {}

    def make(owner: str) -> Engine:
        eng = engine(owner=owner, host=(store, store.mapping))
        HostLink(store, owner, 30.0, eng.kv.host_backups).register()
        record_drafts(eng, drafts.setdefault(owner, {}))
        return eng

    def started(first: Engine) -> None:
        assert first.speculator.counters.drafts > 0
        assert all(0 < len(r.output_ids) < max_tokens for r in first.requests.values())

    _, second = serving.resumed_after_death(
        make, store, prompts, params[: len(prompts)], 6, started
    )
    resumed = drafts["w0"]
    assert resumed and all(drafts["ref"].get(k) == v for k, v in resumed.items()), resumed
    second.close()
    store.close()
