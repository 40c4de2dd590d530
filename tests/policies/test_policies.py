"""Policies: registry, purity, Algorithm 1 behaviour (incl. the Appendix A example)."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_sim.errors import InputError
from dspark_sim.policies.base import BatchSnapshot, readonly
from dspark_sim.policies.registry import Reads, get_policy
from dspark_sim.policies.scheduler import (
    budget_global,
    schedule_async,
    schedule_sync,
    schedule_topk,
    theta_curve,
)


def _survival(rng, n, g):
    c = rng.uniform(0.3, 1.0, size=(n, g))
    return np.cumprod(c, axis=1)


def test_appendix_a_counterexample():
    """SPS(1,2,3) = 1, 0.5, 0.45: the early stop admits nothing, the global search two."""
    a = np.array([[0.9, 0.9 * 0.95]])
    sps = np.array([1.0, 0.5, 0.45])
    assert schedule_sync(a, sps).tolist() == [0]
    assert budget_global(a, sps) == 2
    theta = theta_curve(a, sps)
    assert theta[1] < theta[0] < theta[2]


def test_sync_admits_while_theta_rises():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n, g = rng.integers(1, 12), rng.integers(1, 8)
        a = _survival(rng, n, g)
        sps = 1.0 / (1.0 + 0.02 * np.arange(n * g + 1) ** 1.3)
        ell = schedule_sync(a, sps)
        k = int(ell.sum())
        theta = theta_curve(a, sps)
        assert np.all(np.diff(theta[: k + 1]) > 0)
        assert k == n * g or theta[k + 1] <= theta[k]
        # admitted tokens are the k best by survival, and form prefixes
        chosen = np.concatenate([a[r, : ell[r]] for r in range(n)])
        rest = np.concatenate([a[r, ell[r]:] for r in range(n)])
        if chosen.size and rest.size:
            assert chosen.min() >= rest.max()


def test_topk_and_async():
    rng = np.random.default_rng(1)
    a = _survival(rng, 6, 5)
    for k in (0, 3, 11, 30, 99):
        ell = schedule_topk(a, k)
        assert ell.sum() == min(k, 30) and np.all(ell <= 5)
    lag = _survival(rng, 4, 5)
    sps = np.linspace(1.0, 0.6, 21)
    assert schedule_async(a, lag, sps).sum() == budget_global(lag, sps)


def test_ties_are_broken_row_major():
    a = np.full((3, 2), 0.5)
    assert schedule_topk(a, 3).tolist() == [2, 1, 0]


@pytest.mark.parametrize("spec,drafter", [("none", None), ("mtp1", "mtp1"), ("fixed:4", "dspark"),
                                          ("confidence", "dspark"), ("confidence-sync", "dspark"),
                                          ("confidence-async", "dspark"),
                                          ("threshold:0.3", "dspark")])
def test_registry_policies_are_pure(spec, drafter):
    from dspark_sim.policies.base import StepCost

    pol = get_policy(spec)
    assert pol.drafter == drafter
    rng = np.random.default_rng(2)
    a = readonly(_survival(rng, 8, 7))
    sps = readonly(1.0 / (1.0 + 0.01 * np.arange(57)))
    cost = StepCost(readonly(0.01 + 1e-4 * np.arange(8193)), readonly(np.full(57, 1e-3)), 0, 1e-4)
    snap = BatchSnapshot(survival=a, gamma_max=7, token_budget=8192, sps=sps,
                         lagged_survival=a, lagged_sps=sps, cost=cost, lagged_cost=cost)
    before = a.copy()
    first = pol(snap)
    again = pol(snap)
    assert np.array_equal(first, again)  # no hidden state
    assert np.array_equal(a, before)
    assert first.shape == (8,) and np.all((first >= 0) & (first <= 7))
    with pytest.raises(ValueError):
        a[0, 0] = 1.0  # snapshots are read-only


@pytest.mark.parametrize("bad", ["", "nope", "fixed", "fixed:-1", "fixed:x", "threshold:2",
                                 "threshold:abc"])
def test_bad_policy_specs(bad):
    with pytest.raises(InputError, match="--policy"):
        get_policy(bad)


SURVIVAL = Reads(survival=True)


@pytest.mark.parametrize("spec,name,drafter,gamma,reads", [
    ("none", "none", None, 0, Reads()),
    (" MTP1 ", "mtp1", "mtp1", 1, Reads()),
    ("fixed:0", "fixed:0", None, 0, Reads()),
    ("threshold:-0", "threshold:0", "dspark", None, SURVIVAL),  # one name for -0 and 0
    ("Fixed: 3", "fixed:3", "dspark", 3, Reads()),
    ("confidence", "confidence", "dspark", None,
     Reads(survival=True, cost=True, lag_steps=2, lag_rows=64)),
    ("confidence-sync", "confidence-sync", "dspark", None, Reads(survival=True, sps="decode")),
    ("alg1", "confidence-sync", "dspark", None, Reads(survival=True, sps="decode")),
    ("confidence-async", "confidence-async", "dspark", None,
     Reads(survival=True, sps="batch", lag_steps=2)),
    ("confidence_async", "confidence-async", "dspark", None,
     Reads(survival=True, sps="batch", lag_steps=2)),
    ("vllm-adaptive", "vllm-adaptive", "dspark", None,
     Reads(survival=True, cost=True, lag_steps=1)),
    ("vllm_adaptive", "vllm-adaptive", "dspark", None,
     Reads(survival=True, cost=True, lag_steps=1)),
    ("threshold", "threshold:0.5", "dspark", None, SURVIVAL),
    ("threshold:0", "threshold:0", "dspark", None, SURVIVAL),
    ("threshold:1", "threshold:1", "dspark", None, SURVIVAL),
])
def test_registry_names_drafters_and_what_each_policy_asks_for(spec, name, drafter, gamma, reads):
    """What the engine computes for a policy (SPS curve, step cost, lagged snapshot,
    survival) is what the policy asks for: nothing more (it costs time), nothing less."""
    pol = get_policy(spec)
    assert (pol.name, pol.drafter, pol.draft_gamma) == (name, drafter, gamma)
    assert pol.reads == reads
    assert pol.speculates == (drafter is not None)
    assert pol.description


@pytest.mark.parametrize("spec,gamma,want", [
    ("none", 7, 0), ("mtp1", 7, 1), ("fixed:3", 7, 3), ("fixed:3", 2, 2),
    ("confidence", 7, 7), ("confidence", 5, 5), ("pctree:32,4", 7, 32), ("pctree:32,4", 0, 0),
])
def test_each_policy_says_how_many_tokens_a_request_may_verify(spec, gamma, want):
    """The engine gives each request this many verify slots: a chain its draft length cut
    to what the drafter drafts (all of it where the policy names none), a tree its nodes."""
    assert get_policy(spec).verify_max(gamma) == want


@pytest.mark.parametrize("spec,draft_tokens,want", [
    ("none", False, "constant"), ("mtp1", True, "constant"), ("fixed:3", False, "constant"),
    ("confidence", False, "lagged"), ("confidence", True, None),
    ("vllm-adaptive", False, "lagged"), ("vllm-adaptive", True, "proposed"),
    ("confidence-async", False, None), ("threshold", False, None), ("dfly", False, None),
    ("pctree:32,4", False, None), ("asd", False, None), ("skip", False, None),
])
def test_each_policy_names_the_kernel_that_makes_its_decision(spec, draft_tokens, want):
    """Which compiled call decides for a policy is the policy's answer: its kernel's
    signature, the proposed-drafts twin on a trace with draft_tokens; none for a policy
    without a kernel, nor for a lossy wrapper of one (its decide is not the kernel's)."""
    got = get_policy(spec).compiled_decision(draft_tokens=draft_tokens)
    assert (got.signature if got is not None else None) == want


def test_a_policy_reading_what_its_kernel_is_not_fed_decides_on_snapshots():
    """A kernel applies only while the policy reads what its signature feeds: fixed:3 made
    to read survivals, confidence made to read v2 fields or state, or without its lagged
    view, or whose decide is replaced, runs decide."""
    from dataclasses import replace

    fixed, conf = get_policy("fixed:3"), get_policy("confidence")
    assert fixed.compiled_decision() is not None and conf.compiled_decision() is not None
    for pol in (replace(fixed, reads=SURVIVAL),
                replace(conf, reads=replace(conf.reads, fields=("alt_prob",))),
                replace(conf, reads=replace(conf.reads, state=True)),
                replace(conf, reads=replace(conf.reads, lag_steps=0)),
                replace(conf, reads=replace(conf.reads, sps="batch")),
                replace(conf, stops_drafting=True),
                replace(conf, decide=lambda s: conf.decide(s))):
        assert pol.compiled_decision() is None


def test_history_and_lagged_view_by_hand():
    """The engine keeps ``lag_steps + lag_rows`` snapshots for a lagged policy (none for
    the others) and hands it the one ``lag_steps`` old; ``confidence`` stacks older
    survivals under it until they hold 64 rows (or the history runs out)."""
    import dataclasses

    conf, asyn, vllm = (get_policy(p) for p in ("confidence", "confidence-async",
                                                "vllm-adaptive"))
    assert (conf.history, asyn.history, vllm.history, get_policy("fixed:3").history) == (
        2 + 64, 2, 1, 0)

    def hist(*rows):  # snapshot i: `rows[i]` survival rows, all holding the value i
        return [(readonly(np.full((r, 2), float(i))), f"sps{i}", f"cost{i}", None)
                for i, r in enumerate(rows)]

    # too little history: nothing lagged yet
    assert asyn.lagged(hist(5)) == (None, None, None, None)
    assert get_policy("fixed:3").lagged(hist(5, 5, 5)) == (None, None, None, None)
    # two steps old is the second newest... of three: snapshot 1; one step old: the newest
    surv, sps, cost, proposed = asyn.lagged(hist(5, 5, 5))
    assert surv.shape == (5, 2) and (surv == 1.0).all() and (sps, cost) == ("sps1", "cost1")
    assert proposed is None  # every row proposed its whole block
    assert vllm.lagged(hist(5, 5, 5))[1:] == ("sps2", "cost2", None)
    # 30-row snapshots: snapshot 3 (two steps old of five) then 2, then 1 reach 90 >= 64
    surv, sps, cost, _ = conf.lagged(hist(30, 30, 30, 30, 30))
    assert surv[:, 0].tolist() == [3.0] * 30 + [2.0] * 30 + [1.0] * 30
    assert (sps, cost) == ("sps3", "cost3") and not surv.flags.writeable
    # the history runs out first: all of it up to two steps old
    assert conf.lagged(hist(10, 10, 10))[0][:, 0].tolist() == [1.0] * 10 + [0.0] * 10
    # exactly 64 rows two steps old: nothing stacked; 63: one more snapshot
    assert conf.lagged(hist(10, 64, 5))[0].shape == (64, 2)
    assert conf.lagged(hist(10, 63, 5))[0][:, 0].tolist() == [1.0] * 63 + [0.0] * 10
    assert conf.lagged(hist(1, 60, 4, 5))[0].shape == (64, 2)  # 4 + 60 = 64: stop there
    with pytest.raises(dataclasses.FrozenInstanceError):
        conf.reads.lag_steps = 1


def test_threshold_default_is_one_half():
    a = readonly(np.array([[0.6, 0.5, 0.4]]))
    assert get_policy("threshold")(BatchSnapshot(a, 3, 100)).tolist() == [2]


@pytest.mark.parametrize("bad,message", [
    ("fixed", "needs an argument"), ("fixed:x", "must be an integer"),
    ("fixed:-1", "must be >= 0"), ("threshold:2", "[0, 1]"), ("threshold:-0.1", "[0, 1]"),
    ("threshold:abc", "must be a number"), ("bogus", "unknown policy 'bogus'"),
    ("", "empty policy name"), ("  ", "empty policy name"),
    # an argument to a policy that takes none was dropped: confidence:0.9 ran confidence
    ("none:3", "none takes no argument"), ("mtp1:2", "mtp1 takes no argument"),
    ("confidence:0.9", "confidence takes no argument"),
    ("Confidence-Sync:x", "confidence-sync takes no argument"),
    ("alg1:1", "alg1 takes no argument"),
    ("confidence-async:2", "confidence-async takes no argument"),
    ("vllm-adaptive:1", "vllm-adaptive takes no argument"),
])
def test_bad_policy_messages(bad, message):
    with pytest.raises(InputError, match="--policy") as e:
        get_policy(bad)
    assert message in str(e.value)


def test_snapshots_and_costs_are_frozen():
    """A policy is a pure function of a read-only snapshot: it can neither write the
    arrays (read-only views) nor rebind a field."""
    import dataclasses

    from dspark_sim.policies.base import StepCost

    snap = BatchSnapshot(readonly(np.ones((2, 3))), 3, 100)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.survival = np.zeros((2, 3))
    cost = StepCost(readonly(np.ones(5)), readonly(np.zeros(7)), 0, 0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cost.pending_prefill = 3
    # a chain policy's cost has no tree, stopping-drafter or fixed draft terms
    assert (cost.draft_token_s, cost.draft_pass_s, cost.draft_fixed_s) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="read-only"):
        snap.survival[0, 0] = 0.5
    # nor can a tree / lossy policy's decision, its replay's view, its outcome or its
    # configuration change
    from dspark_sim.policies.base import Replayed, ReplayView, Verification
    from dspark_sim.policies.lossy import AsdConfig, SkipPlan

    for obj, name in ((Verification(np.ones(2)), "tokens"),
                      (ReplayView(np.ones(2), np.zeros(2), None, np.zeros(2)), "state"),
                      (Replayed(np.ones(2)), "accepted"),
                      (SkipPlan(np.ones(2, bool), np.ones(2)), "commit"),
                      (AsdConfig(0.5, 1, 8.0), "budget")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, np.zeros(2))


def test_policy_records_compare_and_hash_by_identity():
    """The records a policy reads and returns hold arrays, whose ``==`` is element-wise:
    field-wise equality would raise (an array's truth value is ambiguous) or call two
    steps' one-element records equal, and a frozen record with field-wise equality hashes
    its arrays (TypeError). So they compare and hash by identity (``eq=False``): ``in``,
    dict keys and caches keyed on a snapshot, a cost or a plan are safe for a policy."""
    from dspark_sim.policies.base import Replayed, ReplayView, StepCost, Verification
    from dspark_sim.policies.lossy import SkipPlan

    makers = (lambda: StepCost(readonly(np.ones(3)), readonly(np.zeros(3)), 0, 0.0),
              lambda: BatchSnapshot(readonly(np.ones((2, 2))), 2, 8),
              lambda: Verification(np.ones(2)),
              lambda: ReplayView(np.ones(2), np.zeros(2), None, np.zeros(2)),
              lambda: Replayed(np.ones(2)),
              lambda: SkipPlan(np.ones(2, bool), np.ones(2)))
    for make in makers:
        a, b = make(), make()  # equal contents, two records
        assert a == a and a != b and not (a == b)
        assert {a: "a", b: "b"}[b] == "b" and b in [a, b] and [a, b].index(b) == 1


@pytest.mark.parametrize("bad", [None, 5, 1.5])
def test_non_string_policy_specs(bad):
    with pytest.raises(InputError, match="empty policy name"):
        get_policy(bad)


def test_no_room_for_verification_means_no_drafts():
    """A batch of n requests with a token budget of n (or less) verifies nothing."""
    from dspark_sim.policies.base import StepCost
    from dspark_sim.policies.scheduler import budget_displacement

    a = np.ones((3, 2))
    for budget in (1, 2, 3):
        cost = StepCost(readonly(np.ones(budget + 1)), readonly(np.zeros(7)), 0, 0.0)
        assert budget_displacement(a, cost) == 0
