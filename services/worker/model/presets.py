"""Tiny presets of each topology (small enough that CPU decoding is interactive), and
``glm-10m``, the small target that ``training.target`` trains from scratch."""

from __future__ import annotations

from services.worker.model.config import LayerSpec, ModelConfig, SourceSpec

_COMMON = dict(
    vocab_size=264,  # the byte tokenizer
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


def tiny_glm() -> ModelConfig:
    """GLM-5.x IndexShare: 6 payload layers with their own sources, 2 index producers each
    announcing positions for a group of 3 layers (shared indices, distinct payloads)."""
    layers = (
        LayerSpec(source=0, index="producer"),
        LayerSpec(source=1, index="follower", leader=0),
        LayerSpec(source=2, index="follower", leader=0),
        LayerSpec(source=3, index="producer"),
        LayerSpec(source=4, index="follower", leader=3),
        LayerSpec(source=5, index="follower", leader=3),
    )
    return ModelConfig(
        name="tiny-glm", sources=tuple(SourceSpec() for _ in range(6)), layers=layers, **_COMMON
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
    common = dict(_COMMON, index_topk=16)
    return ModelConfig(
        name="tiny-dsv4",
        sources=(SourceSpec(compress=4, window=8), SourceSpec(compress=1, window=0)),
        layers=layers,
        **common,
    )


def glm_10m() -> ModelConfig:
    """The tiny-glm topology at ~9.8M parameters: the smallest target worth training (on the
    stdlib's Python sources, ``python -m training.target``). bfloat16: the dtype it is
    shipped and served in; training keeps fp32 master weights under bf16 autocast."""
    base = tiny_glm()
    return ModelConfig(
        **dict(
            _COMMON,
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


PRESETS = {"tiny-glm": tiny_glm, "tiny-dsv4": tiny_dsv4, "glm-10m": glm_10m}


def preset(name: str) -> ModelConfig:
    try:
        cfg = PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None
    cfg.validate()
    return cfg
