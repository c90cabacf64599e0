"""The tiny checkpoints with an appended MTP layer that the MTP tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import hf_tiny
from tests.worker.mtp_reference import MTPReference

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
