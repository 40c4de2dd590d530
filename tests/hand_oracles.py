"""Expected values computed the slow, obvious way, shared by the tests that check the
vectorised code against them (plain Python loops, no project code)."""

from __future__ import annotations


def served_tau_by_hand(rows: list[list[int]], k: int) -> float:
    """Tokens per verify step of a fixed-k chain over per-request acceptance rows: each
    request from position 0, a step at position t accepts min(k, m_t) plus the bonus and
    moves past what it produced."""
    tokens = steps = 0
    for m in rows:
        t = 0
        while t < len(m):
            adv = min(k, m[t]) + 1
            tokens += adv
            steps += 1
            t += adv
    return tokens / steps


def mser_criteria(z: list) -> list:
    """White's MSER statistic for every truncation ``d`` in ``0..n//2``: the squared
    deviations of ``z[d:]`` from their mean over ``(n - d)^2``, in the arithmetic of the
    values given (floats, or ``Fraction`` for exact ties). Empty for ``n < 2``."""
    n = len(z)
    crit = []
    for d in range(n // 2 + 1 if n >= 2 else 0):
        tail = z[d:]
        mean = sum(tail) / len(tail)
        crit.append(sum((v - mean) ** 2 for v in tail) / len(tail) ** 2)
    return crit
