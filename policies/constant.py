"""Policies that verify the same number of drafts for every request: ``none``, ``mtp1``,
``fixed:K``. They read nothing from the snapshot but its size."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dspark_sim.policies import compiled
from dspark_sim.policies.base import BatchSnapshot
from dspark_sim.policies.registry import DecisionKernel, Policy, parse_count, register


def _const(k: int) -> Callable[[BatchSnapshot], np.ndarray]:
    def decide(s: BatchSnapshot) -> np.ndarray:
        return np.full(s.num_requests, min(k, s.gamma_max), dtype=np.int64)

    return decide


def _policy(k: int, **fields) -> Policy:
    """A constant policy; its compiled twin (``compiled.constant_lengths``) verifies the
    engine's ``verify_max``, which is ``min(k, gamma)`` for a policy drafting k."""
    decide = _const(k)
    return Policy(decide=decide, draft_gamma=k,
                  kernel=DecisionKernel(decide, compiled.constant_lengths, "constant"),
                  **fields)


@register("none", summary="no speculation")
def none(spec: str, arg: str | None) -> Policy:
    return _policy(0, name="none", drafter=None, description="no speculation")


@register("mtp1", summary="DeepSeek-V3-style MTP-1: one draft token, always verified")
def mtp1(spec: str, arg: str | None) -> Policy:
    return _policy(1, name="mtp1", drafter="mtp1",
                   description="MTP-1: one draft token from the MTP head, always verified")


@register("fixed", grammar=":K", example="fixed:5",
          summary="verify K draft tokens per request")
def fixed(spec: str, arg: str | None) -> Policy:
    k = parse_count(spec, arg, None)
    return _policy(k, name=f"fixed:{k}", drafter="dspark" if k else None,
                   description=f"verify a fixed {k} draft tokens per request")
