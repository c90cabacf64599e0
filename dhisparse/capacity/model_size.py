"""The size of a Hugging Face model directory (DeepSeek-V3.2, GLM-5): its parameters by part
and the KV bytes each token adds, for ``dhisparse plan --model DIR``.

Bytes per token follow the capacity model's layouts: every layer's stored row (d_kv elements)
plus an index key (d_index elements) on every index producer, in bf16, and in FP8 as the
``glm-5.3`` profile lays it out (one byte per element; each index key with one fp32 scale).
The MTP layer counts only as served with ``--drafter mtp`` (``mtp``): one more row and key."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dhisparse.capacity.builtin import is_v4_model_dir, profile_from_model_config
from dhisparse.capacity.profile import Profile
from dhisparse.family.config import ModelConfig
from dhisparse.family.hf_config import MLAConfig
from dhisparse.family.hf_dir import hf_family, is_hf_model_dir
from dhisparse.family.hf_size import ParamCount, param_count

FP8_INDEX_SCALE_BYTES = 4  # one fp32 scale per 128-element FP8 index key (132 B keys)


@dataclass(frozen=True)
class TokenBytes:
    """KV bytes one token adds over all layers, in one element format."""

    format: str
    rows: int  # stored rows of every source
    index_keys: int  # index keys of every producer

    @property
    def total(self) -> int:
        return self.rows + self.index_keys


@dataclass(frozen=True)
class ModelSize:
    name: str
    family: str
    layers: int
    index_producers: int
    parameters: ParamCount
    kv_per_token: tuple[TokenBytes, ...]  # bf16, then fp8
    mtp: bool = False  # kv_per_token includes the MTP layer's row and index key

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "mtp": self.mtp,
            "family": self.family,
            "layers": self.layers,
            "index_producers": self.index_producers,
            "parameters": self.parameters.as_dict(),
            "kv_per_token": {
                t.format: {"rows": t.rows, "index_keys": t.index_keys, "total": t.total}
                for t in self.kv_per_token
            },
        }


def token_bytes(profile: Profile, fmt: str) -> TokenBytes:
    """Per-token bytes of a profile whose sources and producers store one row (key) per token."""
    if any(s.compress != 1 for s in profile.sources) or any(
        g.compress != 1 for g in profile.indexers
    ):
        raise ValueError(f"{profile.name}: per-token bytes need uncompressed sources")
    rows = sum(s.count * s.row_bytes for s in profile.sources)
    keys = sum(g.count * g.key_bytes for g in profile.indexers)
    return TokenBytes(fmt, rows, keys)


def model_size(cfg: MLAConfig, topo: ModelConfig) -> ModelSize:
    bf16 = profile_from_model_config(topo, kv_dtype_bytes=2)
    fp8 = profile_from_model_config(topo, kv_dtype_bytes=1, index_scale_bytes=FP8_INDEX_SCALE_BYTES)
    return ModelSize(
        name=topo.name,
        family=cfg.family,
        layers=cfg.num_layers,
        index_producers=len(topo.index_producers),
        parameters=param_count(cfg),
        kv_per_token=(token_bytes(bf16, "bf16"), token_bytes(fp8, "fp8")),
        mtp=bool(topo.draft_layers),
    )


def model_size_from_dir(path: str | Path, mtp: bool = False) -> ModelSize | None:
    """The size of a Hugging Face model directory (``mtp``: its KV as served with the MTP
    drafter); None for the engine's own format and for DeepSeek-V4 (its parameters are not
    counted here: ``hf_size`` counts MLA families)."""
    if not is_hf_model_dir(path) or is_v4_model_dir(path):
        return None
    return model_size(*hf_family(path, mtp=mtp))
