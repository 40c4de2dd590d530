"""DFly / D-cut (batch-shared verification budgets): K from the ratio set, prefix-closed
top-K, the choice equal to a brute force priced by hand, DFly at {100 %} = fixed:gamma."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dspark_sim.errors import InputError
from dspark_sim.policies.base import BatchSnapshot, StepCost, readonly
from dspark_sim.policies.registry import Reads, get_policy


def _survival(rng, n, g):
    return np.cumprod(rng.uniform(0.2, 1.0, size=(n, g)), axis=1)


def _cost(rng, budget, gamma, n, pending):
    # a jagged, non-decreasing table (CUDA-graph steps) and random non-negative extras
    table = 0.01 + np.cumsum(rng.uniform(0, 2e-4, budget + 1) * (rng.random(budget + 1) < 0.3))
    extra = np.sort(rng.uniform(0, 5e-3, n * gamma + 1))
    return StepCost(readonly(table), readonly(extra), int(pending), float(rng.uniform(0, 5e-5)))


def _step_by_hand(cost: StepCost, n: int, k: int) -> float:
    """C_K written out from its definition: the table at the verify tokens plus the
    pending prefill that fits, the extra terms, the displaced prefill at its price."""
    verify = n + k
    carried = min(cost.pending_prefill, max(cost.budget - verify, 0))
    displaced = cost.pending_prefill - carried
    return cost.table_s[verify + carried] + cost.extra_s[k] + cost.prefill_s_per_token * displaced


def _progress(a: np.ndarray, k: int) -> float:
    return a.shape[0] + float(np.sort(a.reshape(-1))[::-1][:k].sum())


def _check_prefix_top_k(a, ell):
    assert np.all((ell >= 0) & (ell <= a.shape[1]))
    chosen = np.concatenate([a[r, : ell[r]] for r in range(a.shape[0])])
    rest = np.concatenate([a[r, ell[r]:] for r in range(a.shape[0])])
    if chosen.size and rest.size:
        assert chosen.min() >= rest.max()  # the K best slots, each request a prefix


@pytest.mark.parametrize("seed", range(40))
def test_dfly_k_is_a_ratio_prefix_closed_and_the_best_priced_by_hand(seed):
    rng = np.random.default_rng(seed)
    n, g = int(rng.integers(1, 40)), int(rng.integers(1, 9))
    budget = int(rng.integers(n, n * (1 + g) + 20))
    a = readonly(_survival(rng, n, g))
    cost = _cost(rng, budget, g, n, rng.integers(0, 3 * budget) * (rng.random() < 0.5))
    ell = get_policy("dfly")(BatchSnapshot(a, g, budget, cost=cost))
    k = int(ell.sum())
    # the four ratios of n*g slots, rounded half up, by hand
    ratio_k = sorted({int(np.floor(p * n * g / 100 + 0.5)) for p in (25, 50, 75, 100)})
    assert k in ratio_k
    _check_prefix_top_k(a, ell)
    fits = [x for x in ratio_k if n + x <= budget]
    if not fits:
        assert k == ratio_k[0]
        return
    score = {x: _progress(a, x) / _step_by_hand(cost, n, x) for x in fits}
    best = max(score.values())
    assert k == min(x for x in fits if score[x] == best)


@pytest.mark.parametrize("seed", range(30))
def test_dcut_cut_is_the_brute_force_best_slot(seed):
    rng = np.random.default_rng(100 + seed)
    n, g = int(rng.integers(1, 30)), int(rng.integers(1, 8))
    budget = int(rng.integers(n, n * (1 + g) + 20))
    a = readonly(_survival(rng, n, g))
    cost = _cost(rng, budget, g, n, rng.integers(0, 2 * budget) * (rng.random() < 0.5))
    ell = get_policy("dcut")(BatchSnapshot(a, g, budget, cost=cost))
    _check_prefix_top_k(a, ell)
    ks = [x for x in range(n * g + 1) if n + x <= budget]
    score = [_progress(a, x) / _step_by_hand(cost, n, x) for x in ks]
    assert int(ell.sum()) == ks[int(np.argmax(score))]
    # D-cut searches a superset of DFly's ratios: its predicted rate is never lower
    k_dfly = int(get_policy("dfly")(BatchSnapshot(a, g, budget, cost=cost)).sum())
    if n + k_dfly <= budget:
        assert max(score) >= _progress(a, k_dfly) / _step_by_hand(cost, n, k_dfly) - 1e-15


def test_custom_ratios_and_the_floor():
    """A pricey table makes verification a loss: DFly still verifies its smallest ratio
    (its floor), D-cut verifies nothing."""
    a = readonly(np.full((8, 4), 0.5))
    cost = StepCost(readonly(0.01 + 1.0 * np.arange(101)), readonly(np.zeros(33)), 0, 0.0)
    snap = BatchSnapshot(a, 4, 100, cost=cost)
    assert get_policy("dfly")(snap).sum() == 8  # 25 % of 32 slots
    assert get_policy("dfly:50,100")(snap).sum() == 16
    assert get_policy("dcut")(snap).sum() == 0


def test_dfly_at_all_slots_is_fixed_gamma_in_the_engine(tiny_cfg):
    from dspark_sim.sim.api import simulate

    a = readonly(np.random.default_rng(0).uniform(0, 1, (5, 7)))
    cost = StepCost(readonly(np.ones(9)), readonly(np.zeros(36)), 0, 0.0)  # budget 8 < 40
    ell = get_policy("dfly:100")(BatchSnapshot(a, 7, 8, cost=cost))
    assert ell.tolist() == [7] * 5  # no ratio fits: the engine trims, as for fixed:7
    fixed = simulate(replace(tiny_cfg, policy="fixed:7")).summary
    dfly = simulate(replace(tiny_cfg, policy="dfly:100")).summary
    assert dfly["output_throughput"] == fixed["output_throughput"] > 0
    drop = {"policy", "policy_description", "confidences"}  # what it reads, not figures
    assert {k: v for k, v in dfly.items() if k not in drop} \
        == {k: v for k, v in fixed.items() if k not in drop}


@pytest.mark.parametrize("bad,message", [
    ("dfly:0", "1..100"), ("dfly:101", "1..100"), ("dfly:0,50", "1..100"),
    ("dfly:50,50", "distinct"),
    ("dfly:x", "integer percentages"), ("dcut:3", "no argument"),
])
def test_bad_shared_budget_specs(bad, message):
    with pytest.raises(InputError, match="--policy") as e:
        get_policy(bad)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_names_and_what_they_ask_for():
    assert get_policy("DFly").name == "dfly"
    assert get_policy("dfly:100,25").name == "dfly:25,100"
    # both ends of 1..100 are ratios (1 % of 32 slots rounds to K = 0)
    assert get_policy("dfly:1,100").name == "dfly:1,100"
    assert get_policy("dfly:1").name == "dfly:1"
    for spec in ("dfly", "dcut"):
        p = get_policy(spec)
        assert (p.drafter, p.reads) == ("dspark", Reads(survival=True, cost=True))


def test_dfly_budget_edges_by_hand():
    from dspark_sim.policies.shared_budget import dfly_budget

    # the default ratio set is 25/50/75/100 %: spelled out, it is plain "dfly"
    assert get_policy("dfly:25,50,75,100").name == "dfly"
    flat = StepCost(readonly(np.ones(9)), readonly(np.zeros(9)), 0, 0.0)
    assert dfly_budget(np.zeros((0, 3)), flat) == 0  # no requests, no slots
    # 2 requests x 2 drafts, certain: ratios give K = 1, 2, 3, 4 and with a flat cost the
    # largest that fits wins; a token budget of 5 fits n + K <= 5, so K = 3, not 4
    cost = StepCost(readonly(np.ones(6)), readonly(np.zeros(5)), 0, 0.0)
    assert dfly_budget(np.ones((2, 2)), cost) == 3
    # 1 request x 1 draft: 25 % of one slot rounds to K = 0, the others to 1. Survival 0.5,
    # C_0 = 1.0 s, C_1 = 1.2 s: progress / latency 1 / 1.0 < (1 + 0.5) / 1.2, so K = 1
    cost = StepCost(readonly(np.array([0.5, 1.0, 1.2])), readonly(np.zeros(2)), 0, 0.0)
    assert dfly_budget(np.array([[0.5]]), cost) == 1
