"""Eq. 13 beside the measurement: speculation pays while ``N_spec / N_base > TPOT_spec /
TPOT_base``, the share of sessions it keeps against its TPOT ratio. As a gain in decode
throughput (tokens per second over all sessions, each session emitting one token per TPOT):

    predicted gain = (N_spec / N_base) / (TPOT_spec / TPOT_base)

with N the sessions each configuration runs at the load (the mean running in the window) and
TPOT each one's mean time per output token; the measured gain is the ratio of the two runs'
output tokens per second. ``predicted_gain_plan`` takes N from the capacity model instead
(``dhisparse plan`` with and without the MTP layer's KV, each capped at the load): the
prediction that needs no run of the speculating configuration but its TPOT. Pure Python."""

from __future__ import annotations

from dhisparse.capacity.model import sessions_kept_share


def predicted_gain(n_spec: float, n_base: float, tpot_spec: float, tpot_base: float) -> float:
    """Eq. 13's throughput ratio of speculation over none (> 1: it pays)."""
    if min(n_spec, n_base, tpot_spec, tpot_base) <= 0:
        raise ValueError("sessions and TPOTs must be positive")
    return (n_spec / n_base) / (tpot_spec / tpot_base)


def compare(spec: dict, base: dict, planned: dict | None = None, load: int = 0) -> dict | None:
    """Eq. 13's prediction from two runs' metrics (``bench/serving/summary.py`` names) beside
    the measured gain; None when either run lacks a TPOT or sessions. ``planned``: the capacity
    model's sessions per GPU ``{base, mtp}``, whose share kept at ``load`` concurrent sessions
    with the measured TPOT ratio is the prediction made before running (``predicted_gain_plan``)."""
    ts, tb = (m.get("tpot_s") or {} for m in (spec, base))
    ns, nb = spec.get("mean_running"), base.get("mean_running")
    if not (ts.get("mean") and tb.get("mean") and ns and nb and base["output_tokens_per_s"]):
        return None
    predicted = predicted_gain(ns, nb, ts["mean"], tb["mean"])
    measured = spec["output_tokens_per_s"] / base["output_tokens_per_s"]
    ratio = ts["mean"] / tb["mean"]
    plan = None
    if planned is not None:
        plan = sessions_kept_share(planned["mtp"], planned["base"], load or None) / ratio
    return {
        "sessions_spec": ns, "sessions_base": nb, "tpot_ratio": ratio,
        "predicted_gain": predicted, "measured_gain": measured,
        "predicted_over_measured": predicted / measured, "predicted_gain_plan": plan,
        "plan_over_measured": None if plan is None else plan / measured,
    }  # fmt: skip
