"""Tree policies (cure, pctree, dspark-tree) and the synthetic v2 tree fields.

Losslessness of tree-verified output on the real target is pinned by the real-model test
(``tests/test_capture_v2.py``: ``traces/tree_decode.py`` decodes with the tree kernels and
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
from dspark_sim.policies.trees import UNUSED, node_survival_factors, tree_accepted
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


POLICY_SPECS = st.one_of(
    st.builds(lambda n, k: f"pctree:{n},{k}", st.integers(1, 40), st.integers(1, 6)),
    st.builds(lambda n, b, f, m: f"cure:{n},{b},{f},{m}", st.integers(1, 40),
              st.integers(1, 3), st.integers(1, 6), st.sampled_from([0.0, 0.2, 0.6, 1.0])),
    st.builds(lambda n, k: f"dspark-tree:{n},{k}", st.integers(1, 40), st.integers(1, 6)),
)


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

    chain = replace(base, name="chain-alg1", decide=decide, needs_lag=False)
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
    for bad in ("cure:0", "pctree:a", "cure:8,2,4,1.5", "pctree:1,2,3"):
        with pytest.raises(InputError):
            get_policy(bad)


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


# -- the command line on the shipped v2 traces (issue 15's "done when") ---------------


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
