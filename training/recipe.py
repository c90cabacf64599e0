"""The shipped model's recipe: its architecture (a ``glm_moe_dsa`` config.json: GLM-5.2's
IndexShare, MoE with a shared expert, one MTP layer trained jointly) and how it is trained (a
4K phase, dense then sparse attention, then a short 16K phase so that the long contexts it
serves are not pure extrapolation; then its block drafters against the released target), as
data the pipeline (``training.pipeline``) runs.

``MICRO`` is the same recipe at a size a CPU trains in seconds (the pipeline's tests)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The vocabulary rows past the tokenizer's ids: the last row is a block-diffusion drafter's
# mask token (``hf_config.topology``), which no prompt may hold.
VOCAB_PAD = 64


@dataclass(frozen=True)
class Phase:
    """One training run of the target; a later phase starts from the previous one's weights
    (a fresh optimizer and schedule)."""

    name: str
    seq_len: int
    batch_size: int
    share: float  # of the recipe's target training time
    lr: float
    warmup: int
    dense_frac: float  # share of the phase's steps with dense attention
    kl_queries: int  # queries per sequence of the indexer's KL (0: all)


@dataclass(frozen=True)
class DrafterRecipe:
    """A drafter trained against the released target (``training.drafter.train``), within
    ``seconds`` of one invocation."""

    kind: str
    seconds: float
    seq_len: int
    batch_size: int
    window: int
    blocks_per_seq: int
    lr: float = 1e-3


@dataclass(frozen=True)
class Recipe:
    name: str
    vocab_size: int  # the model's rows: the tokenizer's ids plus VOCAB_PAD
    architecture: tuple[tuple[str, Any], ...]  # config.json fields past the vocabulary's
    phases: tuple[Phase, ...]
    target_s: float  # training time of the target, over its phases
    eval_tokens: int  # held-out predictions per evaluation
    eval_every: int
    drafters: tuple[DrafterRecipe, ...] = ()
    max_shard_mb: float = 15.0

    @property
    def tokenizer_vocab(self) -> int:
        return self.vocab_size - VOCAB_PAD

    def config(self, eos_id: int, pad_id: int) -> dict[str, Any]:
        """The model's config.json, with the tokenizer's special ids."""
        return {
            "architectures": ["GlmMoeDsaForCausalLM"],
            "model_type": "glm_moe_dsa",
            "vocab_size": self.vocab_size,
            **dict(self.architecture),
            "bos_token_id": None,
            "eos_token_id": eos_id,
            "pad_token_id": pad_id,
            "dtype": "bfloat16",
        }


def _architecture(**over: Any) -> tuple[tuple[str, Any], ...]:
    base: dict[str, Any] = dict(
        hidden_size=384, intermediate_size=1024, moe_intermediate_size=128,
        num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=6,
        q_lora_rank=256, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
        first_k_dense_replace=1, index_n_heads=8, index_head_dim=128, index_topk=512,
        indexer_types=["full", "full", "shared", "full", "shared", "full"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=True,
        num_nextn_predict_layers=1, hidden_act="silu", attention_bias=False,
    )  # fmt: skip
    return tuple((base | over).items())


SHIPPED = Recipe(
    name="glm-dsa-mini",
    vocab_size=8192,
    architecture=_architecture(),
    phases=(
        Phase("target-4k", 4096, 16, 0.85, 2e-3, 200, 0.7, 256),
        Phase("target-16k", 16384, 4, 0.15, 4e-4, 20, 0.0, 128),
    ),
    target_s=1500.0,
    eval_tokens=1 << 20,
    eval_every=500,
    drafters=(DrafterRecipe("dflash2", 300.0, 1024, 16, 256, 32),),
)

MICRO = Recipe(
    name="glm-dsa-micro",
    vocab_size=576,
    architecture=_architecture(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=64,
        index_n_heads=2,
        index_head_dim=64,
        index_topk=16,
        indexer_types=["full", "full", "shared", "full"],
    ),
    phases=(
        Phase("target-4k", 64, 2, 0.7, 1e-2, 20, 0.5, 8),
        Phase("target-16k", 128, 1, 0.3, 3e-3, 20, 0.0, 8),
    ),
    target_s=12.0,
    eval_tokens=1024,
    eval_every=0,
    drafters=(DrafterRecipe("dflash2", 3.0, 64, 2, 32, 8),),
)

RECIPES = {r.name: r for r in (SHIPPED, MICRO)}
