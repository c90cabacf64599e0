"""DeepSeek-V4's KV compressor: one compressed row per ``rate`` tokens, pooled from the layer's
hidden states with projections of its own (not from the window rows).

Row w of a non-overlapping compressor (HCA) pools the tokens of window w,
``norm(sum_j softmax_j(gate_j + ape_j) * kv_j)``, the softmax per channel over the window's
``rate`` tokens in fp32. An overlapping one (CSA, and the CSA indexer's keys) projects every
token to two series ``[Ca | Cb]`` of ``dim`` channels; row w pools Cb of window w together with
Ca of window w - 1 (a softmax over ``2 * rate`` slots; row 0 has no previous window). Rows are
rotated at position ``w * rate``, the window's first token, and a query at position t sees row
w iff ``w < (t + 1) // rate``.

The state carries what a later call needs: the projected tokens of the unfinished window, the
last finished window's projections (overlapping), and the rows so far. ``project`` and
``pool`` are the same math without the state, for a caller that keeps the projections itself
(the engine's per-slot rings, ``v4_serving``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dhisparse.family.rope_spec import RopeSpec
from services.worker.model.v4_norm import RMSNorm
from services.worker.model.v4_rope import rope_tail


@dataclass
class CompressorState:
    """One sequence's compressor state; empty at the sequence's start."""

    pending_kv: torch.Tensor | None = None  # [p, width] projected tokens of the open window
    pending_gate: torch.Tensor | None = None  # [p, width] their gates (ape not yet added)
    carry_kv: torch.Tensor | None = None  # [1, rate, width] overlapping: the last window's
    carry_gate: torch.Tensor | None = None  # [1, rate, width] its gates (ape not added)
    rows: torch.Tensor | None = None  # [rows, dim] every row so far


class Compressor(nn.Module):
    """``wkv`` / ``wgate`` [width, hidden], ``ape`` [rate, width], ``norm`` [dim]; width is
    ``2 * dim`` when ``overlap``, else ``dim``."""

    def __init__(
        self, hidden: int, dim: int, rate: int, overlap: bool, rope: RopeSpec, rope_dim: int,
        eps: float,
    ) -> None:  # fmt: skip
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.rope, self.rope_dim = rope, rope_dim
        self.wkv = nn.Linear(hidden, width, bias=False)
        self.wgate = nn.Linear(hidden, width, bias=False)
        self.ape = nn.Parameter(torch.empty(rate, width))
        self.norm = RMSNorm(dim, eps)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, hidden] -> [N, 2 * width]: each token's ``wkv`` then ``wgate`` projection,
        what a window's row is pooled from."""
        return torch.cat([self.wkv(x), self.wgate(x)], dim=-1)

    def pool(
        self, kv: torch.Tensor, gate: torch.Tensor, prev_kv: torch.Tensor | None,
        prev_gate: torch.Tensor | None, rows: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The rows ``rows`` [w] from their windows' projections ``kv``, ``gate``
        [w, rate, width] (ape not added) -> [w, dim], rotated at each window's first token.
        Overlapping: ``prev_kv`` / ``prev_gate`` [w, rate, width] are the previous windows'
        (gate -inf where a row has none: row 0); non-overlapping: None."""
        gate = gate + self.ape
        if self.overlap:
            d = self.dim
            kv = torch.cat([prev_kv[..., :d], kv[..., d:]], dim=1)
            gate = torch.cat([prev_gate[..., :d] + self.ape[:, :d], gate[..., d:]], dim=1)
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        pooled = self.norm((kv * weights).sum(dim=1))  # [w, dim]
        return rope_tail(pooled, rows * self.rate, self.rope, self.rope_dim)

    def extend(self, x: torch.Tensor, state: CompressorState) -> torch.Tensor:
        """x: [N, hidden] the next N tokens of the sequence -> [rows, dim], every row so far
        (those of the windows these tokens finish appended to ``state``)."""
        kv, gate = self.wkv(x), self.wgate(x)
        if state.pending_kv is not None:
            kv = torch.cat([state.pending_kv, kv])
            gate = torch.cat([state.pending_gate, gate])
        n_windows = kv.shape[0] // self.rate
        done = n_windows * self.rate
        state.pending_kv, state.pending_gate = kv[done:], gate[done:]
        if state.rows is None:
            state.rows = x.new_zeros((0, self.dim))
        first = state.rows.shape[0]
        if n_windows:
            kv = kv[:done].view(n_windows, self.rate, -1)
            gate = gate[:done].view(n_windows, self.rate, -1)
            prev_kv = prev_gate = None
            if self.overlap:  # window w - 1's projections; before the first, none (gate -inf)
                carry_kv = torch.zeros_like(kv[:1]) if state.carry_kv is None else state.carry_kv
                carry_gate = (
                    torch.full_like(gate[:1], float("-inf"))
                    if state.carry_gate is None
                    else state.carry_gate
                )
                prev_kv, prev_gate = (
                    torch.cat([carry_kv, kv[:-1]]),
                    torch.cat([carry_gate, gate[:-1]]),
                )
                state.carry_kv, state.carry_gate = kv[-1:].clone(), gate[-1:].clone()
            rows = torch.arange(n_windows, device=x.device) + first
            state.rows = torch.cat([state.rows, self.pool(kv, gate, prev_kv, prev_gate, rows)])
        return state.rows


def visible_rows(positions: torch.Tensor, n_rows: int, rate: int) -> torch.Tensor:
    """[N, n_rows] bool: row w is visible to the query at position t iff w < (t + 1) // rate."""
    rows = torch.arange(n_rows, device=positions.device)
    return rows.unsqueeze(0) < ((positions + 1) // rate).unsqueeze(-1)
