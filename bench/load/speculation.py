"""Eq. 13 beside the measurement: speculation pays while ``N_spec / N_base > TPOT_spec /
TPOT_base``, the share of sessions it keeps against its TPOT ratio. As a gain in decode
throughput (tokens per second over all sessions, each session emitting one token per TPOT):

    predicted gain = (N_spec / N_base) / (TPOT_spec / TPOT_base)

with N the sessions each configuration runs at the load (the mean running in the window) and
TPOT each one's mean time per output token; the measured gain is the ratio of the two runs'
output tokens per second. Pure Python."""

from __future__ import annotations

from dhisparse.capacity.model import sessions_kept_share


def predicted_gain(n_spec: float, n_base: float, tpot_spec: float, tpot_base: float) -> float:
    """Eq. 13's throughput ratio of speculation over none (> 1: it pays)."""
    if min(n_spec, n_base, tpot_spec, tpot_base) <= 0:
        raise ValueError("sessions and TPOTs must be positive")
    return (n_spec / n_base) / (tpot_spec / tpot_base)


def compare(spec: dict, base: dict) -> dict | None:
    """Eq. 13's prediction from two runs' metrics (``bench/serving/summary.py`` names) beside
    the measured gain; None when either run lacks a TPOT or sessions."""
    ts, tb = (m.get("tpot_s") or {} for m in (spec, base))
    ns, nb = spec.get("mean_running"), base.get("mean_running")
    if not (ts.get("mean") and tb.get("mean") and ns and nb and base["output_tokens_per_s"]):
        return None
    predicted = predicted_gain(ns, nb, ts["mean"], tb["mean"])
    measured = spec["output_tokens_per_s"] / base["output_tokens_per_s"]
    return {
        "sessions_spec": ns, "sessions_base": nb,
        "share_kept": sessions_kept_share(round(ns), max(1, round(nb))) if nb >= 0.5 else None,
        "tpot_ratio": ts["mean"] / tb["mean"], "predicted_gain": predicted,
        "measured_gain": measured, "predicted_over_measured": predicted / measured,
    }  # fmt: skip
