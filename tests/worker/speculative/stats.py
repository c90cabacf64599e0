"""Pearson's chi-square goodness-of-fit test, for the distribution tests of this package."""

from __future__ import annotations

import torch


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df): the regularised upper incomplete gamma Q(df/2, x/2)."""
    return float(
        torch.special.gammaincc(
            torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64)
        )
    )


def chi2_test(
    groups: list[tuple[torch.Tensor, torch.Tensor]], min_expected: float = 5.0
) -> tuple[float, int]:
    """Goodness of fit of several independent groups at once. Each group is (observed counts
    [C], expected probabilities [C]); cells expected below ``min_expected`` are pooled into one
    cell per group (dropped with the group if still too small). -> (p-value, degrees of
    freedom): the statistic is the sum over groups, with sum(cells - 1) degrees of freedom."""
    stat, df = 0.0, 0
    for obs, probs in groups:
        n = float(obs.sum())
        if n == 0:
            continue
        exp = probs.double() * n
        big = exp >= min_expected
        o = [*obs.double()[big].tolist()]
        e = [*exp[big].tolist()]
        rest_o, rest_e = float(obs.double()[~big].sum()), float(exp[~big].sum())
        if rest_e >= min_expected:
            o.append(rest_o)
            e.append(rest_e)
        elif rest_e > 0 and e:  # too small to stand alone: fold into the smallest big cell
            j = min(range(len(e)), key=e.__getitem__)
            o[j] += rest_o
            e[j] += rest_e
        if len(e) < 2:
            continue
        stat += sum((oi - ei) ** 2 / ei for oi, ei in zip(o, e, strict=True))
        df += len(e) - 1
    if df == 0:
        raise ValueError("no group has enough expected counts for a chi-square test")
    return chi2_sf(stat, df), df
