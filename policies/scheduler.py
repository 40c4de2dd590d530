"""Algorithm 1 (DSpark prefix scheduler) in numpy: the reference every other
implementation (the Triton kernel in ``kernels/``) must match exactly.

Inputs for a batch of ``n`` decoding requests:

* ``survival`` [n, gamma]: a_{r,j} = prod_{i<=j} c_{r,i} (calibrated), non-increasing in j.
* ``sps`` [n * gamma + 1]: engine steps/s when ``i`` draft tokens are admitted, i.e. at
  ``B = base + n + i`` batch tokens (the ``n`` bonus slots are always verified). Entries
  past the step's token budget are 0, so they are never worth admitting.

Candidates are ranked by survival, descending; ties keep row-major order (request,
then position), which also keeps every request's admitted set a prefix. With
``tau_i = n + sum of the i best survivals`` and ``Theta_i = tau_i * sps[i]``:

* sync (Algorithm 1): admit while Theta strictly rises; stop at the first admission
  that does not raise it (the early stop keeps decoding lossless, Appendix A).
* async (§5.2): the budget ``K = argmax_i Theta_i`` over the *whole* jagged table
  (no early stop), computed from survivals two steps old; the current step then
  admits its own top-``K`` tokens by current survival (dynamic top-K).
* displacement-priced (the default ``confidence`` policy): the §5.2 scheme (the
  verification budget sized without this step's drafts, global search, dynamic top-K)
  over a step priced at what it really carries and displaces. The step's composition
  (``n``, its pending prefill, the extra terms) is known when it is scheduled; only its
  drafts' survivals are not. So the budget is the global optimum of ``tau_i / C_i`` with
  the *current* costs and the survivals of two steps ago, their sorted curve stretched to
  this batch's ``n * gamma`` candidates (quantile mapping): the budget follows requests
  joining and leaving (a count sized on another batch misses by several tokens when the
  batch is small) and sees this step's CUDA-graph cliff. ``C_i`` = the table at ``n + i``
  verify tokens plus the pending prefill that still fits, plus the extra terms, plus the
  prefill the verify tokens push out of the step priced at what it costs when it runs
  later (the table's slope at large batches: prompts fill full steps). Pricing B as
  ``n + i`` plus whatever prefill fits (vLLM's ``T + B``, ``confidence-async``) pins B
  at the token budget under a backlog: every draft looks free while it pushes prefill,
  and so the queue's first tokens, out of the step. With the displaced prefill priced a
  draft is admitted only when ``a > (tau / C) * c_prefill``. The current step then
  admits its top-K drafts by current survival, so decoding stays lossless (Appendix A).
  (A single output-rate price instead of the step's own ``tau / C``, the Lagrangian of
  ``sum tau / sum C``, was tried and lost ~2 % of throughput on a concave table: it
  over-verifies decode-only steps.)
"""

from __future__ import annotations

import numpy as np

from dspark_sim.policies import compiled
from dspark_sim.policies.base import StepCost


def rank_candidates(survival: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices of candidates sorted by survival descending (stable), and the sorted values."""
    flat = np.ascontiguousarray(survival, dtype=np.float64).reshape(-1)
    order = np.argsort(-flat, kind="stable")
    return order, flat[order]


def _theta(n: int, sorted_survival: np.ndarray, sps: np.ndarray) -> np.ndarray:
    tau = np.empty(sorted_survival.size + 1)
    tau[0] = 0.0
    np.cumsum(sorted_survival, out=tau[1:])
    tau += n
    return tau * np.asarray(sps, dtype=np.float64)[: tau.size]


def theta_curve(survival: np.ndarray, sps: np.ndarray) -> np.ndarray:
    """Theta_i = (n + cumulative sorted survival) * sps[i] for i = 0..n*gamma."""
    return _theta(survival.shape[0], sorted_desc(survival), sps)


def candidates(survival: np.ndarray, proposed: np.ndarray | None) -> np.ndarray:
    """The survivals of the drafts the drafter proposed, flat in row-major order
    (``proposed`` [n]: drafts proposed per request, None: every request its whole block).
    A draft never proposed is not a candidate at all, not one certain to be rejected: it
    takes no place in a budget's ranking or a survival curve."""
    if proposed is None:
        return np.asarray(survival, dtype=np.float64).reshape(-1)
    return np.asarray(survival, dtype=np.float64)[
        np.arange(survival.shape[1])[None, :] < np.asarray(proposed)[:, None]]


def sorted_desc(survival: np.ndarray) -> np.ndarray:
    """Survival values sorted descending (values only: ~4x cheaper than an argsort; a
    reversed view of one ascending sort)."""
    return np.sort(np.asarray(survival, dtype=np.float64).reshape(-1))[::-1]


def _topk_lengths(survival: np.ndarray, a_sorted: np.ndarray, k: int) -> np.ndarray:
    """Per-request counts of the k best candidates under the stable row-major order
    (``a_sorted``: the survivals sorted descending)."""
    if k <= 0:
        return np.zeros(survival.shape[0], dtype=np.int64)
    return _counts_at(survival, a_sorted[k - 1], k)


def _counts_at(survival: np.ndarray, t: float, k: int) -> np.ndarray:
    """Per-request counts of the k best candidates when the k-th best value is ``t``,
    without an argsort: everything above ``t`` is in, and the ties at ``t`` are taken in
    flat (row-major) order until k is reached."""
    if compiled.NUMBA:
        return compiled.counts_at(np.ascontiguousarray(survival, dtype=np.float64), float(t),
                                  int(k))
    n, g = survival.shape
    at_least = survival >= t
    if np.count_nonzero(at_least) == k:  # no tie straddles the cut: the common case
        return at_least.sum(axis=1, dtype=np.int64)
    above = survival > t
    need = k - np.count_nonzero(above)
    tied = (survival == t).reshape(-1)
    take = tied & (np.cumsum(tied) <= need)
    return above.sum(axis=1, dtype=np.int64) + take.reshape(n, g).sum(axis=1, dtype=np.int64)


def schedule_sync(survival: np.ndarray, sps: np.ndarray,
                  proposed: np.ndarray | None = None) -> np.ndarray:
    """Algorithm 1 with early stop, over the drafts proposed (``proposed`` [n] per
    request; None: all of them). Returns ell [n] (int64)."""
    survival = np.asarray(survival, dtype=np.float64)
    n = survival.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    a = sorted_desc(candidates(survival, proposed))
    theta = _theta(n, a, sps)
    rises = theta[1:] > theta[:-1]
    k = int(np.argmin(rises)) if not rises.all() else rises.size
    if proposed is not None:
        return schedule_topk(survival, k, proposed)
    return _topk_lengths(survival, a, k)


def budget_global(survival: np.ndarray, sps: np.ndarray) -> int:
    """§5.2 budget: K = argmax_i Theta_i over the full table (first maximum)."""
    if survival.shape[0] == 0:
        return 0
    return int(np.argmax(theta_curve(survival, sps)))


def schedule_topk(survival: np.ndarray, k: int, proposed: np.ndarray | None = None
                  ) -> np.ndarray:
    """Admit the ``k`` most likely-to-survive draft tokens (dynamic top-K), among the
    drafts proposed (``proposed`` [n] per request; None: all of them)."""
    survival = np.asarray(survival, dtype=np.float64)
    if proposed is not None:
        # drafts not proposed rank below every proposed one (survival is >= 0), so a tie
        # at 0 never spends a slot of the budget on a draft that does not exist
        k = min(int(k), int(np.minimum(proposed, survival.shape[1]).sum()))
        survival = np.where(np.arange(survival.shape[1])[None, :] < proposed[:, None],
                            survival, -1.0)
    n, g = survival.shape
    k = int(max(0, min(k, n * g)))
    if k == 0 or k == n * g:
        return np.full(n, 0 if k == 0 else g, dtype=np.int64)
    # only the k-th largest value matters: a partition, not a sort (O(n) instead of n log n)
    kth = np.partition(survival.reshape(-1), n * g - k)[n * g - k]
    return _counts_at(survival, kth, k)


def schedule_async(
    survival: np.ndarray, lagged_survival: np.ndarray, lagged_sps: np.ndarray,
    proposed: np.ndarray | None = None, lagged_proposed: np.ndarray | None = None
) -> np.ndarray:
    """§5.2: budget from the lagged snapshot, tokens by current survival (each over the
    drafts its step proposed)."""
    if lagged_proposed is None:
        k = budget_global(lagged_survival, lagged_sps)
    else:
        # the lagged rows are the ones that proposed; every request of that step had its
        # bonus token, and its SPS curve holds n * gamma + 1 entries
        n = (np.asarray(lagged_sps).size - 1) // max(1, lagged_survival.shape[1])
        a = sorted_desc(candidates(lagged_survival, lagged_proposed))
        k = int(np.argmax(_theta(n, a, lagged_sps))) if n else 0
    return schedule_topk(survival, k, proposed)


def stretch_sorted(sorted_survival: np.ndarray, size: int) -> np.ndarray:
    """A descending survival curve resampled to ``size`` candidates (quantile mapping):
    another batch's drafts as an estimate of this batch's."""
    if compiled.NUMBA:
        return compiled.stretch_sorted(np.asarray(sorted_survival, dtype=np.float64), size)
    if size <= 0 or sorted_survival.size == 0:
        return np.zeros(max(size, 0))
    idx = (np.arange(size) * sorted_survival.size) // size
    return sorted_survival[idx]


def budget_displacement(survival: np.ndarray, cost, n: int | None = None,
                        sorted_survival: np.ndarray | None = None,
                        displacement: bool = True) -> int:
    """K = argmax_i tau_i / C_i (first maximum) over the step's real composition; verify
    tokens ``n + i`` never exceed the token budget. ``sorted_survival`` (descending)
    replaces ``survival``'s values for a batch of ``n`` requests; ``displacement=False``
    prices only what the step carries (vLLM's ``T + B``)."""
    a = sorted_desc(survival) if sorted_survival is None else sorted_survival
    n = survival.shape[0] if n is None else n
    if n == 0:
        return 0
    if compiled.NUMBA and type(cost) is StepCost:  # step_s inlined in the kernel
        return int(compiled.budget_displacement(
            np.ascontiguousarray(a), n, cost.table_s, cost.extra_s, int(cost.pending_prefill),
            float(cost.prefill_s_per_token), displacement))
    # verify tokens n + i <= budget; never more drafts than the batch has (extra_s has one
    # entry per admissible count)
    size = min(a.size + 1, cost.budget - n + 1, cost.extra_s.size)
    if size <= 0:
        return 0
    tau = np.empty(size)
    tau[0] = 0.0
    np.cumsum(a[: size - 1], out=tau[1:])
    tau += n
    return int(np.argmax(tau / cost.step_s(n, size, displacement)))
