"""The engine's hook for tree and lossy policies: a policy returns a Verification and
replays it against the trace's ground truth (accepted drafts, changed tokens, the bonus,
per-request state). Checked with toy policies whose outcome is known by hand."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from dspark_sim.policies.base import Replayed, Verification
from dspark_sim.policies.registry import Policy, Reads, get_policy
from dspark_sim.sim import api
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import DeploymentConfig, SimConfig, WorkloadConfig
from dspark_sim.traces.synth import synth_iid

K = 3


def _cfg(n: int = 40) -> SimConfig:
    return SimConfig(policy="fixed:3", deployment=DeploymentConfig(replicas=1),
                     workload=WorkloadConfig(arrival="closed", max_concurrency=8,
                                             num_requests=n, lengths="fixed:64:96"))


def _run(policy: Policy, cfg: SimConfig, trace):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(api, "get_policy", lambda spec: policy)
        return simulate(cfg, trace=trace)


def _plan_policy(replay, *, tokens=K, lossy=False, uses_state=False, bonus=True) -> Policy:
    base = get_policy("fixed:3")
    return replace(base, name="toy", decide=lambda s: Verification(
        np.full(s.num_requests, tokens, dtype=np.int64)), replay=replay, lossy=lossy,
        reads=Reads(state=uses_state))


def test_a_chain_written_as_a_plan_replays_like_the_chain():
    trace = synth_iid(0.7, 7, num_requests=16, positions=256, seed=3)
    cfg = _cfg()
    chain = simulate(cfg, trace=trace).summary
    plan = _run(_plan_policy(lambda p, v: Replayed(np.minimum(p.tokens, v.accept_len))),
                cfg, trace).summary
    for key in ("engine_steps", "num_accepted_tokens", "num_draft_tokens_verified",
                "total_output_tokens", "duration", "changed_tokens"):
        assert plan[key] == chain[key], key
    assert chain["changed_tokens"] == 0 and plan["lossy"] is False


def test_lossy_accept_all_counts_the_changed_tokens():
    """Accept all K drafts whatever the target says: the ones past the target's run m are
    changed tokens; every step emits K + 1 (cut at the output length)."""
    trace = synth_iid(0.5, 7, num_requests=16, positions=256, seed=4)
    cfg = _cfg(24)

    def replay(p, v):
        return Replayed(p.tokens.copy(), changed=np.maximum(p.tokens - v.accept_len, 0))

    res = _run(_plan_policy(replay, lossy=True), cfg, trace)
    s, r = res.summary, res.requests
    out = 96
    # prefill emits 1, then ceil(95 / 4) = 24 steps of K + 1 = 4 (the last cut to 3)
    assert (r["steps"] == 24).all() and (r["generated_tokens"] == out).all()
    assert s["num_accepted_tokens"] == 24 * 24 * K
    assert 0 < s["changed_tokens"] == int(r["changed_tokens"].sum())
    assert s["changed_token_fraction"] == pytest.approx(s["changed_tokens"] / (24 * out))
    # on an i.i.d. 0.5 trace the k-th draft is past the target's run with P(m < k) =
    # 1 - 0.5^k: E[changed per step] = 0.5 + 0.75 + 0.875 = 2.125 (the last, cut step
    # counts at most the 3 it emits, so slightly less)
    assert s["changed_tokens"] / (24 * 24) == pytest.approx(2.125, abs=0.08)


def test_skipping_the_verifier_emits_no_bonus_and_costs_no_verify_tokens():
    trace = synth_iid(0.9, 7, num_requests=8, positions=256, seed=5)
    cfg = _cfg(8)

    def replay(p, v):
        n = len(p.tokens)
        return Replayed(np.full(n, 2), changed=np.maximum(2 - v.accept_len, 0),
                        bonus=np.zeros(n, bool))

    s = _run(_plan_policy(replay, tokens=0, lossy=True), cfg, trace).summary
    # a skipping row takes no bonus slot either: no verify tokens at all (the target
    # never runs); 2 tokens per request-step, none of them judged by the verifier
    assert s["mean_verify_tokens_per_request_step"] == 0.0 and s["mean_batch_tokens"] == 0.0
    assert s["num_accepted_tokens"] == 0 and s["num_draft_tokens_verified"] == 0
    assert s["num_unverified_tokens"] == 2 * s["num_drafts"]
    assert s["spec_decode_acceptance_length"] == 3.0
    assert s["total_output_tokens"] == 8 * 96


def test_per_request_state_carries_across_steps():
    """ASD-like budget: a request may commit at most B accepted drafts in all."""
    trace = synth_iid(1.0, 7, num_requests=8, positions=256, seed=6)
    budget = 10

    def replay(p, v):
        left = np.maximum(budget - v.state, 0).astype(np.int64)
        acc = np.minimum(p.tokens, left)
        return Replayed(acc, state=v.state + acc)

    res = _run(_plan_policy(replay, uses_state=True), _cfg(16), trace)
    assert (res.requests["accepted_tokens"] == budget).all()


def test_a_replay_that_emits_more_than_it_verified_is_an_error():
    trace = synth_iid(0.5, 7, num_requests=8, positions=64, seed=7)
    bad = _plan_policy(lambda p, v: Replayed(p.tokens + 1))
    with pytest.raises(RuntimeError, match="replay accepted outside"):
        _run(bad, _cfg(4), trace)


def test_same_seed_same_bytes_for_a_plan_policy():
    trace = synth_iid(0.6, 7, num_requests=16, positions=128, seed=8)
    pol = _plan_policy(lambda p, v: Replayed(np.minimum(p.tokens, v.accept_len)))
    a = _run(pol, _cfg(30), trace).summary
    b = _run(pol, _cfg(30), trace).summary
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
