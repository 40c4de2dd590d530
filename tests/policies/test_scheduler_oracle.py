"""The numpy prefix scheduler (Algorithm 1, §5.2) against an exhaustive search.

The oracle shares no code with :mod:`dspark_sim.policies.scheduler`: it enumerates every
allocation ``ell in {0..gamma}^n`` of a small batch in exact rational arithmetic and takes,
for each number ``i`` of admitted drafts, the best expected tokens per step

    tau*_i = n + max over allocations with sum(ell) = i of sum_r a[r, 1..ell_r],

so ``Theta*_i = tau*_i * sps[i]`` (DSpark Eq. 3). Then:

* sync (Algorithm 1): admit while Theta strictly rises, i.e. ``k`` = the first ``i`` with
  ``Theta*_{i+1} <= Theta*_i`` (``n * gamma`` if it always rises);
* global (§5.2): ``K`` = the first maximiser of ``Theta*``;
* the admitted set is the top-``k`` candidates by survival, ties in row-major order,
  and it achieves ``tau*_k`` (no allocation of ``k`` drafts does better).

Inputs are dyadic rationals (confidences in eighths, steps/s in quarters), so the
scheduler's float64 sums and products are exact and ties are real ties: the tests see
the strict ``>`` of the early stop and the first-maximum rule, not rounding noise. Torch-free.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from dspark_sim.policies.base import BatchSnapshot, StepCost, readonly
from dspark_sim.policies.registry import get_policy
from dspark_sim.policies.scheduler import (
    budget_global,
    rank_candidates,
    schedule_async,
    schedule_sync,
    schedule_topk,
    sorted_desc,
    stretch_sorted,
)

# -- the oracle ------------------------------------------------------------------------------


def exhaustive_theta(survival: np.ndarray, sps: np.ndarray) -> list[Fraction]:
    """Theta*_i for i = 0..n*gamma by enumerating every allocation (exact)."""
    n, g = survival.shape
    a = [[Fraction(float(v)) for v in row] for row in survival]
    prefix = [[sum(row[:j], Fraction(0)) for j in range(g + 1)] for row in a]
    best: dict[int, Fraction] = {}
    for ell in itertools.product(range(g + 1), repeat=n):
        i = sum(ell)
        tau = n + sum(prefix[r][ell[r]] for r in range(n))
        if i not in best or tau > best[i]:
            best[i] = tau
    return [best[i] * Fraction(float(sps[i])) for i in range(n * g + 1)]


def exhaustive_best_tau(survival: np.ndarray, k: int) -> Fraction:
    n, g = survival.shape
    a = [[Fraction(float(v)) for v in row] for row in survival]
    return max(n + sum(sum(a[r][: ell[r]], Fraction(0)) for r in range(n))
               for ell in itertools.product(range(g + 1), repeat=n) if sum(ell) == k)


def sync_count(theta: list[Fraction]) -> int:
    for i in range(len(theta) - 1):
        if not theta[i + 1] > theta[i]:
            return i
    return len(theta) - 1


def first_argmax(theta: list[Fraction]) -> int:
    m = max(theta)
    return next(i for i, t in enumerate(theta) if t == m)


def topk_lengths(survival: np.ndarray, k: int) -> list[int]:
    """Per-request counts of the k best candidates: survival descending, then row, then
    position (a plain sort of tuples)."""
    n, g = survival.shape
    cands = sorted((-float(survival[r, j]), r, j) for r in range(n) for j in range(g))
    ell = [0] * n
    for _, r, _ in cands[:k]:
        ell[r] += 1
    return ell


def tau_of(survival: np.ndarray, ell) -> Fraction:
    return survival.shape[0] + sum(sum((Fraction(float(v)) for v in survival[r, : ell[r]]),
                                       Fraction(0)) for r in range(survival.shape[0]))


# -- strategies -------------------------------------------------------------------------------

EIGHTHS = [j / 8 for j in range(9)]


@st.composite
def batches(draw, max_n: int = 4, max_g: int = 4):
    """(survival [n, g], sps [n*g + 1 (+ extra)]): exact dyadic values, plateaus likely."""
    n = draw(st.integers(1, max_n))
    g = draw(st.integers(1, max_g))
    conf = np.array(draw(st.lists(st.sampled_from(EIGHTHS), min_size=n * g, max_size=n * g)))
    survival = np.cumprod(conf.reshape(n, g), axis=1)
    m = n * g + 1
    kind = draw(st.sampled_from(["decreasing", "jagged", "flat", "budget"]))
    vals = np.array(draw(st.lists(st.integers(0, 40), min_size=m, max_size=m)), float) / 4
    if kind == "decreasing":
        sps = np.sort(vals)[::-1]
    elif kind == "flat":
        sps = np.full(m, vals[0] + 1.0)
    elif kind == "budget":  # past the token budget the table is 0
        cut = draw(st.integers(1, m))
        sps = np.sort(vals + 1.0)[::-1]
        sps[cut:] = 0.0
    else:
        sps = vals
    extra = draw(st.integers(0, 2))  # a longer table: only the first n*g + 1 entries count
    sps = np.concatenate([sps, np.full(extra, 99.0)])
    return survival, sps


# -- sync (Algorithm 1) ------------------------------------------------------------------------


@given(batches())
@example((np.array([[0.5, 0.25]]), np.array([2.0, 2.0, 2.0])))  # Theta rises, then ...
@example((np.array([[0.5, 0.0]]), np.array([2.0, 2.0, 2.0])))  # ... a flat step: stop there
@example((np.array([[1.0, 0.5], [1.0, 0.5]]), np.array([4.0, 3.0, 3.0, 0.0, 0.0])))
def test_sync_equals_exhaustive_early_stop(batch):
    survival, sps = batch
    theta = exhaustive_theta(survival, sps)
    k = sync_count(theta)
    ell = schedule_sync(survival, sps)
    assert ell.dtype == np.int64 and ell.shape == (survival.shape[0],)
    assert int(ell.sum()) == k, (theta, ell)
    assert ell.tolist() == topk_lengths(survival, k)
    assert tau_of(survival, ell) == exhaustive_best_tau(survival, k)


def test_sync_stops_on_an_exactly_flat_step():
    """Theta_0 = 2 * 2 = 4, Theta_1 = 2.5 * 2 = 5, Theta_2 = 2.5 * 2 = 5 (a zero-survival
    draft on a flat table): Theta does not strictly rise at the second draft, so Algorithm
    1 stops at one; admitting the flat step would verify a token that cannot be accepted."""
    survival = np.array([[0.5, 0.0]])
    assert schedule_sync(survival, np.array([2.0, 2.0, 2.0])).tolist() == [1]
    # past the token budget the table is 0: Theta_1 = Theta_2 = 0, nothing is admitted
    assert schedule_sync(np.array([[1.0, 1.0]]), np.array([3.0, 0.0, 0.0])).tolist() == [0]


def test_appendix_a_counterexample_by_hand():
    """DSpark Appendix A: a = (0.9, 0.855), SPS(0, 1, 2) = (1, 0.5, 0.45). Theta = 1,
    1.9 * 0.5 = 0.95, 2.755 * 0.45 = 1.23975: the early stop admits nothing, the global
    search admits two."""
    a = np.array([[0.9, 0.9 * 0.95]])
    sps = np.array([1.0, 0.5, 0.45])
    assert schedule_sync(a, sps).tolist() == [0]
    assert budget_global(a, sps) == 2
    # the textbook variant keeps Algorithm 1's early stop (the default "confidence" is
    # the production scheduler: a global search whose budget never sees the current drafts)
    assert get_policy("confidence-sync")(BatchSnapshot(readonly(a), 2, 64, sps=readonly(sps))
                                         ).tolist() == [0]


# -- global budget and async -------------------------------------------------------------------


@given(batches())
@example((np.array([[0.5, 0.0]]), np.array([2.0, 2.0, 2.0])))  # equal maxima: the first wins
def test_global_budget_equals_exhaustive_first_maximum(batch):
    survival, sps = batch
    assert budget_global(survival, sps) == first_argmax(exhaustive_theta(survival, sps))


@given(batches(), batches())
def test_async_budget_from_the_lagged_batch_tokens_from_the_current(cur, lag):
    survival, _ = cur
    lag_survival, lag_sps = lag
    k = first_argmax(exhaustive_theta(lag_survival, lag_sps))
    expected = topk_lengths(survival, min(k, survival.size))
    assert schedule_async(survival, lag_survival, lag_sps).tolist() == expected
    # through the registry: confidence-async reads the lagged fields of the snapshot
    snap = BatchSnapshot(readonly(survival), survival.shape[1], 10_000,
                         sps=readonly(np.ones(survival.size + 1)),
                         lagged_survival=readonly(lag_survival), lagged_sps=readonly(lag_sps))
    assert get_policy("confidence-async")(snap).tolist() == expected


def test_async_policy_uses_the_lagged_snapshot_not_the_current_one():
    """Current batch: flat table, every draft sure to survive (budget would be all 4).
    Lagged batch: verifying anything halves the steps/s (budget 0). The async policy
    must size its budget from the lagged batch: it verifies nothing."""
    cur = readonly(np.ones((2, 2)))
    flat = readonly(np.full(5, 10.0))
    lag = readonly(np.full((2, 2), 0.5))
    lag_sps = readonly(np.array([10.0, 5.0, 5.0, 5.0, 5.0]))
    assert budget_global(np.asarray(cur), np.asarray(flat)) == 4
    assert budget_global(np.asarray(lag), np.asarray(lag_sps)) == 0
    pol = get_policy("confidence-async")
    snap = BatchSnapshot(cur, 2, 100, sps=flat, lagged_survival=lag, lagged_sps=lag_sps)
    assert pol(snap).tolist() == [0, 0]
    # and the other way round: a lagged budget of 3 admits the current batch's best 3
    snap = BatchSnapshot(lag, 2, 100, sps=lag_sps, lagged_survival=cur, lagged_sps=readonly(
        np.array([10.0, 10.0, 10.0, 10.0, 1.0])))
    assert pol(snap).tolist() == [2, 1]
    # warm-up (no history): the budget comes from the current step
    assert pol(BatchSnapshot(cur, 2, 100, sps=flat)).tolist() == [2, 2]
    assert pol(BatchSnapshot(lag, 2, 100, sps=lag_sps)).tolist() == [0, 0]


# -- top-K and its tie order -------------------------------------------------------------------


@given(batches(), st.integers(-2, 20))
def test_topk_equals_sorted_tuples(batch, k):
    survival, _ = batch
    ell = schedule_topk(survival, k)
    assert ell.tolist() == topk_lengths(survival, max(0, min(k, survival.size)))
    assert tau_of(survival, ell) == exhaustive_best_tau(survival, max(0, min(k, survival.size)))


@given(batches())
def test_rank_candidates_is_a_stable_descending_sort(batch):
    survival, _ = batch
    order, values = rank_candidates(survival)
    n, g = survival.shape
    expected = sorted(range(n * g), key=lambda f: (-float(survival.reshape(-1)[f]), f))
    assert order.tolist() == expected
    assert values.tolist() == [float(survival.reshape(-1)[f]) for f in expected]


def test_ties_take_rows_in_order():
    a = np.full((3, 2), 0.5)
    assert schedule_topk(a, 3).tolist() == [2, 1, 0]
    assert schedule_topk(a, 1).tolist() == [1, 0, 0]
    # a tie straddling the cut at a lower level: (0.5, 0.25) per row, k = 4
    b = np.array([[0.5, 0.25], [0.5, 0.25], [0.5, 0.25]])
    assert schedule_topk(b, 4).tolist() == [2, 1, 1]


def test_empty_batch():
    empty = np.zeros((0, 3))
    assert schedule_sync(empty, np.ones(1)).tolist() == []
    assert budget_global(empty, np.ones(1)) == 0
    assert schedule_topk(empty, 5).tolist() == []


# -- threshold and fixed policies --------------------------------------------------------------


@given(batches(), st.sampled_from([0.0, 0.125, 0.3, 0.5, 0.75, 1.0]))
def test_threshold_counts_survivals_at_or_above_p(batch, p):
    survival, _ = batch
    pol = get_policy(f"threshold:{p}")
    got = pol(BatchSnapshot(readonly(survival), survival.shape[1], 100)).tolist()
    assert got == [sum(1 for v in row if v >= p) for row in survival.tolist()]


@pytest.mark.parametrize("k", [0, 1, 3, 9])
def test_fixed_policy_caps_at_gamma(k):
    pol = get_policy(f"fixed:{k}")
    snap = BatchSnapshot(readonly(np.zeros((3, 5))), 5, 100)
    assert pol(snap).tolist() == [min(k, 5)] * 3
    assert pol.draft_gamma == k and pol.drafter == ("dspark" if k else None)


# -- the default: displacement-priced global search -------------------------------------------


def step_cost_by_hand(cost: StepCost, n: int, i: int) -> Fraction:
    """policies/base.py StepCost: the table at the tokens the step carries (n + i verify
    tokens plus whatever pending prefill still fits in the token budget), the extra terms
    at i drafts, and each displaced prefill token at its later price."""
    budget = len(cost.table_s) - 1
    verify = n + i
    carried = min(cost.pending_prefill, max(budget - verify, 0))
    displaced = cost.pending_prefill - carried
    return (Fraction(float(cost.table_s[verify + carried])) + Fraction(float(cost.extra_s[i]))
            + Fraction(float(cost.prefill_s_per_token)) * displaced)


def stretched_by_hand(lagged: np.ndarray, size: int) -> list[Fraction]:
    """The lagged survivals, sorted descending, resampled to ``size`` candidates: candidate
    j takes the value at quantile j / size of the lagged curve."""
    vals = sorted((Fraction(float(v)) for v in lagged.reshape(-1)), reverse=True)
    return [vals[(j * len(vals)) // size] for j in range(size)] if vals else [Fraction(0)] * size


@st.composite
def costed(draw):
    """(survival, lagged survival or None, StepCost): dyadic, so float ratios are exact
    up to rounding that preserves order and equality."""
    survival, _ = draw(batches())
    n, g = survival.shape
    budget = draw(st.integers(n, n * g + 6))
    table = np.cumsum(np.array(draw(st.lists(st.integers(0, 8), min_size=budget + 1,
                                              max_size=budget + 1)), float) / 4) + 1.0
    extra = np.array(draw(st.lists(st.integers(0, 8), min_size=n * g + 1,
                                   max_size=n * g + 1)), float) / 8
    cost = StepCost(table_s=readonly(table), extra_s=readonly(extra),
                    pending_prefill=draw(st.integers(0, 12)),
                    prefill_s_per_token=draw(st.integers(0, 8)) / 16)
    lagged = None
    if draw(st.booleans()):
        lagged, _ = draw(batches())
    return survival, lagged, cost


@given(costed())
def test_step_cost_by_hand(case):
    survival, _, cost = case
    n, g = survival.shape
    size = min(n * g + 1, cost.budget - n + 1)
    got = cost.step_s(n, size)
    assert [Fraction(float(v)) for v in got] == [step_cost_by_hand(cost, n, i)
                                                 for i in range(size)]


@given(costed())
@example((np.array([[1.0, 1.0]]), None, StepCost(
    table_s=readonly(np.array([1.0, 2.0, 2.0, 3.0])), extra_s=readonly(np.zeros(3)),
    pending_prefill=0, prefill_s_per_token=0.0)))  # tau/C: 1/2, 2/2, 3/2: all drafts
@example((np.array([[0.5, 0.25]]), None, StepCost(
    table_s=readonly(np.array([1.0, 1.0, 1.0, 1.0])), extra_s=readonly(np.zeros(3)),
    pending_prefill=2, prefill_s_per_token=1.0)))  # every verify token displaces prefill
def test_default_confidence_equals_exhaustive_search(case):
    """Budget K = the first maximiser of tau*_i / C_i over i = 0..min(n*gamma, budget - n),
    tau*_i the best i drafts (by enumeration, or the stretched lagged curve when the
    snapshot carries one); then the current batch's top-K drafts."""
    survival, lagged, cost = case
    n, g = survival.shape
    size = min(n * g + 1, cost.budget - n + 1)
    if lagged is None:
        a = [[Fraction(float(v)) for v in row] for row in survival]
        best = {}
        for ell in itertools.product(range(g + 1), repeat=n):
            i = sum(ell)
            tau = n + sum(sum(a[r][: ell[r]], Fraction(0)) for r in range(n))
            best[i] = max(best.get(i, tau), tau)
        tau = [best[i] for i in range(size)]
    else:
        est = stretched_by_hand(lagged, n * g)
        tau = [n + sum(est[:i], Fraction(0)) for i in range(size)]
    ratio = [tau[i] / step_cost_by_hand(cost, n, i) for i in range(size)]
    k = ratio.index(max(ratio))
    snap = BatchSnapshot(readonly(survival), g, cost.budget, cost=cost,
                         lagged_survival=None if lagged is None else readonly(lagged))
    ell = get_policy("confidence")(snap)
    assert ell.tolist() == topk_lengths(survival, k), (ratio, k)
    assert n + int(ell.sum()) <= cost.budget


@given(batches(), st.integers(1, 30))
def test_stretch_is_a_quantile_map(batch, size):
    lagged, _ = batch
    got = stretch_sorted(sorted_desc(lagged), size)
    assert [Fraction(float(v)) for v in got] == stretched_by_hand(lagged, size)


# -- edges the Hypothesis draws reach only by chance (pinned by hand) ---------------------------


def test_topk_of_a_square_batch_is_not_the_whole_table():
    """k = n / gamma (2 x 2, k = 1; 4 x 2, k = 2) is neither 0 nor every draft: equal
    survivals, so the first k candidates in row-major order (request 0's first drafts)."""
    assert schedule_topk(np.full((2, 2), 0.5), 1).tolist() == [1, 0]
    assert schedule_topk(np.full((4, 2), 0.5), 2).tolist() == [2, 0, 0, 0]
    # and k = n * gamma is the whole table
    assert schedule_topk(np.full((4, 2), 0.5), 8).tolist() == [2, 2, 2, 2]


def test_stretch_edges_by_hand():
    """Quantile map at its edges: one candidate takes the curve's top (quantile 0); a
    one-value curve repeats; no candidates give an empty curve; an empty lagged curve
    (nothing to estimate from) gives zeros, so the estimate admits nothing."""
    curve = np.array([0.75, 0.5, 0.25])
    assert stretch_sorted(curve, 1).tolist() == [0.75]
    assert stretch_sorted(curve, 2).tolist() == [0.75, 0.5]  # j * 3 // 2 = 0, 1
    assert stretch_sorted(np.array([0.75]), 3).tolist() == [0.75, 0.75, 0.75]
    assert stretch_sorted(curve, 0).tolist() == []
    assert stretch_sorted(np.zeros(0), 3).tolist() == [0.0, 0.0, 0.0]


def test_displacement_budget_of_an_empty_batch_is_zero():
    from dspark_sim.policies.scheduler import budget_displacement

    cost = StepCost(readonly(np.ones(9)), readonly(np.zeros(1)), 0, 0.0)
    assert budget_displacement(np.zeros((0, 4)), cost) == 0
    # the stretched-estimate form with n given: no requests, no drafts
    assert budget_displacement(np.zeros((0, 4)), cost, 0, np.array([1.0, 1.0])) == 0


# -- vllm-adaptive: vLLM's T + B pricing, the one-step-old array as it is ------------------------


def test_vllm_adaptive_first_step_prices_only_what_the_step_carries():
    """No lagged snapshot yet: K from this step's survivals. One request, two sure drafts,
    token budget 3, a flat table (1 s at any B), two pending prefill tokens at 1 s each
    when displaced. T + B pricing: i = 0, 1, 2 drafts carry 2, 1, 0 prefill tokens, B is
    always 3, C = 1, 1, 1 and tau = 1, 2, 3: K = 2. The default prices the displaced
    prefill: C = 1, 2, 3, tau / C = 1, 1, 1, first maximum K = 0. A lag of the same
    survivals changes neither."""
    a = readonly(np.array([[1.0, 1.0]]))
    cost = StepCost(readonly(np.ones(4)), readonly(np.zeros(3)), 2, 1.0)
    for lag in (None, a):
        snap = BatchSnapshot(a, 2, cost.budget, cost=cost, lagged_survival=lag)
        assert get_policy("vllm-adaptive")(snap).tolist() == [2]
        assert get_policy("confidence")(snap).tolist() == [0]


def test_lagged_budgets_by_hand():
    """Two requests now, survivals (1/2, 1/4) and (3/4, 1/2); one request's drafts a step
    or two ago, (1, 3/4); the step costs C_i = 1 + i / 4 at i drafts (table 0.5 + B / 4 at
    B = 2 + i verify tokens, nothing else).

    * vllm-adaptive sizes K on the lagged array as it is, not stretched to this batch:
      tau = 2, 3, 3.75 over C = 1, 1.25, 1.5 gives 2, 2.4, 2.5: K = 2, this step's best
      two are 3/4 (request 1) and the first 1/2 in row-major order (request 0): [1, 1].
    * confidence stretches the lag to 4 candidates (1, 1, 3/4, 3/4): tau = 2, 3, 4, 4.75,
      5.5 over 1 .. 2 rises to 2.75 at K = 4: [2, 2].
    * With no lagged rows (the last steps decoded nothing) there is no lag: both size K on
      this step's survivals, tau = 2, 2.75, 3.25, 3.75, 4 gives 2, 2.2, 2.17, 2.14, 2: K = 1,
      the 3/4: [0, 1]."""
    cur = readonly(np.array([[0.5, 0.25], [0.75, 0.5]]))
    cost = StepCost(readonly(0.5 + 0.25 * np.arange(11)), readonly(np.zeros(5)), 0, 0.0)

    def run(spec, lag):
        return get_policy(spec)(BatchSnapshot(cur, 2, cost.budget, cost=cost,
                                              lagged_survival=lag)).tolist()

    one_row = readonly(np.array([[1.0, 0.75]]))
    assert run("vllm-adaptive", one_row) == [1, 1]
    assert run("confidence", one_row) == [2, 2]
    no_rows = readonly(np.zeros((0, 2)))
    assert run("vllm-adaptive", no_rows) == run("vllm-adaptive", None) == [0, 1]
    assert run("confidence", no_rows) == run("confidence", None) == [0, 1]


def test_async_lag_of_one_row_and_of_none():
    """confidence-async: a one-request lag is a lag (survivals 1/2, 1/2 on a table that
    halves at the first draft: Theta = 10, 7.5, 10, first maximum K = 0); a lag with no
    rows is none, and the current batch (certain drafts, flat table) sizes K = 4."""
    cur = readonly(np.ones((2, 2)))
    flat = readonly(np.full(5, 10.0))
    pol = get_policy("confidence-async")
    snap = BatchSnapshot(cur, 2, 100, sps=flat, lagged_survival=readonly(np.full((1, 2), 0.5)),
                         lagged_sps=readonly(np.array([10.0, 5.0, 5.0])))
    assert pol(snap).tolist() == [0, 0]
    snap = BatchSnapshot(cur, 2, 100, sps=flat, lagged_survival=readonly(np.zeros((0, 2))),
                         lagged_sps=readonly(np.array([10.0])))
    assert pol(snap).tolist() == [2, 2]


def test_none_and_mtp1_verify_what_they_name():
    """none verifies nothing and mtp1 its one MTP draft, whatever the snapshot's block."""
    snap = BatchSnapshot(readonly(np.ones((3, 5))), 5, 100)
    assert get_policy("none")(snap).tolist() == [0, 0, 0]
    assert get_policy("mtp1")(snap).tolist() == [1, 1, 1]
