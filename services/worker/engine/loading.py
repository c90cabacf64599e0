"""What an engine serves, loaded as its configuration says: the model on this rank (its part of
the layout), the tokenizer, and the tokens that end a request."""

from __future__ import annotations

from dataclasses import replace

from dhisparse.family.generation import eos_token_ids, token_ids
from dhisparse.family.presets import PRESETS
from dhisparse.paths import resolve_path
from dhisparse.tokenizer import Tokenizer, load_tokenizer
from services.worker.engine.config import EngineConfig
from services.worker.engine.v4_check import check_v4_serving
from services.worker.model.decoder import SparseDecoder
from services.worker.parallel.comm import Comm
from services.worker.speculative.drafters.mtp import MTPDrafter
from services.worker.weights.model_io import DTYPES, load_model


def serving_model(cfg: EngineConfig, model: SparseDecoder | None, comm: Comm) -> SparseDecoder:
    """``model`` (or the one ``cfg.model`` names, loaded as this rank's part) as the engine
    serves it: the top-k and the attention backend ``cfg`` asks for."""
    check_v4_serving(cfg, model)
    if model is None:
        serving = cfg.serving_dtype()
        model = load_model(
            cfg.model, device=cfg.device, dtype=DTYPES[serving] if serving else None,
            seed=cfg.seed, mtp=cfg.speculation.drafter == MTPDrafter.kind,
            weight_dtype=cfg.served_weights(), fp8_mode=cfg.fp8_mode, parallel=cfg.parallel,
            comm=comm,
        )  # fmt: skip
    if cfg.top_k_rows is not None:
        model.cfg = replace(model.cfg, index_topk=cfg.top_k_rows)
    if cfg.backend(cfg.attention_backend) == "triton":
        model.use_triton_attention()
    return model


def tokenizer_and_ends(
    cfg: EngineConfig, model: SparseDecoder, tokenizer: Tokenizer | None
) -> tuple[Tokenizer, frozenset[int]]:
    """The tokenizer (``tokenizer``, else the model directory's) and every token that ends a
    request: the model's, the tokenizer's, and those the checkpoint's config.json and
    generation_config.json list (GLM-5 names three)."""
    model_dir = None if cfg.model in PRESETS else resolve_path(cfg.model)
    tok = tokenizer or load_tokenizer(model_dir)
    ends = {*token_ids(model.cfg.eos_token_id), tok.eos_token_id} | set(eos_token_ids(model_dir))
    return tok, frozenset(ends)
