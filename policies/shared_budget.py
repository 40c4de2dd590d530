"""Batch-shared verification budgets with a discretised K: DFly and D-cut (AngelSpec,
arXiv 2607.25852 / 2607.14647), beside the continuous ``confidence`` budget.

Both treat verification as one resource the whole batch shares. The ``n * gamma``
candidate (request, depth) slots are ranked by prefix survival ``a_{r,j}`` (the
calibrated product of the drafter's conditional confidences) and the step verifies a
prefix-closed top-K of them: a slot is in only when every shallower slot of its request is
(survival is non-increasing along the block, and ties are broken in row-major order, so
the top-K by survival is already prefix-closed; :func:`~dspark_sim.policies.scheduler.
schedule_topk`).

* **DFly** sizes K from a fixed set of ratios of the candidate slots, by default
  ``{25, 50, 75, 100} %``: for each ratio ``r`` the step's predicted progress
  ``tau_K = n + sum of the K best survivals`` (the bonus token of every request plus the
  expected accepted drafts) over its profiled latency ``C_K``; the ratio with the best
  ``tau_K / C_K`` wins. ``C_K`` is the step priced by the same :class:`StepCost` the
  default scheduler uses (target table at what the step carries, the draft and context
  terms, the prefill that verification pushes out of the step), so DFly and
  ``confidence`` differ only in how K is searched and when the survivals are read.
  A ratio whose K would not fit the token budget is dropped; when none fits the smallest
  is taken and the engine trims it (as it trims ``fixed:K``). With the ratio set
  ``{100 %}`` DFly verifies every drafted token: it *is* ``fixed:gamma``.
* **D-cut** places the cut anywhere along the same ranked list (K in ``0..n*gamma``, one
  slot of resolution), with the same progress / latency objective. The papers' text is
  not in this repository; their published figures (docs/related-work.md) record that
  DFly saturates past concurrency 48 while D-cut keeps gaining (up to +15.7 %). The
  mechanism modelled here is the one that behaviour points to: DFly's coarsest ratio
  (25 % of the slots) is a floor and its 25-point grid a quantisation; once the best K
  falls between grid points or below the floor (large batches, where each verified token
  displaces compute) DFly over- or under-verifies and D-cut follows the optimum.

Both decide on this step's survivals (synchronous: the drafts are in hand when K is
chosen); ``confidence`` sizes K on survivals two steps old (DSpark's asynchronous
pipeline) and admits by current survival. So ``dcut`` vs ``dfly`` isolates the cost of
the discretisation, ``dcut`` vs ``confidence`` the cost of deciding without this step's
drafts. Cost: one sort of ``n * gamma`` survivals and one priced table slice per step
(the same as ``confidence``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dspark_sim.errors import InputError
from dspark_sim.policies.base import BatchSnapshot
from dspark_sim.policies.registry import Policy, Reads, register
from dspark_sim.policies.scheduler import (
    budget_displacement,
    candidates,
    schedule_topk,
    sorted_desc,
)

DFLY_RATIOS_PCT = (25, 50, 75, 100)


def ratio_counts(ratios_pct: tuple[int, ...], candidates: int) -> np.ndarray:
    """K for each ratio of ``candidates`` slots, rounded half up (25 % of 7 slots: 2)."""
    r = np.asarray(ratios_pct, dtype=np.int64)
    # integer arithmetic: floor(r * N / 100 + 1/2) without float rounding surprises
    return (2 * r * candidates + 100) // 200


def dfly_budget(survival: np.ndarray, cost, ratios_pct: tuple[int, ...] = DFLY_RATIOS_PCT,
                proposed: np.ndarray | None = None) -> int:
    """DFly's K: the ratio of the candidate slots (the ``n * gamma`` drafts, or those
    proposed: ``proposed`` [n] per request) with the best predicted progress / profiled
    latency (first best in ascending K on ties); ratios whose K does not fit the token
    budget are dropped, the smallest is taken when none fits."""
    n, gamma = survival.shape
    if n == 0:
        return 0
    a = sorted_desc(candidates(survival, proposed))
    ks = np.unique(ratio_counts(ratios_pct, a.size))  # ascending, duplicates merged
    # priced counts: verify tokens n + K within the budget (extra_s covers n * gamma)
    size = min(a.size + 1, cost.budget - n + 1, cost.extra_s.size)
    fits = ks[ks < size]
    if fits.size == 0:
        return int(ks[0])
    tau = n + np.concatenate(([0.0], np.cumsum(a[: int(fits[-1])])))
    step_s = cost.step_s(n, int(fits[-1]) + 1)
    score = tau[fits] / step_s[fits]
    return int(fits[int(np.argmax(score))])


def dcut_budget(survival: np.ndarray, cost, proposed: np.ndarray | None = None) -> int:
    """D-cut's K: the best cut anywhere along the ranked slots (the continuous budget on
    this step's own survivals, of the drafts proposed)."""
    if proposed is None:
        return budget_displacement(survival, cost)
    return budget_displacement(survival, cost, survival.shape[0],
                               sorted_desc(candidates(survival, proposed)))


def _dfly(ratios_pct: tuple[int, ...]) -> Callable[[BatchSnapshot], np.ndarray]:
    def decide(s: BatchSnapshot) -> np.ndarray:
        return schedule_topk(s.survival, dfly_budget(s.survival, s.cost, ratios_pct,
                                                     s.proposed), s.proposed)

    return decide


def _dcut(s: BatchSnapshot) -> np.ndarray:
    return schedule_topk(s.survival, dcut_budget(s.survival, s.cost, s.proposed), s.proposed)


def parse_ratios(spec: str, arg: str | None) -> tuple[int, ...]:
    """``dfly`` / ``dfly:25,50,75,100``: integer percentages in 1..100, distinct."""
    if arg is None:
        return DFLY_RATIOS_PCT
    try:
        ratios = tuple(int(x) for x in arg.replace("/", ",").split(",") if x.strip())
    except ValueError as exc:
        raise InputError("--policy", f"{spec!r}: ratios must be integer percentages, "
                                     f"e.g. dfly:25,50,75,100") from exc
    if not ratios or any(not 1 <= r <= 100 for r in ratios) or len(set(ratios)) != len(ratios):
        raise InputError("--policy", f"{spec!r}: ratios must be distinct percentages in 1..100")
    return tuple(sorted(ratios))


@register("dfly", grammar="[:R,...]", example="dfly",
          summary="DFly (AngelSpec): prefix-closed top-K of (request, depth) slots by "
                  "survival, K from the ratios {25, 50, 75, 100} % of the slots (or `R,…`) by "
                  "predicted progress ÷ step latency; `dfly:100` is `fixed:γ` "
                  "([related work](related-work.md))")
def dfly(spec: str, arg: str | None) -> Policy:
    ratios = parse_ratios(spec, arg)
    canon = "dfly" if ratios == DFLY_RATIOS_PCT else "dfly:" + ",".join(map(str, ratios))
    return Policy(name=canon, drafter="dspark", decide=_dfly(ratios),
                  reads=Reads(survival=True, cost=True),
                  description="DFly: prefix-closed top-K of (request, depth) slots by "
                              f"survival, K from ratios {'/'.join(map(str, ratios))} % "
                              "by progress / step latency")


@register("dcut", summary="D-cut (AngelSpec): the same ranking with the cut at any slot (no "
                          "ratio grid), this step's survivals")
def dcut(spec: str, arg: str | None) -> Policy:
    return Policy(name="dcut", drafter="dspark", decide=_dcut,
                  reads=Reads(survival=True, cost=True),
                  description="D-cut: prefix-closed top-K by survival, the cut at any "
                              "slot by progress / step latency (this step's drafts)")
