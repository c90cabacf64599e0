"""The DeepSeek-V3.2 / GLM-5 decoder (``deepseek_v32``, ``glm_moe_dsa``): one code path, the
families differ only in config (YaRN or plain RoPE, the indexer's RoPE layout, MoE groups,
GLM-5.2's IndexShare), all read by ``hf_config``.

Layer by layer, as the checkpoint names them: input_layernorm, MLA (q-LoRA, the 576-element
stored row), the indexer on ``full`` layers, post_attention_layernorm, then a dense MLP below
``first_k_dense_replace`` and the MoE above. ``weights.mla_names`` maps checkpoint tensor names
onto this module's parameters in one table.

Built with a topology that has the MTP layer (``--drafter mtp``), it holds it as ``mtp``: every
target pass then also writes the MTP layer's KV rows its tokens complete (``_follow_target``),
and ``mtp_step`` runs one MTP-only draft pass (docs/mtp.md)."""

from __future__ import annotations

import torch
from torch import nn

from dhisparse.family.config import ModelConfig
from dhisparse.family.hf_config import MLAConfig
from dhisparse.family.quantization_config import SCALE_SUFFIX
from services.worker.kv.batch import ForwardBatch
from services.worker.model.decoder import ForwardState, SparseDecoder
from services.worker.model.hot_vocab import HotHead
from services.worker.model.layers import RMSNorm
from services.worker.model.mla_layer import MLALayer
from services.worker.model.mla_mtp import MTPLayer, MTPStep
from services.worker.model.rotary import Rotary
from services.worker.model.vocab import VocabEmbedding, vocab_logits
from services.worker.model.weight_format import BF16, WeightFormat
from services.worker.ops.fp8_blockwise import FP8_DTYPE
from services.worker.parallel.shards import Shards
from services.worker.serving.cache import KVCache

# Parameters kept in fp32 whatever the serving dtype, as transformers keeps them.
FP32_PARAMS = ("indexer.weights_proj.weight", "mlp.gate.e_score_correction_bias")


class MLADecoder(SparseDecoder):
    def __init__(
        self,
        cfg: MLAConfig,
        topo: ModelConfig,
        fmt: WeightFormat = BF16,
        shards: Shards | None = None,
    ) -> None:
        """``fmt``: the weights in the serving dtype, or FP8 (``weight_format``). ``shards``:
        this rank's part of a model split over several (``family.parallel_layout``; whole by
        default): every tensor is built in its rank-local shape (``RankLayout.cut``)."""
        super().__init__()
        self._init_topology(topo)
        shards = shards or Shards.single(cfg)
        shards.layout.validate(fmt.fp8)
        self.family = cfg
        self.weight_format = fmt
        self.shards = shards
        vocab = shards.layout.vocab()
        self.vocab_group = shards.attention
        self.expert_exchange = shards.exchange
        self.embed = VocabEmbedding(vocab, cfg.hidden_size, shards.attention)
        self.layers = nn.ModuleList(
            MLALayer(cfg, topo, i, fmt=fmt, shards=shards) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, vocab.size, bias=False)
        )
        drafts = topo.draft_layers
        self.mtp = MTPLayer(cfg, topo, drafts[0], fmt, shards) if drafts else None

    def rotary(self, positions: torch.Tensor) -> Rotary:
        return Rotary(positions, self.family.rope)

    # ---- the MTP layer ---------------------------------------------------------------------
    @property
    def mtp_layer(self) -> int:
        """The MTP layer's index (N, after the target's layers)."""
        return self.cfg.draft_layers[0]

    @property
    def mtp_index_share(self) -> bool:
        """Whether draft steps after the first attend the first step's selection
        (``index_share_for_mtp_iteration``)."""
        return self.family.mtp_index_share

    @property
    def mtp_head(self) -> torch.Tensor:
        """[V / ranks, d] this rank's rows of the MTP layer's head (``shared_head.head``)."""
        assert self.mtp is not None
        return self.mtp.shared_head.head.weight

    def share_lm_head(self) -> None:
        """Uses ``lm_head`` as the MTP head when the checkpoint's ``shared_head.head`` is a
        copy of it (as in the released checkpoints), freeing the copy."""
        mtp, head = self.mtp, self.lm_head
        if (
            mtp is not None
            and head is not None
            and torch.equal(mtp.shared_head.head.weight, head.weight)
        ):
            mtp.shared_head.head = head

    def tie_mtp_head(self) -> None:
        """Makes the MTP layer's head the target's (``lm_head``, or the embedding when tied),
        for a checkpoint that stores no ``shared_head.head`` of its own (``hf_export`` leaves
        the copy out)."""
        assert self.mtp is not None
        head = self.embed if self.lm_head is None else self.lm_head
        self.mtp.shared_head.head.weight = head.weight

    def _follow_target(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, kv: KVCache
    ) -> None:
        """The MTP rows the pass's tokens complete: the token at p with the target's final
        hidden state at p-1 (this pass's, or the carry's for a request's first token) gives
        MTP row p-1, through the layer's input fusion and its KV and index-key projections
        only (its attention and MoE are not needed to write its KV). Every pass records its
        hidden states in the carry."""
        if self.mtp is None:
            return
        ext = kv.follow_carry(batch, hidden)
        before = ext.index(batch.token_req, batch.positions - 1).clamp(min=0)  # p = 0: no row
        x = self.mtp.attn_norm(self.mtp.fuse(self.embed(input_ids), ext.rows[before]))
        i = self.mtp_layer
        st = ForwardState(rotary=self.rotary((batch.positions - 1).clamp(min=0)))
        self._write_source(self.cfg.layers[i].source, self.mtp.attn, x, batch, kv, st)
        self._write_keys(i, self.mtp.indexer, x, kv, st)

    @torch.no_grad()
    def mtp_step(
        self,
        tokens: torch.Tensor,
        batch: ForwardBatch,
        kv: KVCache,
        hidden: torch.Tensor | None = None,
        selection: torch.Tensor | None = None,
        begin: bool = True,
        hot: HotHead | None = None,
    ) -> MTPStep:
        """One MTP-only draft pass: ``tokens`` [R], one per request at ``batch.positions`` (a
        decode-shaped batch writing only the MTP source), each with the hidden state before it
        — ``hidden`` [R, d], or the carry's (the target's at p-1) when None. Writes MTP row
        p-1 (never committed: the verify pass rewrites it) and attends the whole MTP history
        through ``kv``, by its own indexer or, with ``selection`` [R, k], those rows.
        ``begin=False``: the caller already began the pass on ``kv`` (a CUDA graph's runner).
        ``hot``: the logits cover its ids only (``HotHead``, built from ``mtp_head``)."""
        assert self.mtp is not None and kv.carry is not None, "a model loaded with its MTP layer"
        if begin:
            kv.payload.begin(batch)
        if hidden is None:
            hidden = kv.carry.rows_at(batch.slots, batch.positions - 1)
        mtp, i = self.mtp, self.mtp_layer
        x = mtp.fuse(self.embed(tokens), hidden)
        st = ForwardState(rotary=self.rotary(batch.positions - 1))
        a = self._attention(i, mtp, mtp.attn_norm(x), batch, kv, st, None, given=selection)
        y, h = mtp.mlp_norm.add_norm(a, x)  # h = x + a; y = mlp_norm(h)
        g, _ = mtp.shared_head.norm.add_norm(mtp.mlp(y), h)  # shared_head.norm(h + mlp(y))
        if hot is not None:
            logits = hot.logits(g)
            return MTPStep(g, logits, st.selection[i], hot.tokens(logits))
        logits = vocab_logits(g, self.mtp_head, self.vocab_group)
        return MTPStep(g, logits, st.selection[i], logits.argmax(-1))

    def cast(self, dtype: torch.dtype) -> MLADecoder:
        """Casts to the serving dtype, keeping FP32_PARAMS and FP8 block scales in fp32 and
        FP8 weights in FP8."""
        for name, t in [*self.named_parameters(), *self.named_buffers()]:
            if t.dtype == FP8_DTYPE:
                continue
            fp32 = name.endswith(FP32_PARAMS) or name.endswith(SCALE_SUFFIX)
            t.data = t.data.to(torch.float32 if fp32 else dtype)
        return self
