"""The read-only batch snapshot a policy sees, and the policy protocol.

A policy is a pure function ``snapshot -> ell`` (verify length per decoding
request). It holds no state: anything historical (the async scheduler's
two-steps-old survivals) is carried in the snapshot by the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class BatchSnapshot:
    """What the engine knows when it schedules one step (arrays are read-only).

    survival:        [n, gamma] calibrated prefix survival a_{r,j} of the drafts.
    sps:             [n*gamma + 1] steps/s when i draft tokens are admitted
                     (B = prefill-free base + n + i); 0 past the token budget.
                     ``None`` when the policy does not ask for it.
    lagged_survival: survival two steps ago (async scheduler), or None.
    lagged_sps:      sps two steps ago, or None.
    token_budget:    tokens the decode batch may use this step (n + sum ell <= budget).
    """

    survival: np.ndarray
    gamma_max: int
    token_budget: int
    sps: np.ndarray | None = None
    lagged_survival: np.ndarray | None = None
    lagged_sps: np.ndarray | None = None

    @property
    def num_requests(self) -> int:
        return int(self.survival.shape[0])


def readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v
