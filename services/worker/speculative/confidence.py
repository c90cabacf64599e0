"""DSpark's confidence scheduler: per-request verification widths K_r from per-slot confidence.

Request r's confidence head estimates c_{r,k}, the chance proposal k is accepted given that
1..k-1 were. Its prefix survival ``s_{r,k} = Π_{j≤k} c_{r,j}`` is the chance proposal k is
accepted at all, so verifying K_r queries yields ``1 + Σ_{k<K_r} s_{r,k}`` tokens in
expectation (the anchor's correction or bonus always comes).

Rule (greedy across the batch): every request verifies its anchor. The remaining proposals
(r, k) are admitted in order of decreasing survival; survival never grows with k, so this
always extends some request's prefix (ties go to the smaller k). Admission stops at the token
budget, below ``min_survival``, and, given a profiled cost curve, at the number of admitted
proposals m that maximises the round's throughput ``Θ(m) = (R + Σ_{first m} s) / cost(R + m)``
(tokens emitted per second of verify pass). Without a cost curve every proposal within the
budget and the survival floor is admitted.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CostCurve:
    """Profiled seconds of a verify pass by the tokens it verifies: (tokens, seconds) points
    with increasing tokens, interpolated linearly, flat below the first point and along the
    last segment's slope above the last (one point: a constant)."""

    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a cost curve needs at least one point")
        xs = [x for x, _ in self.points]
        if xs != sorted(set(xs)):
            raise ValueError("cost curve tokens must increase")

    def __call__(self, tokens: int) -> float:
        pts = self.points
        if len(pts) == 1 or tokens <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in itertools.pairwise(pts):
            if tokens <= x1:
                return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        return y1 + (y1 - y0) * (tokens - x1) / (x1 - x0)


def survival(confidence: torch.Tensor) -> torch.Tensor:
    """[R, K-1] per-slot acceptance estimates -> [R, K-1] prefix survivals."""
    return torch.cumprod(confidence.float().clamp(0.0, 1.0), dim=-1)


@dataclass(frozen=True)
class ConfidenceScheduler:
    token_budget: int | None = None  # verified tokens per round, anchors included
    cost: CostCurve | None = None
    min_survival: float = 0.0

    def widths(self, confidence: torch.Tensor, caps: Sequence[int]) -> list[int]:
        """confidence: [R, K_max-1]; caps: [R] the most queries request r may verify -> K_r."""
        surv = survival(confidence).tolist()
        r = len(caps)
        budget = self.token_budget if self.token_budget is not None else r * max(caps, default=1)
        if budget < r:
            raise ValueError(f"a token budget of {budget} cannot verify {r} anchors")
        cands = sorted(
            ((-s, k, i) for i in range(r) for k, s in enumerate(surv[i][: caps[i] - 1])),
        )
        cands = [c for c in cands if -c[0] >= self.min_survival][: budget - r]
        m = len(cands)
        if self.cost is not None:
            gains = [float(r)]
            for neg_s, _, _ in cands:
                gains.append(gains[-1] - neg_s)
            m = max(range(len(gains)), key=lambda j: (gains[j] / self.cost(r + j), -j))
        widths = [1] * r
        for _, _, i in cands[:m]:
            widths[i] += 1
        return widths
