"""Lossy policies (``asd``, ``skip``), the synthetic lossy fields and the task-score
bounds. Expected values come from hand computation, a scalar reference of the ASD rule,
or the equivalent lossless policy's own run."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dspark_sim.errors import InputError
from dspark_sim.policies import lossy
from dspark_sim.policies.lossy import MIN_REGRET, AsdConfig, asd_block
from dspark_sim.policies.registry import get_policy
from dspark_sim.sim import api
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import DeploymentConfig, SimConfig, WorkloadConfig
from dspark_sim.sim.quality import task_score
from dspark_sim.sim.sweep import parse_list
from dspark_sim.traces.schema import AcceptanceTrace, TraceMeta, load_trace
from dspark_sim.traces.schema_v2 import V2Fields
from dspark_sim.traces.synth import synth_iid
from dspark_sim.traces.synth_lossy import LossyModel, add_lossy_fields

LOSSY_TRACE = "dspark-gsm8k-lossy-synthetic"
# what a run says of its policy, not its figures
IDENTITY_KEYS = ("policy", "policy_description", "lossy", "confidences", "engine_can_run",
                 "engine_note")


def _cfg(policy: str, n: int = 40, conc: int = 8, lengths: str = "fixed:64:96") -> SimConfig:
    return SimConfig(policy=policy, deployment=DeploymentConfig(replicas=1),
                     workload=WorkloadConfig(arrival="closed", max_concurrency=conc,
                                             num_requests=n, lengths=lengths))


def _same_as_lossless(lossy_res, chain_res) -> None:
    """Every figure of the lossless run, byte for byte, and the same requests."""
    a = {k: v for k, v in lossy_res.summary.items()
         if k in chain_res.summary and k not in IDENTITY_KEYS}
    b = {k: v for k, v in chain_res.summary.items() if k not in IDENTITY_KEYS}
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert lossy_res.requests.equals(chain_res.requests)


@pytest.fixture(scope="module")
def shipped():
    return load_trace(LOSSY_TRACE)


# -- the B = 0 / P > 1 identities ----------------------------------------------------
@pytest.mark.parametrize("spec,chain", [
    ("asd:0.5,1,0", "confidence"),        # B = 0: strict
    ("asd:100,7,0@fixed:7", "fixed:7"),    # generous g and m, still no budget
    ("asd:100,0,inf@fixed:5", "fixed:5"),  # m = 0: no lossy acceptance per block
    ("asd:0,7,inf@fixed:5", "fixed:5"),    # g = 0: every mismatch costs >= MIN_REGRET > 0
])
def test_asd_without_budget_is_strict_decoding(shipped, spec, chain):
    res = simulate(_cfg(spec), trace=shipped)
    _same_as_lossless(res, simulate(_cfg(chain), trace=shipped))
    assert res.summary["lossy"] is True and res.summary["changed_tokens"] == 0
    # nothing changed: the task score is the greedy one, with no gap between the bounds
    s = res.summary
    assert s["task_score_low"] == s["task_score_high"] == s["task_score_greedy"]


@pytest.mark.parametrize("spec,chain", [("skip:1.01", "confidence"), ("skip:2@fixed:3", "fixed:3")])
def test_skip_above_one_never_skips(shipped, spec, chain):
    res = simulate(_cfg(spec), trace=shipped)
    _same_as_lossless(res, simulate(_cfg(chain), trace=shipped))
    assert res.summary["changed_tokens"] == 0


def test_asd_with_a_budget_gains_tau_and_changes_tokens(shipped):
    strict = simulate(_cfg("fixed:7", conc=1, n=24), trace=shipped).summary
    asd = simulate(_cfg("asd@fixed:7", conc=1, n=24), trace=shipped).summary
    assert asd["spec_decode_acceptance_length"] > strict["spec_decode_acceptance_length"]
    assert 0 < asd["changed_token_fraction"] < 0.2
    assert asd["task_score_low"] <= asd["task_score_high"]


# -- ASD's rule against a scalar reference ---------------------------------------------
def _asd_reference(tokens, m, regret, q, spent, g, mcap, budget):
    """One request, depth by depth, as the paper states it."""
    acc = changed = 0
    for j in range(tokens):
        r = float(regret[j])
        match = j < m or (j > m and r == 0.0)
        if match:
            acc += 1
            continue
        rho = max(r, MIN_REGRET) / float(q[j]) if q[j] > 0 else np.inf
        if changed < mcap and rho <= g and spent + rho <= budget:
            acc += 1
            changed += 1
            spent += rho
            continue
        break
    return acc, changed, spent


@given(st.integers(0, 2**31 - 1), st.floats(0, 3), st.integers(0, 4),
       st.sampled_from([0.0, 0.3, 1.0, 5.0, np.inf]))
def test_asd_block_matches_the_reference_and_keeps_the_budget(seed, g, mcap, budget):
    rng = np.random.default_rng(seed)
    n, gamma = 16, 6
    m = rng.integers(0, gamma + 1, n)
    tokens = rng.integers(0, gamma + 1, n)
    regret = np.where(rng.random((n, gamma)) < 0.3, 0.0, rng.exponential(0.5, (n, gamma)))
    regret[np.arange(gamma)[None] < m[:, None]] = 0.0  # accepted depths: exact zero
    q = rng.choice([0.0, 0.2, 0.7, 1.0], size=(n, gamma))
    spent0 = rng.uniform(0, min(budget, 2.0), n)
    cfg = AsdConfig(g, mcap, budget)
    acc, ch, spent = asd_block(tokens, m, regret.astype(np.float32), q, spent0, cfg)
    for i in range(n):
        want = _asd_reference(tokens[i], m[i], regret[i].astype(np.float32), q[i],
                              spent0[i], g, mcap, budget)
        assert (acc[i], ch[i]) == want[:2] and spent[i] == pytest.approx(want[2])
    assert (spent <= budget + 1e-9).all() and (ch <= mcap).all()
    assert (acc >= np.minimum(tokens, m)).all() and (acc <= tokens).all()


@given(st.floats(0.05, 2.0), st.integers(1, 3), st.floats(0.0, 4.0))
def test_cumulative_regret_never_exceeds_the_budget_in_a_run(g, mcap, budget):
    trace = load_trace(LOSSY_TRACE)
    pol = get_policy(f"asd:{g},{mcap},{budget}@fixed:7")
    seen: list[np.ndarray] = []

    def replay(plan, view):
        out = pol.replay(plan, view)
        assert (view.state <= budget + 1e-9).all()
        seen.append(np.asarray(out.state))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(api, "get_policy", lambda spec: replace(pol, replay=replay))
        res = simulate(_cfg("fixed:7", n=12, conc=4, lengths="fixed:32:160"), trace=trace)
    states = np.concatenate(seen)
    assert (states <= budget + 1e-9).all()
    if budget == 0:
        assert res.summary["changed_tokens"] == 0


def test_asd_by_hand_on_a_constant_trace():
    """accept_len 2 everywhere, the first mismatch (depth 3) at regret 0.2 with q = 0.5
    (rho = 0.4), depth 4 recorded equal to the greedy token: asd:0.5,1,1 accepts depths 3
    and 4 while the budget allows (0.4, 0.8; a third would reach 1.2 > 1): two steps of
    4 drafts + bonus, then strict steps of 2 + bonus."""
    n_req, pos, gamma = 4, 64, 4
    rows = n_req * pos
    top = np.full((rows, gamma), 10.0, np.float16)
    low = top.copy()
    low[:, 2] = np.float16(9.8)
    trace = AcceptanceTrace(
        meta=TraceMeta(drafter="hand", target="hand", gamma_max=gamma),
        accept_len=np.full(rows, 2, np.int8), conf=np.full((rows, gamma), 0.9, np.float32),
        req_offsets=np.arange(0, rows + 1, pos, dtype=np.int64),
        req_domain=np.full(n_req, "gsm8k"), req_ids=np.arange(n_req, dtype=np.int32),
        v2=V2Fields(tgt_top1_logit=top, draft_tgt_logit=low,
                    draft_prob=np.full((rows, gamma), 0.5, np.float16),
                    req_correct=np.array([1, 0, 1, -1], np.int8)))
    res = simulate(_cfg("asd:0.5,1,1@fixed:4", n=4, conc=4, lengths="fixed:16:64"),
                   trace=trace, trace_rows=np.arange(4))
    r = res.requests
    # 1 (prefill) + 5 + 5 = 11, then 53 tokens at 3 per step: 18 steps (the last cut)
    assert (r["steps"] == 20).all() and (r["changed_tokens"] == 2).all()
    s = res.summary
    assert s["changed_tokens"] == 8 and s["changed_token_fraction"] == pytest.approx(8 / 256)
    # every keyed request changed: low bound counts them wrong, high keeps the labels
    assert s["task_score_requests"] == 3 and s["changed_requests"] == 4
    assert s["task_score_greedy"] == pytest.approx(2 / 3)
    assert s["task_score_low"] == 0.0 and s["task_score_high"] == pytest.approx(2 / 3)


# -- skip by hand ----------------------------------------------------------------------
def _flat_trace(accept: int, conf: float, gamma: int = 7, v2=None) -> AcceptanceTrace:
    rows = 4 * 256
    return AcceptanceTrace(
        meta=TraceMeta(drafter="hand", target="hand", gamma_max=gamma),
        accept_len=np.full(rows, accept, np.int8), conf=np.full((rows, gamma), conf, np.float32),
        req_offsets=np.arange(0, rows + 1, 256, dtype=np.int64),
        req_domain=np.full(4, "x"), req_ids=np.arange(4, dtype=np.int32), v2=v2)


def test_skip_by_hand_commits_then_writes_the_kv_on_the_next_verify():
    """Every draft certain (survival 1), base fixed:3: a request commits its 3 drafts
    without the verifier (no bonus), can't skip again (3 + 3 > 3), so the next step
    verifies 3 drafts (all accepted) plus the bonus and writes the 3 skipped tokens' KV:
    7 tokens per 2 steps, target tokens (0 + 1 + 3 + 3) per 2 request-steps."""
    trace = _flat_trace(7, 1.0)
    res = simulate(_cfg("skip:0.5@fixed:3", n=4, conc=4, lengths="fixed:16:96"), trace=trace)
    s, r = res.summary, res.requests
    # 1 (prefill) + 13 x (3 + 4) = 92, then a skip of 3 (95), then a verify cut to 1: 28
    assert (r["steps"] == 28).all() and (r["generated_tokens"] == 96).all()
    assert s["changed_tokens"] == 0  # the target would have accepted all of them
    assert s["mean_verify_tokens_per_request_step"] == pytest.approx((14 * 7) / 28)
    # the verifier judged 14 blocks of 3 per request and accepted all; the 14 skipped
    # blocks were committed unjudged: no acceptances (rate 1, waste 0, not 2 and -1), but
    # drafts the acceptance length counts: 1 + (14 x 3 + 14 x 3) / 28 request-steps
    assert s["num_draft_tokens_verified"] == 4 * 14 * 3  # the KV fill is not a draft
    assert s["num_accepted_tokens"] == 4 * 14 * 3
    assert s["num_unverified_tokens"] == 4 * 14 * 3
    assert s["spec_decode_acceptance_rate"] == 1.0 and s["verification_waste"] == 0.0
    assert s["spec_decode_acceptance_length"] == 1 + (14 * 3 + 14 * 3) / 28
    # per position: half the request-steps verified (and accepted) drafts 1..3, none deeper
    assert s["acceptance_per_position"] == s["verified_per_position"] == [0.5] * 3 + [0.0] * 4
    assert (r["accepted_tokens"] == 14 * 3).all() and (r["draft_tokens_verified"] == 14 * 3).all()
    assert s["verifier_skipped_request_steps"] == 4 * 14 and s["verifier_call_fraction"] == 0.5


def test_skip_counts_unverified_wrong_drafts_as_changed():
    """accept_len 0 but certain confidences: each skip commits 7 drafts the target would
    have rejected from the first; without the trace's regret every one counts."""
    res = simulate(_cfg("skip:0.5@fixed:3", n=4, conc=4, lengths="fixed:16:96"),
                   trace=_flat_trace(0, 1.0))
    r = res.requests
    # 1 + 23 x (3 skipped + 1 bonus) = 93 in 46 steps, then a skip of 3: 24 skips of 3
    # changed drafts
    assert (r["changed_tokens"] == 72).all() and (r["steps"] == 47).all()
    assert res.summary["changed_token_fraction"] == pytest.approx(72 / 96)

def _skip_by_brute_force(survival, ell, pending, p, cap, accept_len, regret):
    """One request at a time, straight from the docstrings of ``skip_block`` and
    ``skip_replay``: (tokens, fill, accepted, changed, bonus, state) per request."""
    out = []
    for r in range(len(ell)):
        k = 0
        while k < survival.shape[1] and survival[r, k] >= p:  # leading drafts clearing P
            k += 1
        k = min(k, cap)
        skip = k >= 1 and pending[r] + k <= cap
        m = int(accept_len[r])
        if skip:
            # committed drafts the target would have rejected: the first miss (depth m)
            # and every deeper one, unless the recorded row has it as the greedy token
            changed = sum(1 for j in range(k) if j == m or (j > m and regret[r, j] != 0.0))
            out.append((0, 0, k, changed, False, pending[r] + k))
        else:
            out.append((int(ell[r]), int(pending[r]), min(int(ell[r]), m), 0, True, 0))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_skip_block_and_replay_equal_a_brute_force(seed):
    from types import SimpleNamespace

    from dspark_sim.policies.base import ReplayView
    from dspark_sim.policies.lossy import skip_block, skip_replay

    rng = np.random.default_rng(seed)
    n, g = 40, 6
    # prefix survivals (non-increasing), with exact values at P = 0.5 among them and
    # every count of leading drafts clearing it (one included) common
    survival = np.sort(rng.choice([0.1, 0.2, 0.3, 0.5, 0.7, 1.0], (n, g),
                                  p=[0.2, 0.2, 0.2, 0.15, 0.1, 0.15]), axis=1)[:, ::-1]
    ell = rng.integers(0, g + 1, n)
    cap = int(rng.integers(2, g + 1))
    pending = rng.integers(0, cap + 1, n)
    accept_len = rng.integers(0, g + 1, n)
    # integer logits: regret max(top - draft, 0) is exactly 0 at a tie or a larger draft
    top = rng.integers(0, 3, (n, g)).astype(np.float32)
    dtl = rng.integers(0, 3, (n, g)).astype(np.float32)
    regret = np.maximum(top - dtl, 0.0)
    trace = SimpleNamespace(v2=SimpleNamespace(tgt_top1_logit=top, draft_tgt_logit=dtl))
    ver = skip_block(survival, ell, pending, 0.5, cap)
    got = skip_replay(ver, ReplayView(accept_len, np.arange(n), trace, pending))
    want = _skip_by_brute_force(survival, ell, pending, 0.5, cap, accept_len, regret)
    cols = list(zip(ver.tokens, ver.fill_tokens, got.accepted, got.changed, got.bonus,
                    got.state, strict=True))
    assert [tuple(int(v) for v in c) for c in cols] == [
        tuple(int(v) for v in w) for w in want]
    assert any(w[4] is False for w in want) and any(w[4] is True for w in want)
    assert any(w[2] == 1 and w[4] is False for w in want)  # a skip of a single draft


def test_asd_accepts_a_mismatch_at_exactly_g_and_exactly_the_budget():
    """One mismatching draft (accept_len 0) with regret 0.5 and draft probability 0.5:
    rho = 1. At g = 1 and B = 1 it is accepted (both bounds are <=) and spends the whole
    budget."""
    acc, ch, spent = asd_block(np.array([1]), np.array([0]), np.array([[0.5]], np.float32),
                               np.array([[0.5]]), np.array([0.0]), AsdConfig(1.0, 1, 1.0))
    assert (acc.tolist(), ch.tolist(), spent.tolist()) == ([1], [1], [1.0])


def test_asd_refuses_a_captured_trace_at_a_nonzero_temperature():
    from types import SimpleNamespace

    def trace(source, temperature):
        return SimpleNamespace(meta=SimpleNamespace(source=source, temperature=temperature),
                               source_path="t.parquet")

    with pytest.raises(InputError, match="greedy decoding only") as e:
        lossy.check_greedy(trace("captured", 1.0))
    assert "temperature 1" in str(e.value) and "t.parquet" in str(e.value)
    lossy.check_greedy(trace("captured", 0.0))  # greedy: fine
    lossy.check_greedy(trace("synthetic", 1.0))  # synthetic traces have no sampling


def test_asd_run_on_a_sampled_captured_trace_is_a_one_line_error(shipped):
    """The replay itself refuses a captured trace sampled at temperature 1 (ASD's regret
    rule needs the greedy stream), naming the file; the same rows marked greedy run."""
    sampled = replace(shipped, meta=replace(shipped.meta, source="captured", temperature=1.0))
    with pytest.raises(InputError, match="greedy decoding only") as e:
        simulate(_cfg("asd@fixed:5", n=2, conc=2), trace=sampled)
    assert "temperature 1" in str(e.value) and shipped.source_path in str(e.value)
    greedy = replace(shipped, meta=replace(shipped.meta, source="captured", temperature=0.0))
    assert simulate(_cfg("asd@fixed:5", n=2, conc=2), trace=greedy).summary["lossy"] is True



def test_a_step_where_every_request_skips_runs_no_target_forward():
    from dspark_sim.sim import cost

    calls: list[int] = []
    real = cost.CostModel.target_time

    def spy(self, batch_tokens):
        calls.append(batch_tokens)
        return real(self, batch_tokens)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cost.CostModel, "target_time", spy)
        res = simulate(_cfg("skip:0.5@fixed:3", n=1, conc=1, lengths="fixed:16:8"),
                       trace=_flat_trace(7, 1.0))
    # the default profile prefills on separate instances (the first token arrives with
    # the request): a skip of 3 drafts with no target call, then a verify of 3 drafts +
    # bonus + the 3 skipped tokens' KV: 1 + 3 + 4 = 8 tokens
    assert res.summary["prefill"] == "disaggregated"
    assert res.summary["engine_steps"] == 2 and res.requests["generated_tokens"][0] == 8
    assert calls == [1 + 3 + 3]


# -- task-score bounds by hand ----------------------------------------------------------
def test_task_score_bounds_by_hand():
    # six simulated requests over four trace requests labelled right/wrong/right/no key
    labels = np.array([1, 0, 1, -1], np.int8)
    trace_row = np.array([0, 1, 2, 3, 0, 2])
    changed = np.array([0, 3, 1, 5, 2, 0])
    finished = np.array([True, True, True, True, True, False])
    out = task_score(changed, finished, trace_row, labels)
    # keyed & finished: requests 0,1,2,4 (labels 1,0,1,1): greedy 3/4; changed among them:
    # 1, 2, 4 -> low keeps only request 0 right: 1/4; high keeps the labels: 3/4
    assert out["task_score_requests"] == 4
    assert out["task_score_greedy"] == 0.75
    assert out["task_score_low"] == 0.25 and out["task_score_high"] == 0.75
    assert out["changed_keyed_fraction"] == 0.75 and out["changed_requests"] == 4
    none = task_score(changed, finished, trace_row, None)
    assert none["task_score_low"] is None and none["changed_requests"] == 4


# -- the synthetic fields -----------------------------------------------------------------
def test_synthetic_fields_are_consistent_with_accept_len():
    t = add_lossy_fields(synth_iid(0.7, 5, num_requests=8, positions=200, seed=2),
                         LossyModel(regret_median=0.3), seed=1)
    r = t.v2.regret()
    m = t.accept_len.astype(np.int64)
    j = np.arange(5)[None]
    assert (r[j < m[:, None]] == 0).all()  # the target's own tokens: no regret
    first = m < 5
    assert (r[first, m[first]] > 0).all()  # the first mismatch always costs
    assert set(np.unique(t.v2.req_correct)) <= {0, 1}
    assert ((t.v2.draft_prob > 0) & (t.v2.draft_prob <= 1)).all()


def test_shipped_trace_serves_the_published_tau_gain(shipped):
    from dspark_sim.validation.lossy import ASD_TAU, served_asd

    strict, _ = served_asd(shipped, None)
    asd, frac = served_asd(shipped, AsdConfig(*lossy.ASD_DEFAULTS))
    assert strict == pytest.approx(ASD_TAU[0], abs=0.03)
    assert asd / strict == pytest.approx(ASD_TAU[1] / ASD_TAU[0], abs=0.005)
    assert 0 < frac < 0.1


# -- specs and bad input ------------------------------------------------------------------
def test_policy_specs_parse_and_sweep_lists_keep_their_commas():
    assert get_policy("asd").name == "asd:0.5,1,8"
    assert get_policy("asd:1,2,inf@fixed:7").name == "asd:1,2,inf@fixed:7"
    assert get_policy("skip@fixed:3").name == "skip:0.9@fixed:3"
    assert parse_list("asd:0.5,1,8,mtp1,skip:0.9@fixed:3") == \
        ["asd:0.5,1,8", "mtp1", "skip:0.9@fixed:3"]
    # the lower ends of the ranges are settings: g = m = B = 0 (strict), P = 0
    assert get_policy("asd:0,0,0@fixed:3").name == "asd:0,0,0@fixed:3"
    assert get_policy("skip:0@fixed:3").name == "skip:0@fixed:3"
    # -0 is 0 (named 'skip:-0', 'asd:-0,0,-0': a policy of its own in a sweep's fronts)
    assert get_policy("skip:-0@fixed:3").name == "skip:0@fixed:3"
    assert get_policy("asd:-0,0,-0@fixed:3").name == "asd:0,0,0@fixed:3"
    for bad in ("asd:1,2", "asd:x,1,1", "asd:-1,1,1", "asd:1,-1,1", "asd:1,1,-1",
                "asd:nan,1,1", "asd:1,1,nan", "skip:x", "skip:-0.5", "skip:nan", "asd@none",
                "skip@asd", "asd@skip:0.9@fixed:3", "skip@ASD :1,1,1@fixed:3",
                # nested lossy bases were built before being refused: one recursion per
                # '@' (a RecursionError past ~300)
                "asd@" * 2000 + "fixed:3", "skip@" * 2000):
        with pytest.raises(InputError, match="--policy"):
            get_policy(bad)


def test_asd_on_a_trace_without_the_fields_is_a_one_line_error():
    trace = synth_iid(0.7, 5, num_requests=4, positions=64, seed=0)
    with pytest.raises(InputError, match="draft_prob|tgt_top1_logit"):
        simulate(_cfg("asd@fixed:5", n=2), trace=trace)


def test_asd_refusal_points_at_a_remedy_that_exists(tmp_path):
    """`run --policy asd` on the default (v1) trace is refused in one line naming the trace;
    the remedy it names must exist: the trace it suggests runs the same command, and any
    `dspark-sim ...` command it suggests is a real one (not, say, `traces synth-lossy`,
    which does not exist)."""
    import re

    from typer.testing import CliRunner

    from dspark_sim.cli import app

    runner = CliRunner()
    small = ["run", "--policy", "asd", "--num-requests", "2", "--replicas", "1",
             "--lengths", "fixed:16:8", "--quiet"]
    r = runner.invoke(app, [*small, "--out", str(tmp_path / "refused")])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert lines[0].startswith("error: builtin:dspark-synthetic: asd needs")
    assert LOSSY_TRACE in lines[0]
    for command in re.findall(r"dspark-sim ([a-z-]+(?: [a-z-]+)?)", lines[0]):
        help_r = runner.invoke(app, [*command.split(), "--help"])
        assert help_r.exit_code == 0, (command, help_r.output)
    assert "traces synth-lossy" not in lines[0]
    r = runner.invoke(app, [*small, "--trace", LOSSY_TRACE, "--out", str(tmp_path / "ok")])
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "ok" / "summary.json").read_text())
    assert s["trace"] == f"builtin:{LOSSY_TRACE}" and s["lossy"] is True
    assert s["policy"].startswith("asd") and s["completed"] == 2


# -- fronts and reports keep the lossy axis apart -----------------------------------------
def _sweep_frame():
    import polars as pl

    from dspark_sim.sim import frontier as fr

    rows = []
    for pol, lossy_flag, lift in (("confidence", False, 0.0), ("asd:0.5,1,8", True, 200.0)):
        for i, x in enumerate((20.0, 40.0, 60.0)):
            rows.append({"policy": pol, "seed": 0, "load_kind": "concurrency",
                         "concurrency": 64 >> i, "qps": None, "mean_concurrency": 1.0 * (64 >> i),
                         "mean_draft_tokens_per_request_step": 3.0, "mean_decode_batch": 8.0,
                         "load": float(64 >> i), fr.X: x, fr.Y: 1000.0 - 10 * x + lift,
                         "stable": True, "lossy": lossy_flag,
                         "changed_token_fraction": 0.03 if lossy_flag else 0.0,
                         "task_score_low": 0.1 if lossy_flag else None,
                         "task_score_high": 0.9 if lossy_flag else None,
                         "mean_verify_tokens_per_request_step": 4.0,
                         "spec_decode_acceptance_length": 4.0, "verification_waste": 0.3,
                         "point_id": f"{pol}-{i}"})
    return pl.DataFrame(rows)


def test_lossless_fronts_never_hold_lossy_points_unless_asked(tmp_path):
    from dspark_sim.sim.frontier import compute_fronts, headline
    from dspark_sim.sim.report import build_report

    df = _sweep_frame()
    assert list(compute_fronts(df)) == ["confidence"]  # the dominating lossy one is left out
    assert list(compute_fronts(df, lossy=True)) == ["asd:0.5,1,8"]
    assert set(compute_fronts(df, lossy=None)) == {"confidence", "asd:0.5,1,8"}
    # naming it as the candidate asks for it: 1000 - 10 x + 200 at x = 20, 40, 60
    h = headline(df, candidate="asd:0.5,1,8", baseline="confidence")
    assert h[0]["candidate_front"].y.tolist() == pytest.approx([1000.0, 800.0, 600.0])
    assert h[0]["baseline_front"].y.tolist() == pytest.approx([800.0, 600.0, 400.0])
    out = build_report(df, tmp_path / "r.html", candidate="confidence", baseline="confidence")
    text = out.read_text()
    assert "Lossy axis" in text and "LOSSY asd:0.5,1,8" in text and "diamond" in text
    assert "Lossy axis" not in build_report(df.filter(~df["lossy"]), tmp_path / "l.html",
                                            candidate="confidence",
                                            baseline="confidence").read_text()


# -- from the command line, on the shipped trace -------------------------------------------
def _by_hand_quality(out, trace) -> dict:
    """The quality figures recomputed from requests.parquet and the trace's labels."""
    import polars as pl

    req = pl.read_parquet(out / "requests.parquet")
    changed = req["changed_tokens"].to_numpy() > 0
    fin = req["finished"].to_numpy()
    label = trace.v2.req_correct[req["trace_row"].to_numpy()]
    keyed = fin & (label >= 0)
    return {"changed_tokens": int(req["changed_tokens"].sum()),
            "changed_token_fraction": req["changed_tokens"].sum() / req["generated_tokens"].sum(),
            "changed_requests": int((changed & fin).sum()),
            "task_score_requests": int(keyed.sum()),
            "task_score_greedy": float(((label == 1) & keyed).sum() / keyed.sum()),
            "task_score_low": float(((label == 1) & keyed & ~changed).sum() / keyed.sum())}


def test_cli_run_and_sweep_report_the_quality_cost(shipped, tmp_path):
    """asd/skip end to end: `run` and `sweep` on the shipped trace, the
    quality cost in summary.json, the printed table and the report, lossy points apart."""
    import polars as pl
    from typer.testing import CliRunner

    from dspark_sim.cli import app

    runner = CliRunner()
    small = ["--trace", LOSSY_TRACE, "--max-concurrency", "4", "--num-requests", "24",
             "--replicas", "1", "--lengths", "fixed:64:128"]
    for spec in ("asd:2,2,inf@fixed:7", "skip:0.5@fixed:7"):
        out = tmp_path / spec.partition(":")[0]
        r = runner.invoke(app, ["run", "--policy", spec, *small, "--out", str(out)])
        assert r.exit_code == 0, r.output
        assert "LOSSY" in r.output and "task score" in r.output
        s = json.loads((out / "summary.json").read_text())
        assert s["lossy"] is True and s["policy"] == spec
        want = _by_hand_quality(out, shipped)
        assert want["changed_tokens"] > 0  # generous settings: the quality cost is not vacuous
        for k, v in want.items():
            assert s[k] == pytest.approx(v, rel=1e-12), k
        assert s["task_score_low"] < s["task_score_high"] == s["task_score_greedy"]
    assert s["verifier_skipped_request_steps"] > 0 and s["verifier_call_fraction"] < 1
    # a lossless run carries no quality keys and no LOSSY rows
    r = runner.invoke(app, ["run", "--policy", "fixed:7", *small, "--out", str(tmp_path / "f")])
    assert r.exit_code == 0 and "LOSSY" not in r.output
    assert "task_score_low" not in json.loads((tmp_path / "f" / "summary.json").read_text())

    out = tmp_path / "sw"
    r = runner.invoke(app, ["sweep", "--out", str(out), "--policies",
                            "fixed:7,asd:2,2,inf@fixed:7,skip:0.5@fixed:7", "--traces",
                            LOSSY_TRACE, "--concurrency", "2,8", "--num-requests", "24",
                            "--replicas", "1", "--lengths", "fixed:64:128",
                            "--executor", "serial", "--baseline", "fixed:7",
                            "--candidate", "fixed:7", "--quiet"])
    assert r.exit_code == 0, r.output
    df = pl.read_parquet(out / "results.parquet")
    assert df.height == 6
    lossy_rows = df.filter(pl.col("lossy"))
    assert set(lossy_rows["policy"]) == {"asd:2,2,inf@fixed:7", "skip:0.5@fixed:7"}
    assert (lossy_rows["changed_token_fraction"] > 0).all()
    assert lossy_rows["task_score_low"].is_not_null().all()
    html = (out / "report.html").read_text()
    assert "Lossy axis" in html and "LOSSY asd:2,2,inf@fixed:7" in html
    assert "LOSSY skip:0.5@fixed:7" in html and "LOSSY fixed:7" not in html


# -- docs/related-work.md: the lossy section quotes its bench table --------------------------
def test_related_work_lossy_prose_quotes_its_table():
    """The lossy section's simulator numbers are the `lossy_related` block's rows (written by
    benchmarks/lossy_related.py --doc), recomputed here; the papers' figures sit beside."""
    import re
    from pathlib import Path

    doc = Path(__file__).resolve().parents[2] / "docs" / "related-work.md"
    text = doc.read_text()
    m = re.search(r"<!-- bench: lossy_related (\S+) -->\n<!-- (python benchmarks/"
                  r"lossy_related.py[^>]*) -->\n(.*?)\n<!-- /bench -->", text, re.S)
    assert m is not None
    lines = m[3].splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {r["policy"].strip("`"): r for r in
            (dict(zip(head, (c.strip() for c in ln.strip("|").split("|")), strict=True))
             for ln in lines[2:])}
    prose = " ".join(text.split())
    strict, asd = rows["fixed:7"], rows["asd@fixed:7"]
    t0, t1 = float(strict["τ"]), float(asd["τ"])
    assert "τ 4.65 → 4.93" in prose and "−0.8 pp accuracy" in prose
    assert f"{t0:.3f} → {t1:.3f} ({100 * (t1 / t0 - 1):+.1f} %)" in prose
    assert (f"{strict['output tok/s']} → {asd['output tok/s']} "
            f"({asd['Δ tok/s'].replace('%', ' %')})") in prose
    assert f"{asd['task score bounds']} ({asd['changed tokens']} of tokens changed)" in prose
    # the skip settings whose saving falls in the paper's 9.6-13.5 % are the ones quoted
    near = [p for p, r in rows.items() if p.startswith("skip:")
            and 0.096 <= float(r["fewer calls"].rstrip("%")) / 100 <= 0.135]
    assert near
    for p in near:
        r = rows[p]
        assert (f"`{p}`: {r['fewer calls'].replace('%', ' %')} fewer calls, "
                f"{r['changed tokens']} of tokens changed in {r['requests changed']} requests, "
                f"task-score bounds {r['task score bounds']}") in prose
