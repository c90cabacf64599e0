"""Presets: small models with seeded random weights (small enough that CPU decoding is
interactive), and ``glm-10m``, the small target that ``training.target`` trains from scratch.

A preset's definition is one of three kinds:

- ``FamilyPreset``: a real family's model, defined as its checkpoint is, by a config.json that
  ``hf_config`` reads; ``io.build_model`` builds it as the MLADecoder. ``tiny-glm`` is a tiny
  GLM-5 (``glm_moe_dsa``).
- ``V4Preset``: a DeepSeek-V4 model (``deepseek_v4``), defined by its config.json as
  ``v4_config`` reads a checkpoint's; ``io.build_model`` builds it as the engine's ``V4Model``.
- ``ModelConfig``: the home-made family (DSAModel), kept as test fixtures for topologies no
  released family has yet (shared Reuse / Reindex sources, compression: ``tiny-dsv4``), for
  the IndexShare fixture ``training.target`` trains (``tiny-indexshare``), and ``glm-10m``.

This module is pure Python: the capacity model and the gateway import it without torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from dhisparse.family.config import LayerSpec, ModelConfig, SourceSpec
from dhisparse.family.hf_config import MLAConfig, parse_config, topology
from dhisparse.family.v4_config import V4Config, parse_v4_config, v4_topology

# The byte tokenizer's ids (dhisparse.tokenizer.byte_level): 256 bytes and 8 special tokens.
BYTE_VOCAB = 264
BYTE_BOS, BYTE_EOS, BYTE_MASK = 256, 257, 259


@dataclass(frozen=True)
class FamilyPreset:
    """A real family's model as a preset: ``config`` is its config.json, read by ``hf_config``
    exactly as a checkpoint's is; the weights are seeded random (``io.build_model``)."""

    name: str
    config: dict[str, Any]
    # The drafters' block mask. hf_config's topology takes the last embedding row (a released
    # vocabulary's padding); a byte vocabulary has no padding, and its last id is a chat token.
    mask_token_id: int

    def parse(self, mtp: bool = False) -> tuple[MLAConfig, ModelConfig]:
        """(the model's math, the engine's topology), as ``hf_dir.hf_family`` reads them from a
        model directory; ``mtp``: the topology with the config's MTP layer (``--drafter mtp``)."""
        cfg = parse_config(self.config)
        return cfg, replace(topology(cfg, self.name, mtp=mtp), mask_token_id=self.mask_token_id)


@dataclass(frozen=True)
class V4Preset:
    """A DeepSeek-V4 model as a preset: ``config`` is its config.json, read by ``v4_config``
    exactly as a checkpoint's is; the weights are seeded random (``io.build_model``)."""

    name: str
    config: dict[str, Any]

    def parse(self, mtp: bool = False) -> tuple[V4Config, ModelConfig]:
        """(the model's math, the engine's topology); ``mtp``: with the MTP layer."""
        cfg = parse_v4_config(self.config)
        return cfg, v4_topology(cfg, self.name, mtp=mtp)


Definition = ModelConfig | FamilyPreset | V4Preset

_HOME_MADE = dict(
    vocab_size=BYTE_VOCAB,
    d_model=128,
    n_heads=4,
    d_latent=64,
    d_rope=16,
    d_ff=352,
    n_index_heads=4,
    d_index=32,
    index_topk=32,
    max_position=65536,
    # Untied: with random weights a tied head predicts the input token back (a fixed point).
    tie_embeddings=False,
)


def tiny_glm() -> FamilyPreset:
    """GLM-5 (``glm_moe_dsa``) at the home-made presets' size. IndexShare as GLM-5.2 writes it
    (layer i runs its indexer iff max(i - offset + 1, 0) % freq == 0): producers 0 and 3, each
    announcing positions for a group of 3 layers with payloads of their own. MLA rows of
    64 + 16 elements; 4 routed experts, top-2, and a shared one above the first (dense) layer."""
    config = {
        "model_type": "glm_moe_dsa",
        "vocab_size": BYTE_VOCAB,
        "bos_token_id": BYTE_BOS,
        "eos_token_id": BYTE_EOS,
        "hidden_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "index_n_heads": 4,
        "index_head_dim": 32,
        "index_topk": 32,
        "index_topk_freq": 3,
        "index_skip_topk_offset": 1,
        "intermediate_size": 352,
        "first_k_dense_replace": 1,
        "n_routed_experts": 4,
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "max_position_embeddings": 65536,
        # Untied: with random weights a tied head predicts the input token back (a fixed point).
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    return FamilyPreset("tiny-glm", config, mask_token_id=BYTE_MASK)


def tiny_indexshare() -> ModelConfig:
    """GLM-5.x IndexShare in the home-made family: 6 payload layers with their own sources, 2
    index producers each announcing positions for a group of 3 layers (shared indices,
    distinct payloads)."""
    layers = (
        LayerSpec(source=0, index="producer"),
        LayerSpec(source=1, index="follower", leader=0),
        LayerSpec(source=2, index="follower", leader=0),
        LayerSpec(source=3, index="producer"),
        LayerSpec(source=4, index="follower", leader=3),
        LayerSpec(source=5, index="follower", leader=3),
    )
    return ModelConfig(
        name="tiny-indexshare",
        sources=tuple(SourceSpec() for _ in range(6)),
        layers=layers,
        **_HOME_MADE,
    )


def tiny_dsv4() -> ModelConfig:
    """DeepSeek-V4 style: a shared source (m=4, local window 8) read by its owner, a Reuse
    consumer and a Reindex consumer; then an uncompressed source with a Reuse consumer."""
    layers = (
        LayerSpec(source=0, index="producer"),
        LayerSpec(source=0, index="reuse", leader=0),
        LayerSpec(source=0, index="producer"),  # Reindex consumer of source 0
        LayerSpec(source=1, index="producer"),
        LayerSpec(source=1, index="reuse", leader=3),
    )
    common = dict(_HOME_MADE, index_topk=16)
    return ModelConfig(
        name="tiny-dsv4",
        sources=(SourceSpec(compress=4, window=8), SourceSpec(compress=1, window=0)),
        layers=layers,
        **common,
    )


def glm_10m() -> ModelConfig:
    """The IndexShare topology at ~9.8M parameters: the smallest target worth training (on the
    stdlib's Python sources, ``python -m training.target``). bfloat16: the dtype it is
    shipped and served in; training keeps fp32 master weights under bf16 autocast."""
    base = tiny_indexshare()
    return ModelConfig(
        **dict(
            _HOME_MADE,
            name="glm-10m",
            d_model=384,
            n_heads=6,
            d_latent=64,
            d_rope=32,
            d_ff=1024,
            n_index_heads=4,
            d_index=32,
            index_topk=128,
            dtype="bfloat16",
        ),
        sources=base.sources,
        layers=base.layers,
    )


def _scaled(name: str) -> Callable[[], Definition]:
    """The real-dimension preset ``name`` of ``family.scaled`` (which imports this module's
    classes, so it is read when one is asked for)."""

    def definition() -> Definition:
        from dhisparse.family.scaled import SCALED, V4_SCALED

        return {**SCALED, **V4_SCALED}[name]

    return definition


PRESETS: dict[str, Callable[[], Definition]] = {
    "tiny-glm": tiny_glm,
    "tiny-indexshare": tiny_indexshare,
    "tiny-dsv4": tiny_dsv4,
    "glm-10m": glm_10m,
    # real dimensions, tens of GB of random weights built on the GPU in place (vLLM's
    # ``--load-format dummy``): speed runs of the whole stack where no checkpoint is at hand
    **{name: _scaled(name) for name in ("v32-scaled", "glm5-scaled", "v4flash-scaled")},
}
# the presets of real dimensions: built on their device in place, never on the host first
REAL_DIMENSION = frozenset({"v32-scaled", "glm5-scaled", "v4flash-scaled"})


def preset(name: str) -> Definition:
    """A preset's definition (what ``weights.model_io.build_model`` builds)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name]()


def preset_topology(name: str) -> ModelConfig:
    """A preset's topology, validated: what the KV cache, the engine and the capacity model
    see."""
    d = preset(name)
    topo = d if isinstance(d, ModelConfig) else d.parse()[1]
    topo.validate()
    return topo


def home_made(name: str) -> ModelConfig:
    """A preset of the home-made family, validated; a real family's preset is a ValueError."""
    d = preset(name)
    if not isinstance(d, ModelConfig):
        raise ValueError(f"preset {name!r} is a {d.config['model_type']} model, not home-made")
    d.validate()
    return d
