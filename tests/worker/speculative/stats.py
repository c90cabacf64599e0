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


def chi2_homogeneity(
    groups: list[tuple[torch.Tensor, torch.Tensor]], min_expected: float = 5.0
) -> tuple[float, int]:
    """Whether two samples follow one law, over several independent groups at once. Each group
    is the two samples' counts [C] over the same cells; cells whose pooled count is expected
    below ``min_expected`` in either sample are pooled into one cell per group. -> (p-value,
    degrees of freedom): the 2 x C contingency statistic summed over groups, with sum(cells - 1)
    degrees of freedom."""
    stat, df = 0.0, 0
    for a, b in groups:
        a, b = a.double(), b.double()
        na, nb = float(a.sum()), float(b.sum())
        if na == 0 or nb == 0:
            continue
        share = (a + b) / (na + nb)  # each cell's probability under one law
        small = share * min(na, nb) < min_expected
        cells = [(a[~small], b[~small], share[~small])]
        if float(share[small].sum()) * min(na, nb) >= min_expected:
            cells.append((a[small].sum(0, keepdim=True), b[small].sum(0, keepdim=True),
                          share[small].sum(0, keepdim=True)))  # fmt: skip
        oa, ob, p = (torch.cat(x) for x in zip(*cells, strict=True))
        if len(p) < 2:
            continue
        stat += float(
            (((oa - na * p) ** 2) / (na * p)).sum() + (((ob - nb * p) ** 2) / (nb * p)).sum()
        )
        df += len(p) - 1
    if df == 0:
        raise ValueError("no group has enough expected counts for a chi-square test")
    return chi2_sf(stat, df), df
