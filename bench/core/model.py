"""``bench-glm``: the random-weight model of the capacity, profiling and serving benchmarks."""

from __future__ import annotations

from dhisparse.family.config import LayerSpec, ModelConfig, SourceSpec

BENCH_GLM = "bench-glm"


def bench_model_config(layers: int, k: int) -> ModelConfig:
    """GLM-style IndexShare at a size that makes the GPU, not Python, do the work: MLA rows of
    576 elements (512 latent + 64 RoPE, bf16), producers every 4 layers."""
    specs = []
    for i in range(layers):
        if i % 4 == 0:
            specs.append(LayerSpec(source=i, index="producer"))
        else:
            specs.append(LayerSpec(source=i, index="follower", leader=i - i % 4))
    return ModelConfig(
        name=BENCH_GLM, vocab_size=264, d_model=1024, n_heads=16, d_latent=512, d_rope=64,
        d_ff=2048, n_index_heads=8, d_index=64, index_topk=k,
        sources=tuple(SourceSpec() for _ in range(layers)), layers=tuple(specs),
        tie_embeddings=False, dtype="bfloat16", max_position=1 << 20,
    )  # fmt: skip
