"""A plain-torch reference of the MTP drafter, written from the NextN forward of vLLM's
``DeepSeekMultiTokenPredictorLayer`` and SGLang's ``DeepseekModelNextN`` (docs/mtp.md):

    u_t = eh_proj(cat[enorm(embed(x_{t+1})), hnorm(h_t)])  ->  decoder layer  ->  shared_head.norm
    ->  shared_head.head

with h_t the target's hidden state after its final norm, the decoder layer transformers' own
(MLA, the DSA indexer's top-k as an attention mask, MoE: the oracle for the target's layers),
run uncached over the whole MTP sequence at positions 0..T-1. Draft step i > 0 appends the row
of the previous step's proposal and its output hidden state (after shared_head.norm), as vLLM
recycles it; with ``share`` (GLM-5.2's ``index_share_for_mtp_iteration``) its query attends
the positions step 0 selected instead of running the indexer. ``V4MTPReference``: DeepSeek-V4's
MTP layer, from DeepSeek's ``MTPBlock``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.hf_tiny import TinyMTP, our_topk_order
from tests.hf_tiny_v4 import TinyV4MTP


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@dataclass(frozen=True)
class RefStep:
    logits: torch.Tensor  # [V] of the step's row
    hidden: torch.Tensor  # [d] after shared_head.norm
    selection: set[int]  # the MTP positions the step's query attended


class MTPReference:
    def __init__(self, target: torch.nn.Module, mtp: TinyMTP) -> None:
        self.target = target
        self.mtp = mtp
        self.eps = target.config.rms_norm_eps

    @torch.no_grad()
    def target_hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """[T, d] the target's hidden states after its final norm (uncached)."""
        with our_topk_order():
            return self.target.model(ids.unsqueeze(0)).last_hidden_state[0].float()

    def fuse(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        embeds = self.target.model.embed_tokens(tokens).float()
        x = torch.cat(
            [_rms(embeds, self.mtp.enorm, self.eps), _rms(hidden, self.mtp.hnorm, self.eps)], -1
        )
        return x @ self.mtp.eh_proj.t()

    @torch.no_grad()
    def run(
        self, u: torch.Tensor, reuse: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, set[int]]:
        """u [T, d] the MTP inputs at positions 0..T-1 -> (hidden after shared_head.norm [T, d],
        logits [T, V], the positions the last query attended); ``reuse``: the last query's
        selection instead of its indexer's."""
        captured: list[torch.Tensor] = []

        def hook(_m, _a, res: torch.Tensor) -> torch.Tensor:
            if reuse is not None:
                res = res.clone()
                width = res.shape[-1]
                row = reuse[:width]
                if len(row) < width:  # as a set: repeat a selected position
                    row = torch.cat([row, row[:1].repeat(width - len(row))])
                res[0, -1] = row.to(res.dtype)
            captured.append(res[0, -1].long())
            return res

        layer = self.mtp.block.model.layers[0]
        handle = layer.self_attn.indexer.register_forward_hook(hook)
        t = u.shape[0]
        try:
            with our_topk_order():
                out = self.mtp.block.model(
                    inputs_embeds=u.unsqueeze(0), position_ids=torch.arange(t).unsqueeze(0)
                )
        finally:
            handle.remove()
        g = out.last_hidden_state[0]
        logits = self.mtp.block.lm_head(g).float()
        visible = {int(p) for p in captured[0] if p < t}
        return g, logits, visible

    def draft(
        self, ids: torch.Tensor, steps: int, tokens: list[int] | None = None, share: bool = False
    ) -> list[RefStep]:
        """The drafter's steps for a request whose committed tokens are ``ids[:-1]`` and whose
        anchor is ``ids[-1]``: step i proposes the token at position n+i+1 (n = len(ids) - 1);
        step i > 0 reads ``tokens[i-1]`` (teacher-forced) or step i-1's argmax."""
        n = len(ids) - 1
        h = self.target_hidden(ids[:n])
        u = self.fuse(ids[1:], h)  # rows 0..n-1: (x_{t+1}, h_t)
        out: list[RefStep] = []
        first: torch.Tensor | None = None
        for i in range(steps):
            g, logits, sel = self.run(u, first if share and i else None)
            out.append(RefStep(logits[-1], g[-1], sel))
            if i == 0:
                first = torch.tensor(sorted(sel))
            if i + 1 == steps:
                break
            nxt = tokens[i] if tokens is not None else int(logits[-1].argmax())
            u = torch.cat([u, self.fuse(torch.tensor([nxt]), g[-1:])])
        return out


# ---- DeepSeek-V4 -------------------------------------------------------------------------------
@dataclass(frozen=True)
class V4RefStep:
    logits: torch.Tensor  # [V] of the step's row
    streams: torch.Tensor  # [hc_mult, d] the block's output streams: the next step's input


class V4MTPReference:
    """DeepSeek-V4's MTP layer as DeepSeek's ``MTPBlock.forward`` (``inference/model.py``)
    computes it, run uncached over the whole MTP sequence at positions 0..T-1:

        S_t = e_proj(enorm(embed(x_{t+1}))) + h_proj(hnorm(H_t))   (per stream)
        S'_t = block(S_t);  logits_t = head(norm(hyper_head(S'_t)))

    with H_t the target's last block's streams (before its hyper head), the block transformers'
    own decoder layer (the oracle for the target's layers), its hyper head and norm the layer's,
    ``head`` the target's. Step i > 0 appends the row of the previous step's proposal and its
    output streams S', as vLLM's ``DeepSeekV4MultiTokenPredictorLayer`` recycles them."""

    def __init__(self, target: torch.nn.Module, mtp: TinyV4MTP) -> None:
        self.target = target
        self.mtp = mtp
        self.eps = target.config.rms_norm_eps

    @torch.no_grad()
    def target_streams(self, ids: torch.Tensor) -> torch.Tensor:
        """[T, hc_mult, d] the target's last block's output streams (uncached)."""
        out: list[torch.Tensor] = []
        layer = self.target.model.layers[-1]
        handle = layer.register_forward_hook(lambda _m, _a, res: out.append(res))
        try:
            self.target.model(ids.unsqueeze(0))
        finally:
            handle.remove()
        return out[0][0].float()

    def fuse(self, tokens: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """tokens [T], streams [T, hc_mult, d] -> the block's input streams [T, hc_mult, d]."""
        e = _rms(self.target.model.embed_tokens(tokens).float(), self.mtp.enorm, self.eps)
        h = _rms(streams, self.mtp.hnorm, self.eps)
        return h @ self.mtp.h_proj.t() + (e @ self.mtp.e_proj.t()).unsqueeze(1)

    @torch.no_grad()
    def run(self, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """s [T, hc_mult, d] the block's inputs at positions 0..T-1 -> (its output streams
        [T, hc_mult, d], logits [T, V])."""
        out: list[torch.Tensor] = []
        layer = self.mtp.block.model.layers[0]

        def given(_m, args):
            return (s.unsqueeze(0), *args[1:])

        before = layer.register_forward_pre_hook(given)
        after = layer.register_forward_hook(lambda _m, _a, res: out.append(res))
        t = s.shape[0]
        try:
            g = self.mtp.block.model(
                inputs_embeds=torch.zeros(1, t, s.shape[-1]),
                position_ids=torch.arange(t).unsqueeze(0),
            ).last_hidden_state[0]
        finally:
            before.remove()
            after.remove()
        return out[0][0], self.target.lm_head(g).float()

    def draft(
        self, ids: torch.Tensor, steps: int, tokens: list[int] | None = None
    ) -> list[V4RefStep]:
        """The drafter's steps for a request whose committed tokens are ``ids[:-1]`` and whose
        anchor is ``ids[-1]``: step i proposes the token at position n+i+1 (n = len(ids) - 1);
        step i > 0 reads ``tokens[i-1]`` (teacher-forced) or step i-1's argmax."""
        n = len(ids) - 1
        s = self.fuse(ids[1:], self.target_streams(ids[:n]))  # rows 0..n-1: (x_{t+1}, H_t)
        out: list[V4RefStep] = []
        for i in range(steps):
            streams, logits = self.run(s)
            out.append(V4RefStep(logits[-1], streams[-1]))
            if i + 1 == steps:
                break
            nxt = tokens[i] if tokens is not None else int(logits[-1].argmax())
            s = torch.cat([s, self.fuse(torch.tensor([nxt]), streams[-1:])])
        return out
