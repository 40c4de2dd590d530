"""The simulator core against analytic results, conservation laws and determinism."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from dspark_sim.calibration.profile import DraftCost, EngineProfile, load_profile
from dspark_sim.errors import InputError
from dspark_sim.policies.registry import Policy, get_policy
from dspark_sim.sim import api
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import DeploymentConfig, EngineConfig, SimConfig, WorkloadConfig
from dspark_sim.traces.synth import synth_iid

POLICIES = ["none", "mtp1", "fixed:3", "confidence", "confidence-async", "threshold:0.4"]


@pytest.mark.parametrize("alpha,k", [(0.6, 1), (0.8, 3), (0.9, 5)])
def test_iid_fixed_k_matches_leviathan(alpha, k):
    """E[tokens/step] = (1 - alpha^(k+1)) / (1 - alpha) at light load."""
    trace = synth_iid(alpha, 7, num_requests=32, positions=512, seed=1)
    cfg = SimConfig(
        policy=f"fixed:{k}",
        deployment=DeploymentConfig(replicas=1),
        workload=WorkloadConfig(qps=2.0, num_requests=60, lengths="fixed:64:400"),
    )
    s = simulate(cfg, trace=trace).summary
    expected = (1 - alpha ** (k + 1)) / (1 - alpha)
    assert s["num_drafts"] > 5000
    assert s["spec_decode_acceptance_length"] == pytest.approx(expected, rel=0.02)
    # every verified request-step verified exactly k draft tokens (light load, no budget cap)
    assert s["mean_draft_tokens_per_request_step"] == pytest.approx(k)
    # vLLM's unconditional per-position acceptance is alpha^j for iid tokens
    for j, p in enumerate(s["acceptance_per_position"][:k], start=1):
        assert p == pytest.approx(alpha**j, abs=0.02)


@pytest.mark.parametrize("policy", POLICIES)
def test_conservation(tiny_cfg, policy):
    res = simulate(replace(tiny_cfg, policy=policy))
    s, r = res.summary, res.requests
    assert s["completed"] + s["unfinished"] == s["num_requests"] == r.height
    assert s["unfinished"] == 0 and s["stable"]
    fin = r.filter(r["finished"])
    assert (fin["generated_tokens"] == fin["output_tokens"]).all()
    assert s["total_output_tokens"] == int(fin["output_tokens"].sum())
    gamma = s["trace_gamma_max"] or 0
    if policy.startswith("fixed:"):
        gamma = int(policy.split(":")[1])
    elif policy == "mtp1":
        gamma = 1
    acc, ver, steps = fin["accepted_tokens"], fin["draft_tokens_verified"], fin["steps"]
    # per request: accepted <= verified <= gamma per step
    assert (acc <= ver).all() and (ver <= gamma * steps).all()
    # each decode step emits accepted + 1 tokens, of which only the last step's may be cut
    # (by at most gamma), and the step that completes prefill emits the first token
    gen, pre = fin["generated_tokens"], fin["preemptions"]
    assert (gen <= 1 + pre + acc + steps).all()
    assert (gen >= 1 + acc + steps - gamma).all()
    # per-request totals add up to the summary's
    assert int(acc.sum()) == s["num_accepted_tokens"]
    assert int(ver.sum()) == s["num_draft_tokens_verified"]
    assert int(steps.sum()) == s["num_drafts"]
    assert (fin["ttft_ms"] > 0).all() and (fin["e2e_ms"] >= fin["ttft_ms"]).all()


def test_the_step_series_is_kept_only_when_asked(tiny_cfg):
    """keep_steps puts the engine's per-step series on the result: its steps add up to
    the summary's decode steps and tokens, and a run without it keeps none."""
    cfg = replace(tiny_cfg, policy="fixed:3", engine=EngineConfig(prefill="chunked"))
    assert simulate(cfg).steps is None
    res = simulate(cfg, keep_steps=True)
    steps, s = res.steps, res.summary
    assert len(steps) > 0 and (steps.dt_s > 0).all()
    assert np.all(np.diff(steps.end_s) >= 0)
    assert int(steps.verified_drafts.sum()) == s["num_draft_tokens_verified"]
    assert int(steps.decode_batch.sum()) == s["num_drafts"]
    assert int(steps.prefill_tokens.sum()) == int(res.requests["prompt_tokens"].sum())


def test_unfinished_reported_when_overloaded():
    cfg = SimConfig(
        policy="none",
        deployment=DeploymentConfig(replicas=1),
        engine=EngineConfig(max_num_seqs=8),
        workload=WorkloadConfig(qps=200.0, num_requests=600, lengths="fixed:256:256"),
        drain_timeout_s=2.0,
    )
    s = simulate(cfg).summary
    assert s["unfinished"] > 0
    assert s["completed"] + s["unfinished"] == 600
    assert not s["stable"]


def test_same_seed_same_bytes(tmp_path, tiny_cfg):
    a = simulate(tiny_cfg).write(tmp_path / "a")
    b = simulate(tiny_cfg).write(tmp_path / "b")
    c = simulate(replace(tiny_cfg, seed=1)).write(tmp_path / "c")
    sa = (a / "summary.json").read_bytes()
    assert sa == (b / "summary.json").read_bytes()
    assert sa != (c / "summary.json").read_bytes()
    assert (a / "requests.parquet").read_bytes() == (b / "requests.parquet").read_bytes()
    assert json.loads(sa)["completed"] == 150


@pytest.mark.parametrize(
    "workload",
    [
        WorkloadConfig(arrival="poisson", qps=20.0, num_requests=100),
        WorkloadConfig(arrival="gamma", qps=20.0, burstiness=0.3, num_requests=100),
        WorkloadConfig(arrival="closed", max_concurrency=16, num_requests=100),
        WorkloadConfig(qps=50.0, duration_s=3.0, num_requests=None),
    ],
    ids=["poisson", "gamma", "closed", "duration"],
)
def test_arrival_kinds(workload):
    cfg = SimConfig(deployment=DeploymentConfig(replicas=2), workload=workload)
    res = simulate(cfg)
    s = res.summary
    assert s["completed"] == s["num_requests"] > 0
    arr = res.requests["arrival_s"].to_numpy()
    assert np.all(np.diff(arr) >= 0) or workload.arrival == "closed"
    if workload.arrival == "closed":
        # never more than max_concurrency requests in flight
        r = res.requests.sort("arrival_s")
        starts = r["arrival_s"].to_numpy()
        ends = starts + r["e2e_ms"].to_numpy() / 1e3
        # in flight just after each submission (a finish and the next submission
        # happen at the same instant; allow for the ms round trip)
        live = [(starts <= x).sum() - (ends <= x + 1e-9).sum() for x in starts]
        assert max(live) <= 16
    if workload.duration_s is not None:
        assert arr.max() < 3.0


def test_burstiness_raises_tail_latency():
    # chunked prefill: arrivals queue for the replica's prefill (disaggregated prefill
    # instances are not queued in the model)
    base = SimConfig(policy="mtp1", deployment=DeploymentConfig(replicas=1),
                     engine=EngineConfig(prefill="chunked"),
                     workload=WorkloadConfig(qps=40.0, num_requests=600, lengths="fixed:512:64"))
    smooth = simulate(base).summary
    bursty = simulate(replace(base, workload=replace(base.workload, arrival="gamma",
                                                     burstiness=0.1))).summary
    assert bursty["p99_ttft_ms"] > smooth["p99_ttft_ms"]


def test_kv_pressure_preempts_and_reserve_holds_back():
    wl = WorkloadConfig(arrival="closed", max_concurrency=32, num_requests=96,
                        lengths="fixed:512:256")
    cfg = SimConfig(policy="fixed:3", deployment=DeploymentConfig(replicas=1),
                    engine=EngineConfig(kv_capacity_tokens=8000), workload=wl)
    pre = simulate(cfg).summary
    assert pre["preemptions"] > 0 and pre["completed"] == 96
    held = simulate(replace(cfg, engine=replace(cfg.engine, kv_mode="reserve"))).summary
    assert held["preemptions"] == 0 and held["completed"] == 96
    assert held["kv_blocked_steps"] > 0  # holding back is counted too
    # reserving prompt + full output (512 + 256) in 8000 tokens admits at most 10 at a
    # time; optimistic admission runs bigger batches (and pays for it in preemptions)
    assert held["mean_decode_batch"] <= 8000 // (512 + 256)
    assert held["mean_decode_batch"] < pre["mean_decode_batch"]


def test_over_verification_delays_prefill():
    """Verify tokens share max_num_batched_tokens with chunked prefill."""
    wl = WorkloadConfig(arrival="closed", max_concurrency=200, num_requests=600,
                        lengths="fixed:512:256")
    base = SimConfig(deployment=DeploymentConfig(replicas=1),
                     engine=EngineConfig(max_num_batched_tokens=1024, max_num_seqs=200,
                                         prefill="chunked"),
                     workload=wl)
    one = simulate(replace(base, policy="fixed:1")).summary
    seven = simulate(replace(base, policy="fixed:7")).summary
    # 8 verify tokens per request leave little of the 1024-token budget for prefill
    assert seven["median_ttft_ms"] > 2 * one["median_ttft_ms"]
    assert seven["mean_batch_tokens"] <= 1024 and one["mean_batch_tokens"] <= 1024


def test_routers_spread_load():
    wl = WorkloadConfig(qps=80.0, num_requests=400)
    for router in ("round-robin", "least-outstanding"):
        cfg = SimConfig(deployment=DeploymentConfig(replicas=4, router=router), workload=wl)
        counts = np.bincount(simulate(cfg).requests["replica"].to_numpy(), minlength=4)
        assert counts.min() > 60, (router, counts)
    rr = SimConfig(deployment=DeploymentConfig(replicas=4, router="round-robin"), workload=wl)
    assert np.array_equal(np.bincount(simulate(rr).requests["replica"].to_numpy()), [100] * 4)


def _smooth_profile() -> EngineProfile:
    """Concave-free, smooth SPS(B): memory-bound then compute-bound, linear interpolation."""
    b = np.arange(1, 8193, dtype=np.int64)
    step = 0.012 + 0.004 * np.log1p(b / 64.0) + np.maximum(0, b - 1024) * 4e-6
    base = load_profile()
    return EngineProfile(
        name="smooth", kind="analytic", gpus_per_replica=8, tokens=b, step_s=step,
        interpolation="linear", drafts={"dspark": DraftCost(np.array([1.0, 512.0]),
                                                            np.array([1e-3, 1.5e-3]), 7)}
        | {"mtp1": base.drafts["mtp1"]},
    )


def _sync_global() -> Policy:
    """The default scheduler's search on this step's own survivals (no two-step lag): an
    oracle that knows the drafts before deciding, which a real pipeline cannot."""
    from dspark_sim.policies.scheduler import budget_displacement, schedule_topk

    base = get_policy("confidence")
    return replace(base, name="sync-global",
                   decide=lambda s: schedule_topk(s.survival, budget_displacement(s.survival, s.cost)))


@pytest.mark.parametrize("concurrency", [4, 64, 384])
def test_confidence_at_least_as_good_as_the_best_fixed_k_on_smooth_profile(concurrency):
    """Deterministic runs, so no slack for noise. On a smooth SPS curve the scheduler's
    search on the step's own survivals (which could always pick a fixed length) does at
    least as well as the best fixed verify length k = 1..7; the default, whose budget is
    sized on survivals two steps old (the production pipeline), is never beaten on both
    throughput and interactivity by more than 3 % (benchmarks/static_dominance.py's contract)."""
    prof = _smooth_profile()
    wl = WorkloadConfig(arrival="closed", max_concurrency=concurrency,
                        num_requests=max(3 * concurrency, 60), lengths="fixed:256:192")
    base = SimConfig(deployment=DeploymentConfig(replicas=1),
                     engine=EngineConfig(max_num_seqs=384), workload=wl)
    res = {}
    for pol in [f"fixed:{k}" for k in range(1, 8)] + ["confidence"]:
        res[pol] = simulate(replace(base, policy=pol), profile=prof).summary
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(api, "get_policy", lambda spec: _sync_global())
        res["sync-global"] = simulate(replace(base, policy="confidence"), profile=prof).summary
    thr = {k: s["output_throughput"] for k, s in res.items()}
    best_fixed = max(v for k, v in thr.items() if k.startswith("fixed"))
    assert thr["sync-global"] >= best_fixed, thr
    conf = res["confidence"]
    for k in range(1, 8):
        s = res[f"fixed:{k}"]
        assert not (s["output_throughput"] > 1.03 * conf["output_throughput"]
                    and s["median_interactivity"] > 1.03 * conf["median_interactivity"]), k


@pytest.mark.parametrize("prefill", ["chunked", "disaggregated"])
def test_incremental_aggregates_stay_exact(prefill):
    """The replica's running KV / prefill counters equal their definitions every step
    (disaggregated: requests arrive with their prompt's KV and first token)."""
    from dspark_sim.sim import engine

    checked = []
    orig = engine.Replica._admit

    def admit_and_check(self):
        self.check_invariants()
        orig(self)
        self.check_invariants()
        checked.append(1)

    engine.Replica._admit = admit_and_check
    try:
        wl = WorkloadConfig(arrival="closed", max_concurrency=24, num_requests=80,
                            lengths="lognormal:600:120:0.7")
        cfg = SimConfig(policy="confidence", deployment=DeploymentConfig(replicas=2),
                        engine=EngineConfig(kv_capacity_tokens=9000, prefill=prefill,
                                            max_num_batched_tokens=512), workload=wl)
        s = simulate(cfg).summary
    finally:
        engine.Replica._admit = orig
    assert len(checked) > 100 and s["preemptions"] > 0 and s["completed"] == 80


def test_step_cost_is_exact_table_lookup_plus_logit_rows():
    """One request, a flat 10 ms table, 1 ms per logit row, no draft cost: the prefill
    step computes 1 logit row, each of the 10 decode steps verifies 1 + 3 rows."""
    from dspark_sim.calibration.profile import DraftCost, EngineProfile

    prof = EngineProfile(
        name="flat", kind="measured", gpus_per_replica=1,
        tokens=np.array([1, 8192]), step_s=np.array([0.010, 0.010]), interpolation="step",
        logits_s_per_row=0.001,
        drafts={"dspark": DraftCost(np.array([1.0, 2.0]), np.array([0.0, 0.0]), 7)},
    )
    trace = synth_iid(0.0, 7, num_requests=2, positions=64)  # nothing is ever accepted
    cfg = SimConfig(policy="fixed:3", deployment=DeploymentConfig(replicas=1),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=1, num_requests=1,
                                            lengths="fixed:10:11"))
    r = simulate(cfg, profile=prof, trace=trace)
    s = r.summary
    assert s["engine_steps"] == 11
    assert r.requests["ttft_ms"][0] == pytest.approx(10 + 1)
    assert r.requests["e2e_ms"][0] == pytest.approx(11 * 10 + 1 + 10 * 4)
    # attention work: the 10-token prefill chunk is 10 x (0 + 10/2) = 50 units, decode
    # step k verifies 4 tokens over a context of 10 + k: sum 4 (10 + k) = 620 units
    prof2 = replace(prof, attn_s_per_query_ctx=1e-5)
    r2 = simulate(cfg, profile=prof2, trace=trace)
    assert r2.requests["ttft_ms"][0] == pytest.approx(11 + 0.5)
    assert r2.requests["e2e_ms"][0] == pytest.approx(151 + 6.7)
    # per-request cost: each of the 10 decode steps has one request with a context (the
    # prefill from position 0 has none); multi-token KV: each decode step verifies 3
    # drafts over a context of 10 + k, k = 1..10: 155 tokens in all (the prefill: 0)
    prof3 = replace(prof, request_s=2e-3, multi_kv_s_per_token=1e-4)
    r3 = simulate(cfg, profile=prof3, trace=trace)
    assert r3.requests["ttft_ms"][0] == pytest.approx(11)
    assert r3.requests["e2e_ms"][0] == pytest.approx(151 + 10 * 2 + 15.5)
    # a request verifying no drafts (policy none) is not a multi-token block
    cfg0 = replace(cfg, policy="none")
    r0 = simulate(cfg0, profile=prof3, trace=trace)
    base0 = simulate(cfg0, profile=prof, trace=trace)
    assert r0.requests["e2e_ms"][0] == pytest.approx(base0.requests["e2e_ms"][0] + 10 * 2)
    # KV reads: the target reads every KV token held (2e-4 s each), the drafter its own
    # context (1e-4 s each, [draft.dspark] kv_s_per_token). Decode step k starts holding
    # 10 + k tokens (prompt, first token, k - 1 emitted), 155 in all: + 31 + 15.5 ms.
    # The prefill step holds none yet, and drafts nothing.
    prof4 = replace(prof, kv_s_per_token=2e-4, drafts={"dspark": DraftCost(
        np.array([1.0, 2.0]), np.array([0.0, 0.0]), 7, kv_s_per_token=1e-4)})
    r4 = simulate(cfg, profile=prof4, trace=trace)
    assert r4.requests["ttft_ms"][0] == pytest.approx(11)
    assert r4.requests["e2e_ms"][0] == pytest.approx(151 + 31 + 15.5)


def test_extrapolation_past_a_noisy_table_never_goes_negative():
    from dspark_sim.calibration.profile import EngineProfile

    prof = EngineProfile(name="noisy", kind="measured", gpus_per_replica=1,
                         tokens=np.array([1, 32, 64]), step_s=np.array([0.010, 0.030, 0.020]))
    t = prof.target_time_s(np.array([64, 1000, 8192]))
    assert np.all(t >= 0.020 - 1e-12)
    s = simulate(SimConfig(policy="none", deployment=DeploymentConfig(replicas=1),
                           workload=WorkloadConfig(qps=5.0, num_requests=20,
                                                   lengths="fixed:3000:8")),
                 profile=prof).summary
    assert s["completed"] == 20 and s["mean_step_ms"] > 0


def test_policy_profile_drives_the_scheduler_not_the_step_cost():
    """``policy_profile``: the confidence scheduler's SPS curve comes from it, the steps
    cost ``profile``. Same profile given twice = byte-identical to the default; a
    scheduler that believes verification is free verifies more and, on a profile where
    it is not, the steps get longer."""
    from dspark_sim.calibration.profile import load_profile

    cfg = SimConfig(policy="confidence", deployment=DeploymentConfig(replicas=1),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=32,
                                            num_requests=120, lengths="fixed:200:64"))
    prof = load_profile("v4flash-h200")
    a = simulate(cfg, profile=prof).summary
    b = simulate(cfg, profile=prof, policy_profile=prof).summary
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    # an equal copy takes the separate-profile path (its own tables): the same bytes too,
    # also where the priced steps reach the token budget (the table's last entry: 32
    # requests x (1 + 7) tokens > 128); the summary names the policy profile it was given
    copy = simulate(cfg, profile=prof, policy_profile=replace(prof)).summary
    assert copy.pop("policy_profile") == "v4flash-h200" and "policy_profile" not in a
    assert json.dumps(a, sort_keys=True) == json.dumps(copy, sort_keys=True)
    tight = replace(cfg, engine=EngineConfig(max_num_batched_tokens=128, max_num_seqs=32))
    own = simulate(tight, profile=prof).summary
    priced = simulate(tight, profile=prof, policy_profile=replace(prof)).summary
    assert priced.pop("policy_profile") == "v4flash-h200"
    assert json.dumps(own, sort_keys=True) == json.dumps(priced, sort_keys=True)
    flat = replace(prof, step_s=np.full_like(prof.step_s, prof.step_s[0]))  # B costs nothing
    c = simulate(cfg, profile=prof, policy_profile=flat).summary
    assert c["mean_verify_tokens_per_request_step"] > a["mean_verify_tokens_per_request_step"]
    assert c["mean_step_ms"] > a["mean_step_ms"]


def test_async_scheduler_is_fed_the_two_steps_old_snapshot(monkeypatch):
    """§5.2: confidence-async sizes its budget from the survivals and SPS curve of two
    decisions ago. Recorded snapshots: the lagged fields at decision t are exactly the
    current fields of decision t - 2 (not t - 1, not t), and in this run the three differ
    often enough that feeding the wrong one would change the budget."""
    from dspark_sim.policies.scheduler import budget_global
    from dspark_sim.sim import api

    inner = api.get_policy("confidence-async")
    seen = []

    def decide(snap):
        seen.append(snap)
        return inner(snap)

    pol = replace(inner, decide=decide)
    monkeypatch.setattr(api, "get_policy", lambda spec: pol)
    cfg = SimConfig(policy="confidence-async", deployment=DeploymentConfig(replicas=1),
                    workload=WorkloadConfig(qps=30.0, num_requests=40,
                                            lengths="lognormal:300:30:0.8"))
    simulate(cfg)
    assert len(seen) > 50
    assert seen[0].lagged_survival is None and seen[1].lagged_survival is None
    differs = 0
    for t in range(2, len(seen)):
        lag, old, prev, cur = seen[t], seen[t - 2], seen[t - 1], seen[t]
        assert np.array_equal(lag.lagged_survival, old.survival), t
        assert np.array_equal(lag.lagged_sps, old.sps), t
        k_old = budget_global(old.survival, old.sps)
        others = {budget_global(prev.survival, prev.sps), budget_global(cur.survival, cur.sps)}
        differs += k_old not in others
    assert differs >= 5, differs


@pytest.mark.parametrize("k", [1, 3, 7])
def test_engine_serves_the_traces_served_tau_exactly(k):
    """Two implementations of one chain: the engine replaying each trace request once
    (request i pinned to row i, output = the row's positions + the prefill token) and
    the trace's own fixed-k chain (AcceptanceTrace.served_tau) must agree exactly on
    tokens per verify step, per request and pooled."""
    from dspark_sim.traces.schema import load_trace

    full = load_trace("dspark-synthetic").select_domain("chat")
    trace = replace(full, req_offsets=full.req_offsets[:13], req_domain=full.req_domain[:12],
                    req_ids=full.req_ids[:12])
    positions = int(trace.req_lengths[0])
    assert np.all(trace.req_lengths == positions)
    n = trace.num_requests
    cfg = SimConfig(policy=f"fixed:{k}", deployment=DeploymentConfig(replicas=1),
                    engine=EngineConfig(prefill="chunked"),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=4, num_requests=n,
                                            lengths=f"fixed:64:{positions + 1}"))
    res = simulate(cfg, trace=trace, trace_rows=np.arange(n))
    s, r = res.summary, res.requests
    assert s["completed"] == n and s["budget_limited_steps"] == 0
    tokens, steps = trace.served_tau_per_request(k)
    np.testing.assert_array_equal(r["steps"].to_numpy(), steps)
    np.testing.assert_array_equal(r["accepted_tokens"].to_numpy() + r["steps"].to_numpy(),
                                  tokens)
    assert s["spec_decode_acceptance_length"] == pytest.approx(trace.served_tau(k), rel=1e-12)


@pytest.mark.parametrize("rows", [
    [0, 1], [[0, 1, 2]], [-1, 0, 0], [0, 0, 4],  # shape and range
    [0.0, 1.7, 2.0], [True, False, True], ["0", "1", "2"],  # cast: 1.7 ran row 1
    [0, float("nan"), 1], [0, 0, 2**70], [None, 0, 1],  # cast: tracebacks
])
def test_pinned_trace_rows_must_be_integer_indices_into_the_trace(rows):
    trace = synth_iid(0.8, 5, num_requests=4, positions=64)
    cfg = SimConfig(policy="fixed:3", deployment=DeploymentConfig(replicas=1),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=3, num_requests=3,
                                            lengths="fixed:10:20"))
    with pytest.raises(InputError, match=r"^trace_rows: need 3 integer row indices in \[0, 4\)"):
        simulate(cfg, trace=trace, trace_rows=rows)
    assert simulate(cfg, trace=trace, trace_rows=np.array([0, 3, 3], np.int32)).summary[
        "completed"] == 3


def test_every_request_may_pin_the_one_row_of_a_one_request_trace():
    """Row 0 is inside a trace of one request (the check is row < num_requests); the
    result is a frozen record."""
    import dataclasses

    trace = synth_iid(0.8, 5, num_requests=1, positions=64)
    cfg = SimConfig(policy="fixed:3", deployment=DeploymentConfig(replicas=1),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=3, num_requests=3,
                                            lengths="fixed:10:20"))
    res = simulate(cfg, trace=trace, trace_rows=np.zeros(3, np.int64))
    assert res.summary["completed"] == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.summary = {}


def test_simulate_loads_names_given_for_its_objects_and_refuses_other_types():
    """simulate(cfg, profile='v4flash-h200') (or a trace, calibration or policy profile
    named) was an AttributeError traceback deep in the engine; a name or path now loads as
    the config's does, the same run as the loaded object gives."""
    from dspark_sim.calibration.confmap import load_calibration
    from dspark_sim.traces.schema import load_trace

    cfg = SimConfig(policy="confidence", deployment=DeploymentConfig(replicas=1),
                    workload=WorkloadConfig(qps=20.0, num_requests=20))
    named = simulate(cfg, profile="v4flash-b200", trace="dspark-v4flash-synthetic",
                     calibration="identity", policy_profile="v4flash-h100").summary
    loaded = simulate(cfg, profile=load_profile("v4flash-b200"),
                      trace=load_trace("dspark-v4flash-synthetic"),
                      calibration=load_calibration("identity"),
                      policy_profile=load_profile("v4flash-h100")).summary
    assert named == loaded and named["profile"] == "v4flash-b200"
    assert named != simulate(cfg).summary
    for kw in ({"profile": 5}, {"trace": [1]}, {"calibration": 0.5}, {"policy_profile": {}}):
        with pytest.raises(TypeError, match=f"^simulate: {next(iter(kw))} must be a "):
            simulate(cfg, **kw)
    with pytest.raises(TypeError, match="^simulate: cfg must be a SimConfig"):
        simulate("tiny")


def test_kv_blocked_steps_counted_by_hand():
    """Reserve mode, room for one request (prompt 100 + output 20) at a time, two clients:
    the second is held back at the admission of each of the first's 20 steps (1 prefill,
    19 decode steps of one token under `none`), then admitted; nothing else waits."""
    cfg = SimConfig(policy="none", deployment=DeploymentConfig(replicas=1),
                    engine=EngineConfig(kv_mode="reserve", kv_capacity_tokens=130,
                                        prefill="chunked"),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=2, num_requests=2,
                                            lengths="fixed:100:20"))
    s = simulate(cfg).summary
    assert s["completed"] == 2 and s["engine_steps"] == 40
    assert s["kv_blocked_steps"] == 20 and s["preemptions"] == 0


def test_admission_commits_kv_for_the_verify_slots():
    """Preempt mode admits a request when its prompt plus 1 + gamma verify slots fit:
    fixed:3 on 100-token prompts needs 104 tokens each, so a 200-token cache holds one at a
    time (two would need 208; without the verify slots they would fit in 200)."""
    trace = synth_iid(0.0, 7, num_requests=2, positions=64)
    cfg = SimConfig(policy="fixed:3", deployment=DeploymentConfig(replicas=1),
                    engine=EngineConfig(kv_capacity_tokens=200, prefill="chunked"),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=2, num_requests=2,
                                            lengths="fixed:100:2"))
    res = simulate(cfg, trace=trace, trace_rows=np.arange(2))
    s, r = res.summary, res.requests.sort("request_id")
    assert s["completed"] == 2 and s["kv_blocked_steps"] > 0 and s["preemptions"] == 0
    first_done = r["arrival_s"][0] + r["e2e_ms"][0] / 1e3
    assert r["arrival_s"][1] + r["ttft_ms"][1] / 1e3 > first_done  # prefilled after


def test_sps_curve_by_hand():
    # the one SPS definition (engine and validation server): 2 decoding requests, gamma 2,
    # a budget of 8 tokens, 3 prefill tokens pending, step time = 1 ms + 0.1 ms per token
    from dspark_sim.sim.engine import sps_curve

    table = 1e-3 + 1e-4 * np.arange(9)
    extra = np.full(5, 5e-4)
    # i = 0..4 drafts: verify 2..6 tokens, + 3 prefill -> 5, 6, 7, 8, 8 (capped at the budget)
    got = sps_curve(table, extra, 2, 2, 3, 8, decode_only=False)
    np.testing.assert_allclose(1.0 / got, 1.5e-3 + 1e-4 * np.array([5, 6, 7, 8, 8]))
    np.testing.assert_allclose(1.0 / sps_curve(table, extra, 2, 2, 3, 8, decode_only=True),
                               1.5e-3 + 1e-4 * np.arange(2, 7))
    assert extra.tolist() == [5e-4] * 5  # the caller's extra is not written
    # the budget caps B, not the table's length: entries past it are never read
    longer = np.concatenate([table, [1.0, 1.0]])
    np.testing.assert_array_equal(sps_curve(longer, extra, 2, 2, 3, 8, decode_only=False), got)
    # 3 requests, gamma 3: 12 verify tokens at most, 4 past the budget of 8 -> 0 steps/s
    got = sps_curve(table, np.zeros(10), 3, 3, 0, 8, decode_only=True)
    assert (got[-4:] == 0).all() and (got[:-4] > 0).all()
