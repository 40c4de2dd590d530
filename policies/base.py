"""The read-only batch snapshot a policy sees, and the policy protocol.

A policy is a pure function ``snapshot -> ell`` (verify length per decoding
request). It holds no state: anything historical (the async scheduler's
two-steps-old survivals) is carried in the snapshot by the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class StepCost:
    """What the step costs as the scheduler's table prices it, for a policy that prices
    verification itself (arrays are read-only).

    table_s:             [budget + 1] target forward time at B batch tokens.
    extra_s:             [n * gamma + 1] the rest of the step when i drafts are admitted:
                         draft, KV reads, and the LM head / attention of the verify tokens.
    pending_prefill:     prefill tokens the batch still has to run: they fill what
                         verification leaves of the token budget.
    prefill_s_per_token: what a displaced prefill token costs when it runs later: prompts
                         fill large steps, so the table's slope at large batches.
    """

    table_s: np.ndarray
    extra_s: np.ndarray
    pending_prefill: int
    prefill_s_per_token: float

    @property
    def budget(self) -> int:
        return int(self.table_s.size - 1)

    def step_s(self, n: int, size: int, displacement: bool = True) -> np.ndarray:
        """Cost of the step with ``i = 0..size-1`` drafts admitted: the table at the tokens
        it carries (``n + i`` verify tokens plus the prefill that still fits), the extra
        terms, and (``displacement``) the prefill verification pushes out of the step,
        priced at what it costs when it runs later."""
        verify = n + np.arange(size)
        room = np.maximum(self.budget - verify, 0)
        carried = np.minimum(self.pending_prefill, room)
        step = self.table_s[verify + carried] + self.extra_s[:size]
        if displacement:
            step = step + self.prefill_s_per_token * (self.pending_prefill - carried)
        return step


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
    cost:            the step's cost ingredients (:class:`StepCost`), or None.
    lagged_cost:     ``cost`` two steps ago, or None.
    """

    survival: np.ndarray
    gamma_max: int
    token_budget: int
    sps: np.ndarray | None = None
    lagged_survival: np.ndarray | None = None
    lagged_sps: np.ndarray | None = None
    cost: StepCost | None = None
    lagged_cost: StepCost | None = None

    @property
    def num_requests(self) -> int:
        return int(self.survival.shape[0])


def readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v
