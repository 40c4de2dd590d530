"""The read-only batch snapshot a policy sees, and the policy protocol.

A policy is a pure function ``snapshot -> ell`` (verify length per decoding
request). It holds no state: anything historical (the async scheduler's
two-steps-old survivals) is carried in the snapshot by the engine.

Chain policies return ``ell`` and the engine replays ``min(ell, m)``. Tree and lossy
policies return a :class:`Verification` (the batch tokens each request verifies and the
policy's own plan) and provide a ``replay`` that judges the plan against the trace's
ground truth (:class:`ReplayView`, never shown to the decision) and says what each request
emits (:class:`Replayed`): accepted drafts, how many of them differ from the target's
greedy tokens (lossy policies), whether the target's bonus token came, and the
per-request state it carries forward (e.g. ASD's cumulative regret).
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
    draft_token_s:       what one drafted token beyond the block costs the step (tree
                         branches: ``Verification.draft_tokens``), as the engine prices it.
    draft_pass_s:        (a policy whose drafter stops at its verify length,
    draft_fixed_s:       ``Policy.stops_drafting``; else 0) one more draft pass over the
                         batch, and what a drafting step pays once (sparse-KV selection,
                         the drafter's KV reads); ``extra_s`` then holds no draft term.
    """

    table_s: np.ndarray
    extra_s: np.ndarray
    pending_prefill: int
    prefill_s_per_token: float
    draft_token_s: float = 0.0
    draft_pass_s: float = 0.0
    draft_fixed_s: float = 0.0

    @property
    def budget(self) -> int:
        return int(self.table_s.size - 1)

    def step_s(self, n: int, size: int, displacement: bool = True) -> np.ndarray:
        """Cost of the step with ``i = 0..size-1`` drafts admitted: the table at the tokens
        it carries (``n + i`` verify tokens plus the prefill that still fits), the extra
        terms, and (``displacement``) the prefill verification pushes out of the step,
        priced at what it costs when it runs later."""
        if not self.pending_prefill:  # decode-only step (e.g. disaggregated prefill)
            return self.table_s[n: n + size] + self.extra_s[:size]
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
    proposed:        [n] drafts the drafter proposed per request this step (an n-gram or
                     lookup drafter proposes none where it finds no match), or None: every
                     request proposed ``gamma_max``. A draft not proposed has survival 0
                     in ``survival`` but is no candidate: "no proposal" is a state of its
                     own, not a draft certain to be rejected, and a request without one
                     has nothing to verify beyond its bonus token.
    lagged_proposed: ``proposed`` of the lagged rows, or None. The lagged view holds only
                     the rows that proposed a draft: a step's requests without one say
                     nothing about the survival of the drafts the others propose.
    """

    survival: np.ndarray
    gamma_max: int
    token_budget: int
    sps: np.ndarray | None = None
    lagged_survival: np.ndarray | None = None
    lagged_sps: np.ndarray | None = None
    cost: StepCost | None = None
    lagged_cost: StepCost | None = None
    # Drafter-visible per-position fields the policy asked for (``Reads.fields``: e.g.
    # schema-v2 ``alt_prob``, ``draft_entropy``), gathered at the decoding rows, and the
    # per-request state its replay carries (read-only).
    fields: dict[str, np.ndarray] | None = None
    state: np.ndarray | None = None
    proposed: np.ndarray | None = None
    lagged_proposed: np.ndarray | None = None

    @property
    def num_requests(self) -> int:
        return int(self.survival.shape[0])


@dataclass(frozen=True, eq=False)
class Verification:
    """A tree or lossy policy's decision for the decoding requests.

    tokens:       [n] batch tokens each request verifies beyond its bonus slot (a chain of
                  ``l`` drafts: ``l``; a tree: its nodes); the engine may trim it to the
                  token budget, and the replay then sees the trimmed counts.
    plan:         the policy's own description of what it verifies, handed to its replay.
    draft_tokens: [n] tokens the drafter proposes beyond its block (tree branches, a Markov
                  head re-run per parent), priced at the draft table's per-token slope.
    fill_tokens:  [n] target input tokens beyond the verify slots: tokens committed earlier
                  without the verifier (``skip``) whose KV the target writes in this
                  forward. Priced as batch tokens; neither drafts nor verified.
    """

    tokens: np.ndarray
    plan: object = None
    draft_tokens: np.ndarray | None = None
    fill_tokens: np.ndarray | None = None


@dataclass(frozen=True, eq=False)
class ReplayView:
    """Ground truth at each decoding request's position, for a policy's replay only.

    accept_len: [n] the chain's accepted run ``m_t`` (drafts the target accepts in a row).
    rows:       [n] trace rows (index the trace's v2 fields: ``trace.v2``).
    trace:      the acceptance trace being replayed.
    state:      [n] per-request state carried by the replay (0 at admission).
    """

    accept_len: np.ndarray
    rows: np.ndarray
    trace: object
    state: np.ndarray


@dataclass(frozen=True, eq=False)
class Replayed:
    """What each decoding request emits this step.

    accepted: [n] draft tokens committed before the bonus token.
    changed:  [n] of them that differ from the target's greedy tokens (lossy), or None.
    bonus:    [n] bool: the target's bonus token came (False when the request skipped
              the verifier this step), or None (all True).
    state:    [n] the per-request state after this step, or None (unchanged).
    """

    accepted: np.ndarray
    changed: np.ndarray | None = None
    bonus: np.ndarray | None = None
    state: np.ndarray | None = None


def readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v
