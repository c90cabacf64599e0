"""The routed experts of a data-parallel-attention group: each rank attends for its own
requests, and every MoE layer's tokens meet the experts spread over all the ranks.

**Rounds.** Every MoE call a rank makes is one round of the whole group, and every rank takes
part in every round: a rank whose step still runs passes calls ``run`` (it is *active*), a rank
whose step is over calls ``idle`` (it serves the active ranks' tokens with none of its own),
and the step ends for all when a round finds every rank idle. So the ranks need not run the
same passes (one prefills, another decodes, a third has no request at all) nor be at the same
layer in a round: each round begins with one all-gather of every rank's header — active or
not, which MoE layer (its ``key``), how many tokens, and how many (token, choice) pairs go to
each rank — and a rank computes what it receives from rank s with rank s's layer's experts.

**Expert parallel** (each rank holds n_experts / N whole experts): the pairs are sent to the
rank that holds their expert (all-to-all), computed there, and sent back (all-to-all); the
sender weighs and sums each token's k outputs. **Experts split by intermediate dimension**
(tensor-parallel experts): every rank's tokens are gathered to every rank (padded to the
round's largest count), each rank computes its partial sums of all of them, one all-reduce
completes them, and each keeps its own rows.

A round synchronises with the host (the counts decide the exchanges' sizes), so these passes
are not captured as CUDA graphs."""

from __future__ import annotations

import torch
from torch import nn

from dhisparse.family.parallel_layout import RankLayout
from services.worker.parallel.comm import Comm

_ACTIVE, _KEY, _TOKENS, _SEND = 0, 1, 2, 3  # the header's fields; _SEND.. per rank


class ExpertExchange:
    """One model's MoE layers on one rank of a data-parallel-attention group."""

    def __init__(self, comm: Comm, layout: RankLayout) -> None:
        self.comm = comm
        self.layout = layout
        self.expert_parallel = layout.cfg.expert_parallel
        # key -> the MoE layer (``model.mla_moe.MoE``: its ``gate`` and ``experts``)
        self._layers: dict[int, nn.Module] = {}
        self.rounds = 0  # rounds this rank took part in
        self.idle_rounds = 0  # of them, rounds it served with no tokens of its own

    def register(self, key: int, moe: nn.Module) -> None:
        """MoE layer ``key`` (its layer index) of this rank's model."""
        self._layers[key] = moe

    def run(self, key: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """One round in which this rank is active: x [n, D] its tokens at MoE layer ``key``,
        idx / w [n, k] their routed experts (global ids) and weights -> [n, D] the weighted sum
        of each token's routed experts' outputs, in x's dtype."""
        out = self._round(key, x, idx, w)
        assert out is not None  # an active rank never finds the group idle
        return out

    def idle(self) -> None:
        """Serves the other ranks' rounds, with no tokens of this rank's, until a round finds
        every rank idle (this rank's step is over; the group's is once all are)."""
        while self._round(None, None, None, None) is not None:
            self.idle_rounds += 1

    # ---- one round ----------------------------------------------------------------------------
    def _template(self) -> nn.Module:
        return next(iter(self._layers.values()))

    def _round(
        self,
        key: int | None,
        x: torch.Tensor | None,
        idx: torch.Tensor | None,
        w: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """The result of an active rank's round; for an idle rank, an empty tensor while some
        rank is active and None once none is."""
        n_ranks, me = self.comm.size, self.comm.rank
        router = self._template().gate.weight
        if x is None:  # idle: no tokens, in the dtype and on the device the others use
            x = router.new_zeros((0, router.shape[1]))
            k = self._template().gate.spec.top_k
            idx = torch.zeros((0, k), dtype=torch.int64, device=router.device)
            w = torch.zeros((0, k), dtype=torch.float32, device=router.device)
        assert idx is not None and w is not None
        order = dest = None
        send = [0] * n_ranks
        if self.expert_parallel:
            per_rank = self.layout.experts().size
            dest = idx.reshape(-1) // per_rank
            order = torch.argsort(dest, stable=True)  # pairs grouped by the rank they go to
            send = torch.bincount(dest, minlength=n_ranks).tolist()
        header = torch.tensor(
            [[key is not None, key or 0, x.shape[0], *send]], dtype=torch.int64,
            device=router.device,
        )  # fmt: skip
        headers = self.comm.all_gather(header, dim=0).tolist()  # [N, 3 + N]
        if not any(h[_ACTIVE] for h in headers):
            return None
        self.rounds += 1
        if self.expert_parallel:
            assert order is not None and dest is not None
            out = self._dispatch(headers, me, x, idx, w, order)
        else:
            out = self._gather(headers, me, x, idx, w)
        return out

    def _dispatch(
        self,
        headers: list[list[int]],
        me: int,
        x: torch.Tensor,
        idx: torch.Tensor,
        w: torch.Tensor,
        order: torch.Tensor,
    ) -> torch.Tensor:
        """Expert parallel: pairs to their experts' ranks and back."""
        n, k = idx.shape
        send = [headers[me][_SEND + j] for j in range(len(headers))]
        recv = [h[_SEND + me] for h in headers]
        per_rank = self.layout.experts().size
        rows = self.comm.all_to_all(x[order // k], send, recv)
        local = self.comm.all_to_all((idx.reshape(-1)[order] % per_rank).unsqueeze(1), send, recv)
        outs, at = [], 0
        for h, m in zip(headers, recv, strict=True):
            if m:
                experts = self._layers[h[_KEY]].experts
                ones = torch.ones((m, 1), dtype=torch.float32, device=x.device)
                outs.append(experts(rows[at : at + m], local[at : at + m], ones))
            at += m
        y = torch.cat(outs) if outs else x.new_zeros((0, x.shape[1]))
        back = self.comm.all_to_all(y, recv, send)  # this rank's pairs, in ``order``
        pairs = torch.empty_like(back).index_copy_(0, order, back)
        return (pairs.view(n, k, x.shape[1]).float() * w.unsqueeze(-1)).sum(dim=1).to(x.dtype)

    def _gather(
        self, headers: list[list[int]], me: int, x: torch.Tensor, idx: torch.Tensor,
        w: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Experts split by intermediate dimension: every rank's tokens everywhere, partial
        sums, one all-reduce."""
        counts = [h[_TOKENS] for h in headers]
        m = max(counts)
        n_experts = self._template().gate.spec.n_routed
        pad = m - x.shape[0]
        xs = self.comm.all_gather(torch.cat([x, x.new_zeros((pad, x.shape[1]))]), dim=0)
        # padding rows choose the skip bucket (id n_experts): they contribute nothing
        ids = self.comm.all_gather(torch.cat([idx, idx.new_full((pad, idx.shape[1]), n_experts)]),
                                   dim=0)  # fmt: skip
        ws = self.comm.all_gather(torch.cat([w, w.new_zeros((pad, w.shape[1]))]), dim=0)
        y = xs.new_zeros(xs.shape)
        for s, (h, c) in enumerate(zip(headers, counts, strict=True)):
            if c:
                rows = slice(s * m, s * m + c)
                y[rows] = self._layers[h[_KEY]].experts(xs[rows], ids[rows], ws[rows])
        y = self.comm.all_reduce(y)
        return y[me * m : me * m + x.shape[0]]
