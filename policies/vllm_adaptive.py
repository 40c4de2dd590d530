"""vLLM's ``enable_adaptive_verification`` (PR 47808) as a policy: ``vllm-adaptive``."""

from __future__ import annotations

import numpy as np

from dspark_sim.policies import compiled
from dspark_sim.policies.base import BatchSnapshot
from dspark_sim.policies.registry import DecisionKernel, Policy, Reads, register
from dspark_sim.policies.scheduler import (
    budget_displacement,
    candidates,
    schedule_topk,
    sorted_desc,
)


def _vllm_adaptive(s: BatchSnapshot) -> np.ndarray:
    """B* = argmax (N + sum of the B best survivals) / (draft + verify_cost[T + B]) with T
    the step's non-draft tokens, sized on the confidence array one step old, as it is (not
    stretched to this batch), then the top-B drafts by current survival."""
    if s.proposed is None:
        if s.lagged_survival is None or s.lagged_survival.shape[0] == 0:
            return schedule_topk(s.survival, budget_displacement(s.survival, s.cost,
                                                                 displacement=False))
        lagged = sorted_desc(s.lagged_survival)
        k = budget_displacement(s.survival, s.cost, s.num_requests, lagged,
                                displacement=False)
        return schedule_topk(s.survival, k)
    # a drafter that proposes nothing at some steps: the candidates are the drafts
    # proposed, and the lagged confidences those of the rows that proposed (none one step
    # ago: this step's own)
    lagged = s.survival if s.lagged_survival is None or s.lagged_survival.shape[0] == 0 \
        else s.lagged_survival
    a = sorted_desc(candidates(lagged, s.proposed if lagged is s.survival
                               else s.lagged_proposed))
    k = budget_displacement(s.survival, s.cost, s.num_requests, a, displacement=False)
    return schedule_topk(s.survival, k, s.proposed)


@register("vllm-adaptive", aliases=("vllm_adaptive",),
          summary="vLLM's `enable_adaptive_verification`: one-step-old confidences, current "
                  "`T + B` cost table")
def vllm_adaptive(spec: str, arg: str | None) -> Policy:
    return Policy(name="vllm-adaptive", drafter="dspark", decide=_vllm_adaptive,
                  reads=Reads(survival=True, cost=True, lag_steps=1),
                  engine_method="dspark",
                  kernel=DecisionKernel(_vllm_adaptive, compiled.vllm_adaptive_step, "lagged",
                                        compiled.vllm_adaptive_proposed),
                  description="vLLM adaptive verification: 1-step-old confidences, "
                              "current T + B cost table, global search, top-B")
