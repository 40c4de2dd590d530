"""Policies that verify the same number of drafts for every request: ``none``, ``mtp1``,
``fixed:K``. They read nothing from the snapshot but its size."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dspark_sim.policies.base import BatchSnapshot
from dspark_sim.policies.registry import Policy, parse_count, register


def _const(k: int) -> Callable[[BatchSnapshot], np.ndarray]:
    def decide(s: BatchSnapshot) -> np.ndarray:
        return np.full(s.num_requests, min(k, s.gamma_max), dtype=np.int64)

    return decide


@register("none", summary="no speculation")
def none(spec: str, arg: str | None) -> Policy:
    return Policy(name="none", drafter=None, decide=_const(0), draft_gamma=0,
                  description="no speculation")


@register("mtp1", summary="DeepSeek-V3-style MTP-1: one draft token, always verified")
def mtp1(spec: str, arg: str | None) -> Policy:
    return Policy(name="mtp1", drafter="mtp1", decide=_const(1), draft_gamma=1,
                  description="MTP-1: one draft token from the MTP head, always verified")


@register("fixed", grammar=":K", example="fixed:5",
          summary="verify K draft tokens per request")
def fixed(spec: str, arg: str | None) -> Policy:
    k = parse_count(spec, arg, None)
    return Policy(name=f"fixed:{k}", drafter="dspark" if k else None, decide=_const(k),
                  draft_gamma=k, description=f"verify a fixed {k} draft tokens per request")
