"""What an engine step costs, as one profile prices it.

The engine builds one :class:`CostModel` for the profile that times its steps and, when
the scheduler is given another profile to believe (``policy_profile``: the table a real
server's scheduler was configured with, or a what-if on a stale one), a second for the
scheduler; otherwise both are the same object. Each holds its profile's dense target
table (one entry per batch token up to the token budget: the hot loop indexes, never
interpolates) and caches the draft table's figures per batch size.
"""

from __future__ import annotations

import numpy as np

from dspark_sim.calibration.profile import EngineProfile
from dspark_sim.errors import InputError


class CostModel:
    """Step pricing for one profile.

    ``draft_key``: the profile's ``[draft.*]`` table the run's drafter uses (None: no
    drafter), ``draft_gamma`` the tokens it drafts per request and step,
    ``stops_drafting`` whether the policy's drafter stops at each request's verify length
    (it then pays per pass). ``role`` names the profile in the error a missing draft
    table raises (the scheduler's profile must have the engine's drafter too).
    """

    def __init__(self, profile: EngineProfile, budget_tokens: int, draft_key: str | None,
                 draft_gamma: int, *, stops_drafting: bool = False, role: str = "") -> None:
        if draft_key is not None and draft_key not in profile.drafts:
            raise InputError(profile.source, f"{role}profile has no [draft.{draft_key}] table; "
                             f"it has {', '.join(profile.drafts) or 'none'}")
        self.profile = profile
        self.draft_key = draft_key
        self.draft = profile.drafts[draft_key] if draft_key is not None else None
        self.draft_gamma = draft_gamma
        self.stops_drafting = stops_drafting
        self._draft_kv_s = self.draft.kv_s_per_token if self.draft is not None else 0.0
        # the draft has terms in each request's own context (sparse-KV self-speculation)
        self.draft_context = self.draft if self.draft is not None \
            and self.draft.has_context_terms else None
        # Target time for every B in 0..budget, looked up once (8k floats, 64 KiB).
        self.dense_step_s = np.asarray(profile.target_time_s(np.arange(budget_tokens + 1)),
                                       dtype=np.float64)
        self._dense_list = self.dense_step_s.tolist()
        self.prefill_s_per_token = profile.prefill_s_per_token(budget_tokens)
        self.has_context_terms = bool(profile.attn_s_per_query_ctx
                                      or profile.multi_kv_s_per_token or profile.request_s)
        self._draft_cache: dict[int, float] = {}
        self._pass_cache: dict[int, float] = {}

    def target_time(self, batch_tokens: int) -> float:
        # A step never exceeds the token budget, so the dense table covers every B.
        return self._dense_list[batch_tokens]

    def draft_time(self, n: int, kv_tokens: int = 0) -> float:
        """Draft time for ``n`` drafting requests (cached per n) plus the drafter's own
        reads of ``kv_tokens`` context tokens."""
        if self.draft is None:
            return 0.0
        t = self._draft_cache.get(n)
        if t is None:
            t = self.profile.draft_time_s(self.draft_key, n, self.draft_gamma)
            self._draft_cache[n] = t
        return t + self._draft_kv_s * kv_tokens

    def draft_branch_s(self, n: int) -> float:
        """What one more drafted token per request costs the whole batch of ``n``: the
        draft table's per-token share (``gamma_slope``) of its block time."""
        d = self.draft
        if d is None:
            return 0.0
        return d.base_time(n, d.gamma_ref) * d.gamma_slope

    def draft_pass_table_s(self, n: int) -> float:
        """One draft pass (a token per request) over ``n`` requests, from the table."""
        t = self._pass_cache.get(n)
        if t is None:
            t = self._pass_cache[n] = self.draft.base_time(n, 1)
        return t

    def drafted_tokens(self, ell: np.ndarray, proposed: np.ndarray | None = None
                       ) -> np.ndarray:
        """Tokens each decoding request drafts this step: a stopping controller's drafter
        stops at the verify length; every other drafter drafts ``draft_gamma``, an
        autoregressive one no more than the trace's ``proposed`` drafts at its position."""
        if self.stops_drafting:
            return ell
        full = np.full(ell.shape[0], self.draft_gamma, dtype=np.int64)
        if proposed is None or self.draft.block:
            return full  # a block drafter drafts its whole block whatever it proposes
        return np.minimum(full, proposed)

    def draft_step_s(self, context: np.ndarray, ell: np.ndarray, kv_tokens: int,
                     proposed: np.ndarray | None = None) -> float:
        """Draft time of a step whose decoding requests hold ``context`` tokens and verify
        ``ell`` drafts: the table's passes, the drafter's reads of the batch's KV, and the
        sparse-KV / selection terms of each request's own context. A stopping controller
        runs pass ``j`` over the requests still drafting at depth ``j``, each pass at the
        table's one-token cost; every other drafter is the table at ``draft_gamma``, over
        the requests that draft (an autoregressive drafter given the trace's ``proposed``
        drafts runs to the longest of them and reads no KV of a request drafting none)."""
        d = self.draft
        drafted = self.drafted_tokens(ell, proposed)
        n = drafted.shape[0]
        if self.stops_drafting:
            if not drafted.any():
                return 0.0
            # requests still drafting at depth j = 1..max: n minus those that stopped before
            still = n - np.cumsum(np.bincount(drafted, minlength=int(drafted.max()) + 1))[:-1]
            t = sum(self.draft_pass_table_s(int(k)) for k in still)
            t += d.kv_s_per_token * kv_tokens
        elif proposed is not None and not d.block:
            t = self._proposed_draft_s(drafted, context, kv_tokens)
        else:
            t = self.draft_time(n, kv_tokens)
        return t + d.context_s(context, drafted)

    def _proposed_draft_s(self, drafted: np.ndarray, context: np.ndarray,
                          kv_tokens: int) -> float:
        """An autoregressive drafter over the requests that propose drafts this step:
        the table at the longest proposal over that many requests, reading their KV only
        (all drafting at ``draft_gamma``: :meth:`draft_time`'s very figure)."""
        drafting = drafted > 0
        n_on = int(np.count_nonzero(drafting))
        if not n_on:
            return 0.0
        if n_on < drafted.shape[0]:
            kv_tokens -= int(context[~drafting].sum())
        longest = int(drafted.max())
        if longest == self.draft_gamma:
            return self.draft_time(n_on, kv_tokens)
        return self.draft.base_time(n_on, longest) + self.draft.kv_s_per_token * kv_tokens

    def draft_pass_s(self, n: int, context: np.ndarray) -> float:
        """What one more draft pass over the ``n`` decoding requests costs: the table's
        one-token pass plus each request's sparse-KV reads."""
        d = self.draft
        if d is None:
            return 0.0
        return self.draft_pass_table_s(n) + d.context_s(context, np.ones(n)) \
            - d.select_s_per_context_token * float(context.sum())

    def draft_fixed_s(self, context: np.ndarray, kv_tokens: int) -> float:
        """The draft cost a drafting step pays once whatever its length: the selection of
        each request's sparse KV from its context and the drafter's KV reads."""
        d = self.draft
        if d is None:
            return 0.0
        return d.select_s_per_context_token * float(context.sum()) + d.kv_s_per_token * kv_tokens

    def _scheduled_draft_s(self, n_dec: int, kv_tokens: int,
                           context: np.ndarray | None) -> float:
        """The draft as the scheduler prices it: at ``draft_gamma``, with its context terms
        over the decoding rows' ``context``; nothing for a stopping controller (its
        :class:`StepCost` carries the draft per pass and per step instead)."""
        if self.stops_drafting:
            return 0.0
        if self.draft_context is not None and n_dec:
            return self.draft_time(n_dec, kv_tokens) + self.draft_context.context_s(
                context, np.full(n_dec, self.draft_gamma))
        return self.draft_time(n_dec, kv_tokens)

    def extra_s(self, n_dec: int, gamma: int, kv_tokens: int, batch_rows: int,
                context: np.ndarray | None) -> np.ndarray:
        """The step time beyond the target table when ``i = 0..n_dec*gamma`` drafts are
        admitted (:meth:`EngineProfile.step_extra_s`): the scheduled draft, KV reads, the
        LM head and attention terms of the verify tokens."""
        return self.profile.step_extra_s(n_dec, gamma, kv_tokens, batch_rows,
                                         self._scheduled_draft_s(n_dec, kv_tokens, context))

    def extra_terms(self, n_dec: int, kv_tokens: int, batch_rows: int,
                    context: np.ndarray | None) -> tuple[float, float, float]:
        """:meth:`extra_s` as :meth:`EngineProfile.extra_terms` gives it (per token,
        offset, kink), for the compiled scheduler."""
        return self.profile.extra_terms(n_dec, kv_tokens, batch_rows,
                                        self._scheduled_draft_s(n_dec, kv_tokens, context))
