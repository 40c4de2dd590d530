"""``threshold:P``: verify each request's drafts whose calibrated survival clears ``P``."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dspark_sim.errors import InputError
from dspark_sim.policies.base import BatchSnapshot
from dspark_sim.policies.registry import Policy, Reads, register


def _threshold(p: float) -> Callable[[BatchSnapshot], np.ndarray]:
    def decide(s: BatchSnapshot) -> np.ndarray:
        # survival is non-increasing along the block, so the count is a prefix length;
        # never past the drafts proposed (threshold:0 would count drafts never proposed)
        ell = (s.survival >= p).sum(axis=1).astype(np.int64)
        return ell if s.proposed is None else np.minimum(ell, s.proposed)

    return decide


@register("threshold", grammar="[:P]", example="threshold:0.5",
          summary="verify draft tokens whose survival ≥ P (P in [0, 1]; 0.5 when omitted)")
def threshold(spec: str, arg: str | None) -> Policy:
    try:
        # + 0.0: -0 is 0, one canonical name (else threshold:-0 is a policy of its own)
        p = float(arg) + 0.0 if arg is not None else 0.5
    except ValueError as exc:
        raise InputError("--policy", f"{spec!r}: threshold must be a number") from exc
    if not 0.0 <= p <= 1.0:
        raise InputError("--policy", f"{spec!r}: threshold must lie in [0, 1]")
    return Policy(name=f"threshold:{p:g}", drafter="dspark", decide=_threshold(p),
                  reads=Reads(survival=True),
                  description=f"verify draft tokens whose survival >= {p:g}")
