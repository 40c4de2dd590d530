"""DSpark's confidence schedulers: ``confidence`` (the default), ``confidence-sync``
(Algorithm 1 as written) and ``confidence-async`` (§5.2 as vLLM prices it). Each ranks a
step's drafts by calibrated prefix survival and sizes a verification budget on what the
step costs; they differ in which survivals size it and how the step is priced."""

from __future__ import annotations

import numpy as np

from dspark_sim.policies import compiled
from dspark_sim.policies.base import BatchSnapshot
from dspark_sim.policies.registry import DecisionKernel, Policy, Reads, register
from dspark_sim.policies.scheduler import (
    budget_displacement,
    candidates,
    schedule_async,
    schedule_sync,
    schedule_topk,
    sorted_desc,
    stretch_sorted,
)

# The default scheduler sizes its budget on at least this many draft rows two or more
# steps old: one step of a large batch, the last few dozen steps of a small one (a single
# request's drafts two steps ago say little about its next ones).
CONFIDENCE_LAG_ROWS = 64


def _confidence(s: BatchSnapshot) -> np.ndarray:
    """The budget for this step's costs, sized on the survivals of two steps ago (DSpark's
    production pipeline: the decision never waits for this step's drafts), stretched to
    this batch's candidates; tokens by current survival. With a drafter that proposes
    nothing at some steps (``proposed``) the candidates are the drafts proposed: which
    requests have drafts is known when the step is scheduled, their survivals are not,
    and the lagged view holds only rows that proposed."""
    n, gamma = s.survival.shape
    if s.proposed is None:
        if s.lagged_survival is None or s.lagged_survival.shape[0] == 0:
            return schedule_topk(s.survival, budget_displacement(s.survival, s.cost))
        estimate = stretch_sorted(sorted_desc(s.lagged_survival), n * gamma)
        return schedule_topk(s.survival, budget_displacement(s.survival, s.cost, n, estimate))
    current = sorted_desc(candidates(s.survival, s.proposed))
    if current.size == 0:  # nobody drafted: nothing to verify
        return np.zeros(n, dtype=np.int64)
    if s.lagged_survival is None or s.lagged_survival.shape[0] == 0:
        estimate = current
    else:
        estimate = stretch_sorted(sorted_desc(candidates(s.lagged_survival,
                                                         s.lagged_proposed)), current.size)
    return schedule_topk(s.survival, budget_displacement(s.survival, s.cost, n, estimate),
                         s.proposed)


@register("confidence",
          summary="DSpark's production scheduler (§5.2), hardened: a verification budget sized "
                  "on the survivals of two steps ago for *this* step's costs (global search "
                  "over the jagged table, not the early stop), pricing the prefill "
                  "verification pushes out of the step; this step's drafts admitted by "
                  "current survival ([why](architecture.md#the-default-scheduler-and-why-it-"
                  "prices-what-verification-displaces))")
def confidence(spec: str, arg: str | None) -> Policy:
    return Policy(name="confidence", drafter="dspark", decide=_confidence,
                  reads=Reads(survival=True, cost=True, lag_steps=2,
                              lag_rows=CONFIDENCE_LAG_ROWS),
                  kernel=DecisionKernel(_confidence, compiled.confidence_step, "lagged"),
                  description="budget from 2-step-old survivals at this step's costs "
                              "(global search, prefill displacement priced), top-K")


def _confidence_sync(s: BatchSnapshot) -> np.ndarray:
    return schedule_sync(s.survival, s.sps, s.proposed)


@register("confidence-sync", aliases=("alg1",),
          summary="DSpark Algorithm 1 as written: rank drafts by calibrated prefix survival, "
                  "maximise Θ = τ·SPS(B), early stop")
def confidence_sync(spec: str, arg: str | None) -> Policy:
    return Policy(name="confidence-sync", drafter="dspark", decide=_confidence_sync,
                  reads=Reads(survival=True, sps="decode"),
                  description="Algorithm 1 as written: survival-ranked prefix "
                              "scheduling, early stop")


def _confidence_async(s: BatchSnapshot) -> np.ndarray:
    if s.lagged_survival is None or s.lagged_sps is None or s.lagged_survival.shape[0] == 0:
        # Warm-up (no history yet): size the budget from the current step instead.
        return schedule_async(s.survival, s.survival, s.sps, s.proposed, s.proposed)
    return schedule_async(s.survival, s.lagged_survival, s.lagged_sps, s.proposed,
                          s.lagged_proposed)


@register("confidence-async", aliases=("confidence_async",),
          summary="DSpark §5.2 as written: budget K from two-step-old confidences by a global "
                  "search, dynamic top-K by current survival")
def confidence_async(spec: str, arg: str | None) -> Policy:
    return Policy(name="confidence-async", drafter="dspark", decide=_confidence_async,
                  reads=Reads(survival=True, sps="batch", lag_steps=2),
                  description="§5.2: budget from 2-step-old survivals, global search, "
                              "dynamic top-K")
