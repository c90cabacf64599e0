"""What an engine serves, loaded as its configuration says: the model on this rank (its part of
the layout) and the MTP layer's hot head, the tokenizer, and the tokens that end a request."""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from dhisparse.family.generation import eos_token_ids, token_ids
from dhisparse.family.presets import PRESETS
from dhisparse.paths import resolve_path
from dhisparse.tokenizer import Tokenizer, load_tokenizer
from services.worker.engine.config import EngineConfig
from services.worker.engine.v4_check import check_v4_serving
from services.worker.model.decoder import SparseDecoder
from services.worker.model.hot_vocab import HotHead
from services.worker.model.mla_decoder import MLADecoder
from services.worker.model.v4_serving import V4Model
from services.worker.parallel.comm import Comm
from services.worker.speculative.drafters.mtp import MTPDrafter
from services.worker.speculative.token_map import hot_ids, read_token_map
from services.worker.weights.model_io import DTYPES, load_model


class Served(NamedTuple):
    model: SparseDecoder
    hot_head: HotHead | None  # the MTP layer's draft head over its hot ids (None: all ids)


def serving_model(cfg: EngineConfig, model: SparseDecoder | None, comm: Comm) -> Served:
    """``model`` (or the one ``cfg.model`` names, loaded as this rank's part) as the engine
    serves it: the top-k and the attention backend ``cfg`` asks for; and the hot head of its
    MTP layer where ``cfg.speculation`` asks for one (``hot_head``)."""
    check_v4_serving(cfg, model)
    ranked = _token_map(cfg)  # a bad map stops start-up before any weight is read
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
    return Served(model, _hot_head(cfg, model, ranked))


def _hot_head(cfg: EngineConfig, model: SparseDecoder, ranked: list[int] | None) -> HotHead | None:
    """The MTP layer's draft head over the hot ids ``cfg.speculation`` names (``ranked``: its
    token map's ids, ``_token_map``), a copy of ``model.mtp_head``'s rows made here once; None
    without a hot vocabulary."""
    ids = hot_ids(cfg.speculation, model.cfg.vocab_size, ranked)
    if ids is None:
        return None
    if not isinstance(model, MLADecoder | V4Model) or model.mtp is None:
        raise ValueError("the MTP drafter needs a target loaded with its MTP layer")
    return HotHead(model.mtp_head, ids)


def _token_map(cfg: EngineConfig) -> list[int] | None:
    """The token map's ids, read and checked; None without one. A hot vocabulary is refused
    under tensor parallelism: each rank holds a slice of the head by vocabulary, and the hot
    ids are not cut to it."""
    spec = cfg.speculation
    if spec.hot_vocab and cfg.parallel.world_size > 1:
        raise ValueError(
            "--speculative-token-map and --draft-vocab-size need a worker on one rank (the MTP "
            "head is split by vocabulary over the ranks), not --tensor-parallel-size "
            f"{cfg.parallel.world_size}"
        )
    return read_token_map(spec.token_map) if spec.token_map is not None else None


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
