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
last finished window's Ca slice, and the rows so far."""

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
    carry_kv: torch.Tensor | None = None  # [rate, dim] overlapping: last window's Ca
    carry_gate: torch.Tensor | None = None  # [rate, dim] its gates, ape added
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
            gate = gate[:done].view(n_windows, self.rate, -1) + self.ape
            if self.overlap:
                kv, gate = self._overlap(kv, gate, state)
            weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
            pooled = self.norm((kv * weights).sum(dim=1))  # [w, dim]
            positions = (torch.arange(n_windows, device=x.device) + first) * self.rate
            state.rows = torch.cat(
                [state.rows, rope_tail(pooled, positions, self.rope, self.rope_dim)]
            )
        return state.rows

    def _overlap(
        self, kv: torch.Tensor, gate: torch.Tensor, state: CompressorState
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[w, rate, 2 dim] -> [w, 2 rate, dim]: window w's slots are window w - 1's Ca then
        its own Cb; before the first window the Ca slots weigh nothing (gate -inf)."""
        d = self.dim
        ca_kv, ca_gate = kv[..., :d], gate[..., :d]
        prev_kv = torch.zeros_like(ca_kv[:1]) if state.carry_kv is None else state.carry_kv[None]
        prev_gate = (
            torch.full_like(ca_gate[:1], float("-inf"))
            if state.carry_gate is None
            else state.carry_gate[None]
        )
        state.carry_kv, state.carry_gate = ca_kv[-1].clone(), ca_gate[-1].clone()
        slots_kv = torch.cat([torch.cat([prev_kv, ca_kv[:-1]]), kv[..., d:]], dim=1)
        slots_gate = torch.cat([torch.cat([prev_gate, ca_gate[:-1]]), gate[..., d:]], dim=1)
        return slots_kv, slots_gate


def visible_rows(positions: torch.Tensor, n_rows: int, rate: int) -> torch.Tensor:
    """[N, n_rows] bool: row w is visible to the query at position t iff w < (t + 1) // rate."""
    rows = torch.arange(n_rows, device=positions.device)
    return rows.unsqueeze(0) < ((positions + 1) // rate).unsqueeze(-1)
