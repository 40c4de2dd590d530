"""Tree policies (cure, pctree, dspark-tree) and the synthetic v2 tree fields.

Losslessness of tree-verified output on the real target is pinned by the real-model test
(``tests/traces/test_capture_v2.py``: ``traces/tree_decode.py`` decodes with the tree kernels and
equals the target's greedy output); here the replays are checked against brute force."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_sim.errors import InputError
from dspark_sim.policies.base import BatchSnapshot, StepCost, Verification, readonly
from dspark_sim.policies.registry import Policy, get_policy
from dspark_sim.policies.scheduler import budget_displacement, schedule_topk
from dspark_sim.policies.trees import (
    MAX_TREE_NODES,
    UNUSED,
    node_survival_factors,
    tree_accepted,
)
from dspark_sim.sim import api
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import DeploymentConfig, SimConfig, WorkloadConfig
from dspark_sim.sim.tree_synth import served_tree_tau, static_accept_len
from dspark_sim.traces.schema import load_trace
from dspark_sim.traces.synth import DomainCurve
from dspark_sim.traces.synth_v2 import RankModel, synth_tree

G = 8
CURVES = (DomainCurve("a", p1=0.85, tau=4.0, k=G),)


@pytest.fixture(scope="module")
def trace():
    return synth_tree(CURVES, gamma=G, requests_per_domain=12, positions=96, seed=5,
                      rank_model=RankModel(h_mean=0.4))


def _cfg(policy: str, n: int = 40, conc: int = 8) -> SimConfig:
    return SimConfig(policy=policy,
                     deployment=DeploymentConfig(replicas=1, profile="qwen3-8b-h100"),
                     workload=WorkloadConfig(arrival="closed", max_concurrency=conc,
                                             num_requests=n, lengths="fixed:64:96"))


def _summary(policy, cfg, trace):
    if isinstance(policy, str):
        return simulate(cfg, trace=trace).summary
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(api, "get_policy", lambda spec: policy)
        return simulate(cfg, trace=trace).summary


KEYS = ("engine_steps", "num_accepted_tokens", "num_draft_tokens_verified",
        "total_output_tokens", "duration", "mean_verify_tokens_per_request_step")


# -- synthetic v2 fields ---------------------------------------------------------------


def test_synthetic_ranks_agree_with_the_chain(trace):
    v, m = trace.v2, trace.accept_len.astype(np.int64)
    depth = np.arange(G)[None, :]
    assert (v.true_rank[depth < m[:, None]] == 0).all()
    cut = m < G
    assert (v.true_rank[cut, m[cut]] != 0).all()
    assert np.array_equal(v.tree_accept_len(1), m)
    assert (np.diff(v.alt_prob.astype(np.float32), axis=2) <= 0).all()
    # true_prob is the drafter's probability of the target's token
    r = v.true_rank.astype(np.int64)
    inside = r < v.alt_prob.shape[2]
    got = np.take_along_axis(v.alt_prob, np.minimum(r, 3)[..., None], axis=2)[..., 0]
    assert np.allclose(got[inside].astype(float), v.true_prob[inside].astype(float), atol=2e-3)


def test_rejected_tokens_follow_the_drafters_own_split():
    """A calibrated drafter: where its greedy token is rejected, the target's token is its
    runner-up with probability p_1 / (1 - p_0) (read off alt_prob, independently of the
    generator's h); a smaller spread puts more of the rejections there."""
    def shares(h):
        t = synth_tree(CURVES, gamma=G, requests_per_domain=8, positions=64, seed=1,
                       rank_model=RankModel(h_mean=h))
        r, p = t.v2.true_rank, t.v2.alt_prob.astype(np.float64)
        miss = r >= 1
        expected = (p[..., 1] / (1.0 - p[..., 0]))[miss].mean()
        return (r[miss] == 1).mean(), expected
    for h in (0.2, 0.8):
        got, expected = shares(h)
        assert got == pytest.approx(expected, abs=0.04)
    assert shares(0.2)[0] > shares(0.8)[0] + 0.2


def test_reference_tree_is_solved_to_its_tau():
    target = 5.0

    def served(t):
        return served_tree_tau(t, f"pctree:{2 * G},2")

    t = synth_tree(CURVES, gamma=G, requests_per_domain=8, positions=64, seed=2,
                   reference=(target, served))
    assert served(t) == pytest.approx(target, abs=0.05)
    assert t.meta.generator["reference"]["tau"] == target
    assert t.served_tau(G) < target  # the chain is below its tree


def test_shipped_tree_traces_read_and_serve_their_settings():
    pc = load_trace("pctree-qwen3-4b-gsm8k-synthetic")
    assert pc.schema_version == 2 and pc.gamma_max == 16
    assert pc.served_tau(16) == pytest.approx(9.41, abs=0.1)  # the matched DSpark chain
    assert served_tree_tau(pc, "pctree") == pytest.approx(11.16, abs=0.05)  # solved to it
    cure = load_trace("cure-qwen3-8b-synthetic")
    rm = cure.meta.generator["rank_model"]
    assert rm == pc.meta.generator["rank_model"]  # CURE's spread is PCTree's, not fitted


# -- replay against brute force ----------------------------------------------------------


def _paths(plan, tokens, r):
    """The verified nodes of request r as explicit rank paths (tuples)."""
    parent, rank, order = plan.parent[r], plan.rank[r], plan.order[r]
    g, s = rank.shape
    paths: dict[tuple[int, int], tuple] = {}
    out = set()
    for j in range(g):
        for k in range(s):
            if order[j, k] >= tokens[r]:
                continue
            p = int(parent[j, k])
            assert p != UNUSED
            prefix = () if j == 0 else paths[(j - 1, p)]  # KeyError: parent not verified
            paths[(j, k)] = prefix + (int(rank[j, k]),)
            out.add(paths[(j, k)])
    return out


def _random_snapshot(seed: int, n: int, g: int, *, budget: int = 8192):
    rng = np.random.default_rng(seed)
    alt = np.sort(rng.dirichlet(np.full(6, 0.6), size=(n, g))[..., :4], axis=2)[..., ::-1]
    alt = np.round(alt, 3)  # ties and zeros happen in real traces
    rank = rng.choice([-1, 0, 0, 0, 1, 2, 3, 5], size=(n, g))
    surv = np.cumprod(rng.uniform(0.2, 1.0, (n, g)), axis=1)
    table = 0.01 + np.cumsum(rng.uniform(0, 2e-5, budget + 1))
    cost = StepCost(readonly(table), readonly(np.full(n * g + 1, 1e-3)),
                    int(rng.integers(0, 200)), 1e-5, float(rng.uniform(0, 1e-4)))
    snap = BatchSnapshot(readonly(surv), g, budget, cost=cost,
                         fields={"alt_prob": readonly(alt)})
    return snap, rank


def tree_specs(nodes: int, width: int, margins: list[float]):
    """pctree / cure / dspark-tree specs with up to ``nodes`` nodes and ``width`` children
    per depth (cure: fan-out), cure's margin drawn from ``margins``."""
    return st.one_of(
        st.builds(lambda n, k: f"pctree:{n},{k}", st.integers(1, nodes), st.integers(1, width)),
        st.builds(lambda n, b, f, m: f"cure:{n},{b},{f},{m}", st.integers(1, nodes),
                  st.integers(1, 3), st.integers(1, width), st.sampled_from(margins)),
        st.builds(lambda n, k: f"dspark-tree:{n},{k}", st.integers(1, nodes),
                  st.integers(1, width)),
    )


POLICY_SPECS = tree_specs(40, 6, [0.0, 0.2, 0.6, 1.0])


@settings(max_examples=60, deadline=None)
@given(spec=POLICY_SPECS, seed=st.integers(0, 10_000), n=st.integers(1, 6),
       g=st.integers(1, 7))
def test_budgets_hold_and_replay_matches_brute_force(spec, seed, n, g):
    pol = get_policy(spec)
    snap, true_rank = _random_snapshot(seed, n, g, budget=n * (1 + 4 * g) // 2 + 1)
    v = pol(snap)
    assert isinstance(v, Verification)
    tokens = np.asarray(v.tokens)
    plan = v.plan
    name, _, arg = spec.partition(":")
    args = arg.split(",")
    cap = int(args[0])
    assert (tokens >= 0).all() and (tokens <= cap).all() and (tokens <= pol.max_tokens).all()
    if name == "dspark-tree":  # the batch budget: verify tokens never exceed the step's
        assert n + tokens.sum() <= snap.token_budget
    width = int(args[1]) if name != "cure" else int(args[2])
    # every verified slot is a real node, a depth holds at most the frontier
    verified = plan.order < tokens[:, None, None]
    assert (verified.sum(axis=(1, 2)) == tokens).all()
    assert (verified.sum(axis=2) <= width).all()
    acc = tree_accepted(plan, tokens, true_rank)
    assert (v.draft_tokens >= 0).all()
    for r in range(n):
        paths = _paths(plan, tokens, r)  # ancestor-closed, or a KeyError
        assert len(paths) == tokens[r]  # no node twice
        if name == "cure":
            b, margin = int(args[1]), float(args[3])
            p = snap.fields["alt_prob"][r]
            for path in paths:
                for j, rk in enumerate(path):
                    assert rk <= b and (rk == 0 or p[j, 0] - p[j, 1] < margin)
        # brute force: the longest prefix of the true rank path held by the tree
        truth = [int(x) for x in true_rank[r]]
        best = 0
        for d in range(1, g + 1):
            if tuple(truth[:d]) in paths:
                best = d
            else:
                break
        assert acc[r] == best


def test_one_branch_per_depth_is_the_chain_by_hand():
    """A tree with rank 0 at every depth accepts min(tokens, m) (hand-built)."""
    from dspark_sim.policies.trees import TreePlan
    parent = np.array([[[-1], [0], [0]]] * 3)
    rank = np.zeros((3, 3, 1), np.int64)
    order = np.array([[[0], [1], [2]]] * 3)
    true_rank = np.array([[0, 0, 0], [0, 2, 0], [1, 0, 0]])
    plan = TreePlan(parent, rank, order)
    assert tree_accepted(plan, np.array([3, 3, 3]), true_rank).tolist() == [3, 1, 0]
    assert tree_accepted(plan, np.array([2, 0, 3]), true_rank).tolist() == [2, 0, 0]


# -- end to end: a tree with one branch per depth replays as the chain -----------------


@pytest.mark.parametrize("spec", [f"pctree:{G},1", f"cure:{G},1,1,0"])
def test_width_one_tree_runs_exactly_as_the_chain(trace, spec):
    chain = _summary("fixed", _cfg(f"fixed:{G}"), trace)
    tree = _summary(spec, _cfg(spec), trace)
    for key in KEYS:
        assert tree[key] == chain[key], key
    assert tree["policy"].startswith(spec.split(":")[0])


def test_chain_only_dspark_tree_is_algorithm_1_on_chains(trace):
    """When the drafter puts no mass on its runner-ups, dspark-tree's trees are chains,
    ranked by their survival at this step's costs: the chain policy
    top-K(budget_displacement) written directly. (With runner-up mass, a one-node frontier
    may follow a runner-up where the calibrated confidence says the greedy token is
    likely wrong: not the chain.)"""
    alt = trace.v2.alt_prob.copy()
    alt[..., 1:] = 0
    trace = replace(trace, v2=replace(trace.v2, alt_prob=alt))
    base = get_policy("confidence")

    def decide(s):
        return schedule_topk(s.survival, budget_displacement(s.survival, s.cost))

    chain = replace(base, name="chain-alg1", decide=decide,
                    reads=replace(base.reads, lag_steps=0, lag_rows=0))
    a = _summary(chain, _cfg("confidence"), trace)
    b = _summary(f"dspark-tree:{G},1", _cfg(f"dspark-tree:{G},1"), trace)
    for key in KEYS:
        assert a[key] == b[key], key


def test_node_survival_splits_the_rejected_mass():
    surv = np.array([[0.8, 0.4]])
    alt = np.array([[[0.7, 0.2, 0.1, 0.0], [0.5, 0.25, 0.25, 0.0]]])
    f = node_survival_factors(surv, alt)
    assert f[0, 0].tolist() == pytest.approx([0.8, 0.2 * 0.2 / 0.3, 0.2 * 0.1 / 0.3, 0.0])
    assert f[0, 1].tolist() == pytest.approx([0.5, 0.25, 0.25, 0.0])
    assert f[0].sum(axis=1) == pytest.approx([1.0, 1.0])  # the drafter's top-4 hold it all


def test_trees_beat_the_chain_on_accepted_length_and_pay_in_batch_tokens(trace):
    chain = _summary("fixed", _cfg(f"fixed:{G}"), trace)
    for spec in ("pctree", "cure:24,2,4,0.6"):
        s = _summary(spec, _cfg(spec), trace)
        assert s["spec_decode_acceptance_length"] > chain["spec_decode_acceptance_length"]
        assert s["mean_verify_tokens_per_request_step"] > \
            chain["mean_verify_tokens_per_request_step"]


def test_static_replay_equals_the_engine_at_concurrency_one(trace):
    """A row-local tree's accepted length per row, from the offline replay, is what the
    engine's requests accept at those rows (one request: every step is its own)."""
    acc = static_accept_len(trace, "pctree:12,3")
    cfg = _cfg("pctree:12,3", n=1, conc=1)
    res = simulate(cfg, trace=trace, trace_rows=np.array([0]))
    start = trace.req_offsets[0]
    steps, pos, tokens = 0, 0, 0
    while tokens < 95:  # 96 output tokens, the first from prefill
        a = int(acc[start + pos])
        adv = min(a + 1, 95 - tokens)
        tokens += adv
        pos = (pos + adv) % (trace.req_offsets[1] - start)
        steps += 1
    assert res.summary["engine_steps"] == steps + 1  # + the prefill step


def test_tree_specs_parse_and_reject_bad_arguments():
    assert get_policy("cure").name == "cure:32,2,4,0.5"
    assert get_policy("pctree:48").name == "pctree:48,4"
    assert get_policy("dspark-tree:,2").name == "dspark-tree:64,2"
    assert get_policy("cure:8,2,4,-0").name == "cure:8,2,4,0"  # was 'cure:8,2,4,-0'
    for bad in ("cure:0", "pctree:a", "cure:8,2,4,1.5", "pctree:1,2,3",
                # N past the cap: cure:10**14 allocated N-sized statistics (MemoryError)
                "cure:1025", "pctree:100000000,4", "dspark-tree:99999999999999"):
        with pytest.raises(InputError, match="--policy"):
            get_policy(bad)
    assert get_policy(f"pctree:{MAX_TREE_NODES}").max_tokens == MAX_TREE_NODES


def test_a_v1_trace_is_refused_by_name(tmp_path):
    from dspark_sim.traces.synth import synth_iid
    t = synth_iid(0.7, 4, num_requests=4, positions=32)
    with pytest.raises(InputError, match="alt_prob"):
        simulate(_cfg("pctree"), trace=t)


def test_same_seed_same_bytes(trace):
    a = _summary("dspark-tree", _cfg("dspark-tree"), trace)
    b = _summary("dspark-tree", _cfg("dspark-tree"), trace)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_policy_is_pure(trace):
    pol: Policy = get_policy("cure")
    snap, _ = _random_snapshot(3, 4, 5)
    a, b = pol(snap), pol(snap)
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.plan.order, b.plan.order)


# -- the command line on the shipped v2 traces ------------------------------------------


@pytest.mark.parametrize("spec,budget", [("cure", 32), ("pctree:24,3", 24),
                                         ("dspark-tree:20,2", 20)])
def test_cli_run_tree_policy_on_a_shipped_v2_trace(tmp_path, spec, budget):
    """``dspark-sim run --policy <tree>`` on a shipped v2 trace by its built-in name: every
    request completes, nothing is changed (lossless), and no request step verifies more
    than the policy's node budget plus its root (the bonus slot)."""
    from typer.testing import CliRunner

    from dspark_sim.cli import app

    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["run", "--policy", spec, "--trace",
                                 "cure-qwen3-8b-synthetic", "--num-requests", "24",
                                 "--replicas", "1", "--max-concurrency", "6",
                                 "--lengths", "fixed:64:96", "--out", str(out)])
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    assert s["policy"] == get_policy(spec).name and s["completed"] == 24
    assert s["trace"] == "builtin:cure-qwen3-8b-synthetic" and s["trace_gamma_max"] == 16
    assert s["changed_tokens"] == 0 and not s["lossy"]
    assert 1.0 < s["mean_verify_tokens_per_request_step"] <= budget + 1
    assert s["total_output_tokens"] == 24 * 96


def test_cli_sweep_and_report_show_tree_policies(tmp_path):
    """The sweep runs tree policies beside a chain on a shipped v2 trace, and its report
    names them; the width-1 tree (one branch per depth) serves exactly the chain's
    accepted tokens and steps (the chain takes the engine's fast path, the tree the
    replay)."""
    import polars as pl
    from typer.testing import CliRunner

    from dspark_sim.cli import app

    out = tmp_path / "sw"
    pols = ["fixed:16", "pctree:16,1", "cure:24,2,3,0.4", "dspark-tree"]
    r = CliRunner().invoke(app, ["sweep", "--out", str(out), "--policies", ",".join(pols),
                                 "--traces", "pctree-qwen3-4b-gsm8k-synthetic",
                                 "--concurrency", "4", "--num-requests", "16",
                                 "--replicas", "1", "--lengths", "fixed:64:96",
                                 "--executor", "serial", "--quiet"])
    assert r.exit_code == 0, r.output
    df = pl.read_parquet(out / "results.parquet")
    assert sorted(df["policy_spec"]) == sorted(pols)
    by = {row["policy_spec"]: row for row in df.iter_rows(named=True)}
    assert by["cure:24,2,3,0.4"]["mean_verify_tokens_per_request_step"] <= 24 + 1
    for key in ("num_accepted_tokens", "engine_steps", "num_draft_tokens_verified"):
        assert by["pctree:16,1"][key] == by["fixed:16"][key], key
    html = (out / "report.html").read_text()
    for spec in pols[1:]:
        assert get_policy(spec).name in html, spec


def test_tree_policy_defaults_are_the_documented_ones():
    """cure:32,2,4,0.5, pctree:64,4 and dspark-tree:64,4 when no argument is given."""
    assert [get_policy(s).name for s in ("cure", "pctree", "dspark-tree")] == [
        "cure:32,2,4,0.5", "pctree:64,4", "dspark-tree:64,4"]


def test_cure_repairs_only_below_the_margin_not_at_it():
    """CURE opens repair branches where p_top1 - p_top2 < M: a margin of exactly M (0.75
    - 0.25 = 0.5, exact in binary) is not a repair point, so the tree is the chain (g
    nodes, no repair drafted); just above it every depth opens its two branches."""
    from dspark_sim.policies.trees import cure_decide

    n, g = 2, 3
    alt = np.zeros((n, g, 4))
    alt[:, :, 0], alt[:, :, 1], alt[:, :, 2] = 0.75, 0.25, 0.125
    snap = BatchSnapshot(survival=np.full((n, g), 0.5), gamma_max=g, token_budget=512,
                         fields={"alt_prob": alt})
    at = cure_decide(32, 2, 4, 0.5)(snap)
    assert at.tokens.tolist() == [g, g] and at.draft_tokens.tolist() == [0, 0]
    above = cure_decide(32, 2, 4, 0.5 + 2**-20)(snap)
    assert (above.draft_tokens > 0).all() and (above.tokens > g).all()


def test_tree_step_cost_extends_the_extra_terms_at_their_mean_slope():
    """Past the engine's n*gamma + 1 extra terms, a tree's step prices each further node
    at the terms' mean per-token slope: extra (0, 1, 2) ms -> slope 1 ms -> (3, 4, 5) ms;
    no pending prefill, so the step is table[n + i] + extra[i]."""
    from dspark_sim.policies.trees import _tree_step_s

    table = readonly(np.arange(16, dtype=np.float64) * 10.0)
    cost = StepCost(table, readonly(np.array([0.0, 1.0, 2.0])), 0, 0.0)
    got = _tree_step_s(cost, 1, 6)
    np.testing.assert_allclose(got, [10 + 0, 20 + 1, 30 + 2, 40 + 3, 50 + 4, 60 + 5])
    np.testing.assert_allclose(_tree_step_s(cost, 1, 3), [10, 21, 32])  # no extension


# -- the tree builders against their definitions, written as plain loops ---------------
#
# Each policy's tree is rebuilt here from the module docstring's definition, one request
# and one node at a time, with no array tricks: at each depth the ``width`` best children
# (value = parent's value x the child's factor, > 0 only) of the previous depth's kept
# nodes, ties in (parent's place, rank) order; a request's nodes ranked by value, ties
# shallower first then by place; the verified nodes are a prefix of that ranking. The
# policies' plans are read back as rank paths (through their parent pointers) and must
# equal these trees node for node, in order, with the same tokens and drafting.


def _bf_levels(factor, allowed, width):
    """One request's tree: per depth the kept nodes (path, value), best first."""
    g, k = factor.shape
    levels, prev = [], [((), 1.0)]  # the root
    for j in range(g):
        cands = [(path + (rk,), val * float(factor[j, rk]))
                 for path, val in prev for rk in range(k) if allowed[j, rk]]
        cands = [c for c in cands if c[1] > 0]  # a zero-probability node is no node
        cands.sort(key=lambda c: -c[1])  # Python's sort is stable: (parent, rank) order
        prev = cands[:width]
        levels.append(prev)
    return levels


def _bf_ranking(levels):
    """[(path, value)] by value descending; ties: shallower, then the place in its depth."""
    nodes = [(-val, j, place, path, val) for j, lv in enumerate(levels)
             for place, (path, val) in enumerate(lv)]
    return [(path, val) for *_, path, val in sorted(nodes)]


def _off_spine_parents(nodes):
    """Markov-head tokens: distinct parents of ``nodes`` ((request, path) pairs) that are
    nodes off the all-rank-0 chain (the root's and the chain's children come from the
    block pass)."""
    return len({(r, p[:-1]) for r, p in nodes if len(p) > 1 and any(p[:-1])})


def _plan_ranking(plan, r):
    """Request r's live nodes as rank paths in the plan's verification order, read back
    through the parent pointers; the orders must be exactly 0..L-1."""
    parent, rank, order = plan.parent[r], plan.rank[r], plan.order[r]
    from dspark_sim.policies.trees import NEVER
    g, s = rank.shape
    path_of: dict[tuple[int, int], tuple] = {}
    live = []
    for j in range(g):
        for k in range(s):
            if order[j, k] == NEVER:
                continue
            p = int(parent[j, k])
            prefix = () if j == 0 else path_of[(j - 1, p)]  # KeyError: no such parent
            assert (p == -1) == (j == 0)
            path_of[(j, k)] = prefix + (int(rank[j, k]),)
            live.append((int(order[j, k]), path_of[(j, k)]))
    live.sort()
    assert [o for o, _ in live] == list(range(len(live)))
    return [p for _, p in live]


def _tie_snapshot(seed: int, n: int, g: int, budget: int):
    """Drafter fields on a coarse grid, so equal joint probabilities, zeros, certain
    tokens (p_0 = 1) and flat survival (c_j = 1, a child as likely as its parent) occur;
    a step cost whose extra terms are not flat and whose prefill is sometimes absent."""
    rng = np.random.default_rng(seed)
    alt = np.zeros((n, g, 4))
    for r in range(n):
        for j in range(g):
            left = 20
            for c in range(4):  # multiples of 0.05, non-increasing, sum <= 1
                take = int(rng.integers(0, left + 1)) if c < 3 else left
                take = min(take, int(alt[r, j, c - 1] * 20 + 1e-9)) if c else take
                alt[r, j, c] = take / 20
                left -= take
    steps = rng.choice([1.0, 1.0, 0.9, 0.5, 0.25, 0.0], size=(n, g))
    surv = np.cumprod(steps, axis=1)
    # per-token costs from negligible to comparable with a node's worth (a step of
    # ~10 ms, a node worth ~1/n of the step's tokens), so every price moves the budget
    slope = float(rng.choice([1e-5, 3e-4, 2e-3]))
    table = 0.01 + np.cumsum(rng.uniform(0, slope, budget + 1))
    extra = np.cumsum(rng.uniform(0, slope, n * g + 1))
    pending = int(rng.choice([0, int(rng.integers(1, 2 * budget))]))
    cost = StepCost(readonly(table), readonly(extra), pending, float(rng.uniform(0, slope)),
                    float(rng.choice([0.0, slope / 4, 4 * slope])))
    return BatchSnapshot(readonly(surv), g, budget, cost=cost,
                         fields={"alt_prob": readonly(alt)})


def _bf_factors(surv_r, alt_r):
    """The docstring's path-survival factors for one request, by hand."""
    g, k = alt_r.shape
    f = np.zeros((g, k))
    prev = 1.0
    for j in range(g):
        c = surv_r[j] / prev if prev > 0 else 0.0
        c = min(max(c, 0.0), 1.0)
        rest = max(1.0 - alt_r[j, 0], 1e-6)
        f[j, 0] = c
        for rk in range(1, k):
            f[j, rk] = min(max((1.0 - c) * alt_r[j, rk] / rest, 0.0), 1.0)
        prev = surv_r[j]
    return f


def _bf_step_s(cost, n, i):
    """The step with i nodes, priced by hand: table at the tokens carried (verify plus the
    prefill that still fits), the extra terms (past their end at their mean slope), the
    displaced prefill."""
    extra = cost.extra_s
    last = extra.size - 1
    if i <= last:
        ext = extra[i]
    else:
        ext = extra[last] + (extra[last] - extra[0]) / max(last, 1) * (i - last)
    verify = n + i
    if not cost.pending_prefill:
        return cost.table_s[verify] + ext
    carried = min(cost.pending_prefill, max(cost.budget - verify, 0))
    return cost.table_s[verify + carried] + ext \
        + cost.prefill_s_per_token * (cost.pending_prefill - carried)


def _bf_policy(spec, snap):
    """(tokens, per-request rankings, draft tokens) of a tree policy, by its definition."""
    name, _, arg = spec.partition(":")
    a = [float(x) for x in arg.split(",")]
    alt = np.asarray(snap.fields["alt_prob"], np.float64)
    n, g, k = alt.shape
    if name == "cure":
        cap, b, width, margin = int(a[0]), int(a[1]), int(a[2]), a[3]
        allowed = np.zeros((n, g, k), bool)
        for r in range(n):
            for j in range(g):
                for rk in range(k):
                    repair = alt[r, j, 0] - alt[r, j, 1] < margin
                    allowed[r, j, rk] = rk == 0 or (repair and 1 <= rk <= b)
        factor = alt
    else:
        cap, width = int(a[0]), int(a[1])
        allowed = np.ones((n, g, k), bool)
        factor = alt if name == "pctree" else np.stack(
            [_bf_factors(snap.survival[r], alt[r]) for r in range(n)])
    rankings = [_bf_ranking(_bf_levels(factor[r], allowed[r], width)) for r in range(n)]
    if name != "dspark-tree":
        tokens = [min(len(rk), cap) for rk in rankings]
    else:  # Algorithm 1 over the batch's nodes, every prefix of the best-first list tried
        cands = sorted((-val, r, pos, path) for r, rk in enumerate(rankings)
                       for pos, (path, val) in enumerate(rk[:cap]))
        size = min(len(cands) + 1, snap.cost.budget - n + 1)
        best, best_rate, tau = 0, -1.0, float(n)
        for i in range(size):
            if i:
                tau = n + sum(-c[0] for c in cands[:i])
            step = _bf_step_s(snap.cost, n, i) + snap.cost.draft_token_s * \
                _off_spine_parents([(c[1], c[3]) for c in cands[:i]])
            if tau / step > best_rate:  # the first best, as argmax
                best, best_rate = i, tau / step
        tokens = [sum(1 for c in cands[:best] if c[1] == r) for r in range(n)]
    verified = [[p for p, _ in rk[:t]] for rk, t in zip(rankings, tokens, strict=True)]
    if name == "cure":
        drafted = [sum(1 for p in v if p[-1] > 0) for v in verified]
    else:
        drafted = [_off_spine_parents([(0, p) for p in v]) for v in verified]
    return tokens, [[p for p, _ in rk] for rk in rankings], drafted


BUILDER_SPECS = tree_specs(30, 5, [0.0, 0.25, 0.5, 1.0])


@settings(max_examples=150, deadline=None)
@given(spec=BUILDER_SPECS, seed=st.integers(0, 10_000), n=st.integers(1, 4),
       g=st.integers(1, 5), budget=st.integers(1, 60))
def test_tree_builders_equal_their_definitions(spec, seed, n, g, budget):
    snap = _tie_snapshot(seed, n, g, max(budget, n))
    v = get_policy(spec)(snap)
    tokens, rankings, drafted = _bf_policy(spec, snap)
    name, _, arg = spec.partition(":")
    vals = [int(float(a)) for a in arg.split(",")]
    n_max, width = vals[0], vals[2 if name == "cure" else 1]
    # pctree:64,100000 built [n, gamma, 100000] arrays (minutes a step; wider: no memory)
    assert v.plan.rank.shape[2] == min(width, n_max)
    for r in range(n):
        got = _plan_ranking(v.plan, r)
        # a frontier wider than N keeps N slots per depth (policies/trees.py
        # _frontier_width): the N nodes that can ever be verified, and their order, are
        # the definition's; the never-verifiable tail is not built
        assert got[:n_max] == rankings[r][:n_max], r
        if width <= n_max:
            assert got == rankings[r], r
    assert np.asarray(v.tokens).tolist() == tokens
    assert np.asarray(v.draft_tokens).tolist() == drafted


def _one_request_dspark_tree(survival, alt, table, draft_token_s, width=1):
    snap = BatchSnapshot(readonly(np.array([survival])), len(survival), table.size - 1,
                         cost=StepCost(readonly(table), readonly(np.zeros(len(survival) + 1)),
                                       0, 0.0, draft_token_s),
                         fields={"alt_prob": readonly(np.array([alt]))})
    return get_policy(f"dspark-tree:8,{width}")(snap)


def test_dspark_tree_verifies_nothing_when_no_node_pays_for_its_step():
    """One request, one depth, c = 0.01 and a drafter whose top 4 hold little of the
    rejected mass (p = 0.5, 0.005, 0.005, 0): the best node survives with 0.01 (the
    runner-ups 0.99 * 0.005 / 0.5 = 0.0099) and makes the step 50 % dearer: 1/1 s beats
    1.01/1.5 s, so no node is verified, whatever the Markov head costs (verifying nothing
    drafts nothing)."""
    alt = [[0.5, 0.005, 0.005, 0.0]]
    table = np.array([0.0, 1.0, 1.5, 1.5])  # s at 0, 1, 2, 3 batch tokens
    for draft_token_s in (0.0, 1.0):
        v = _one_request_dspark_tree([0.01], alt, table, draft_token_s)
        assert v.tokens.tolist() == [0] and v.draft_tokens.tolist() == [0]


def test_dspark_tree_prices_no_markov_token_for_the_roots_alternatives():
    """The calibrated confidence says the greedy token is likely wrong (c = 0.2), so the
    best root child is the runner-up: (1 - 0.2) * 0.4 / 0.5 = 0.64. The root's
    alternatives come with the block pass (no Markov-head token), so verifying it is worth
    1.64 / 1.5 > 1 / 1 however dear a Markov-head token d is. A child of that runner-up
    (off the chain) does need one: with c = 1 at depth 2 it survives with 0.64 * 1, and
    (1 + 0.64 + 0.64) / (1.5 + d) beats 1.64 / 1.5 only while d < 0.585."""
    alt = [[0.5, 0.4, 0.1, 0.0]]
    table = np.array([0.0, 1.0, 1.5, 1.5])
    for d in (0.0, 0.5, 50.0):
        v = _one_request_dspark_tree([0.2], alt, table, d)
        assert v.tokens.tolist() == [1] and v.draft_tokens.tolist() == [0]
        assert v.plan.rank[0, 0, 0] == 1
    alt2 = [[0.5, 0.4, 0.1, 0.0], [0.9, 0.1, 0.0, 0.0]]
    table2 = np.array([0.0, 1.0, 1.5, 1.5, 1.5])
    for d, tokens, drafted in ((0.0, 2, 1), (0.55, 2, 1), (0.62, 1, 0), (5.0, 1, 0)):
        v = _one_request_dspark_tree([0.2, 0.2], alt2, table2, d)
        assert (v.tokens.tolist(), v.draft_tokens.tolist()) == ([tokens], [drafted]), d


def test_tree_step_cost_displaces_prefill_by_hand():
    """With prefill pending, verify tokens first take the budget's spare room, then
    push prefill out of the step, each displaced token priced at prefill_s_per_token:
    budget 15, 12 pending, table 10 s per token, 100 s per displaced token; i = 0..5
    nodes with one request: verify 1..6, carried min(12, 15 - verify) = 12,12,12,11,10,9."""
    from dspark_sim.policies.trees import _tree_step_s

    table = readonly(np.arange(16, dtype=np.float64) * 10.0)
    cost = StepCost(table, readonly(np.zeros(3)), 12, 100.0)
    np.testing.assert_allclose(_tree_step_s(cost, 1, 6),
                               [130, 140, 150, 150 + 100, 150 + 200, 150 + 300])


def test_tree_step_cost_extends_two_extra_terms_at_their_slope():
    """One request of one draft: extra (0, 1) ms has slope 1 ms per token, so the
    further nodes cost 2, 3 ms (the mean slope over one gap, not half of it)."""
    from dspark_sim.policies.trees import _tree_step_s

    cost = StepCost(readonly(np.zeros(8)), readonly(np.array([0.0, 1.0])), 0, 0.0)
    np.testing.assert_allclose(_tree_step_s(cost, 1, 4), [0, 1, 2, 3])


def test_node_survival_factors_stay_probabilities_on_rounded_rows():
    """A drafter row stored in half precision can hold p_0 + p_1 a hair above 1 (0.5 and
    0.5 + 2**-11); where the calibrated confidence is 0 (survival drops to 0), the
    runner-up would get (1 - 0) * p_1 / (1 - p_0) = 1.00098: it is a probability, so 1."""
    surv = np.array([[0.5, 0.0]])
    alt = np.array([[[0.5, 0.25, 0.25, 0.0], [0.5, 0.5 + 2**-11, 0.0, 0.0]]])
    f = node_survival_factors(surv, alt)
    assert f[0, 0].tolist() == [0.5, 0.25, 0.25, 0.0]
    assert f[0, 1].tolist() == [0.0, 1.0, 0.0, 0.0]


def test_a_tree_plan_is_frozen_and_compared_by_identity():
    """A plan is handed from the policy to its replay unchanged: its fields cannot be
    rebound, and since it holds arrays (whose == is elementwise) it compares and hashes
    by identity: two plans over the same arrays are two plans."""
    import dataclasses

    from dspark_sim.policies.trees import TreePlan

    snap, _ = _random_snapshot(1, 2, 3)
    plan = get_policy("pctree:8,2")(snap).plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.order = plan.order
    twin = TreePlan(plan.parent, plan.rank, plan.order)
    assert plan == plan and plan != twin and len({plan, twin}) == 2
