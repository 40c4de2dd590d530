"""Long-context self-speculation: the SparseSpec-L controller against a brute force, the
context-dependent draft cost against the profile's numbers by hand, strict validation of
the new profile keys, the long-context length presets and the synthetic entropies."""

from __future__ import annotations

import copy
import tomllib
from dataclasses import replace

import numpy as np
import pytest

from dspark_sim.calibration.profile import load_profile, profile_from_dict
from dspark_sim.errors import InputError
from dspark_sim.policies.base import BatchSnapshot, StepCost, readonly
from dspark_sim.policies.registry import get_policy
from dspark_sim.policies.sparsespec import controller_k

# -- the controller ------------------------------------------------------------------------


def _brute_k(surv: np.ndarray, c_d: float, c_v: np.ndarray) -> int:
    """argmax over k of (n + sum_r sum_{m<=k} prod_{i<=m} p) / (k c_d + c_v[k]), by loops."""
    n, g = surv.shape
    best, best_k = -1.0, 0
    for k in range(g + 1):
        tokens = sum(1.0 + sum(surv[r, m] for m in range(k)) for r in range(n))
        rate = tokens / (k * c_d + c_v[k]) if np.isfinite(c_v[k]) else 0.0
        if rate > best:
            best, best_k = rate, k
    return best_k


@pytest.mark.parametrize("seed", range(60))
def test_controller_k_is_the_brute_force_argmax(seed):
    rng = np.random.default_rng(seed)
    n, g = int(rng.integers(1, 6)), int(rng.integers(1, 9))
    p = rng.uniform(0.0, 1.0, (n, g)) ** rng.uniform(0.1, 2.0)
    surv = np.cumprod(p, axis=1)
    c_d = float(rng.uniform(0.0, 0.02))
    c_v = 0.01 + np.cumsum(rng.uniform(0, 0.005, g + 1))
    if rng.random() < 0.3:
        c_v[int(rng.integers(1, g + 1)):] = np.inf  # past the token budget
    assert controller_k(surv, c_d, c_v) == _brute_k(surv, c_d, c_v)
    # the paper's formula for one sequence and a constant C_v
    row = surv[:1]
    assert controller_k(row, c_d, 0.02) == _brute_k(row, c_d, np.full(g + 1, 0.02))


def test_sparsespec_policy_reads_entropy_and_prices_by_hand():
    rng = np.random.default_rng(3)
    n, g, budget = 5, 4, 64
    h = rng.uniform(0.0, 1.5, (n, g))
    table = 0.02 + 1e-4 * np.arange(budget + 1)
    extra = np.full(n * g + 1, 1e-3)
    cost = StepCost(readonly(table), readonly(extra), 0, 0.0, draft_pass_s=4e-3,
                    draft_fixed_s=5e-4)
    snap = BatchSnapshot(readonly(np.zeros((n, g))), g, budget, cost=cost,
                         fields={"draft_entropy": readonly(h)})
    # C_v(k): the table at n + n k verify tokens plus the extra terms and the fixed draft
    c_v = np.array([table[n + n * k] + 1e-3 + 5e-4 for k in range(g + 1)])
    for t in (1.0, 0.5, 3.0):
        spec = "sparsespec" if t == 1.0 else f"sparsespec:{t:g}"
        ell = get_policy(spec)(snap)
        want = _brute_k(np.cumprod(np.exp(-h / t), axis=1), 4e-3, c_v)
        assert ell.tolist() == [want] * n
    # a pass that costs more than any draft could pay: no drafting at all
    dear = replace(cost, draft_pass_s=10.0)
    assert get_policy("sparsespec:conf")(BatchSnapshot(readonly(np.ones((n, g))), g, budget,
                                                       cost=dear)).tolist() == [0] * n


@pytest.mark.parametrize("bad,message", [("sparsespec:x", "temperature"),
                                         ("sparsespec:0", "temperature"),
                                         ("sparsespec:1000", "temperature"),
                                         ("sparsespec:100.5", "temperature")])
def test_bad_sparsespec_specs(bad, message):
    with pytest.raises(InputError, match="--policy") as e:
        get_policy(bad)
    assert message in str(e.value)


def test_sparsespec_names_and_needs():
    p = get_policy("sparsespec")
    assert (p.name, p.drafter, p.reads.fields, p.stops_drafting) == \
        ("sparsespec", "selfspec", ("draft_entropy",), True)
    assert get_policy("sparsespec:conf").reads.fields == ()
    assert get_policy("sparsespec:2").name == "sparsespec:2"

@pytest.mark.parametrize(("n", "gamma", "budget"), [
    (3, 4, 20), (1, 5, 64), (4, 3, 9), (2, 3, 1),
    (3, 2, 3),  # the budget holds the bonus slots alone: k = 0 only
    (2, 3, 5),  # n + n k = 6 is one past the budget at k = 2
])
def test_verify_cost_by_k_by_hand(n, gamma, budget):
    """C_v(k) is the step with n * k drafts admitted (table at n + n k tokens, the extra
    terms of n k drafts) plus the once-per-step draft cost; inf where n + n k exceeds the
    token budget. A linear table and no pending prefill make it a formula."""
    from dspark_sim.policies.sparsespec import verify_cost_by_k

    table = 0.01 + 1e-3 * np.arange(budget + 1)  # table_s[B] = 10 ms + 1 ms per token
    extra = 2e-4 * np.arange(n * gamma + 1)  # extra_s[i] = 0.2 ms per draft
    cost = StepCost(readonly(table), readonly(extra), 0, 0.0, draft_fixed_s=5e-3)
    want = [0.01 + 1e-3 * (n + n * k) + 2e-4 * n * k + 5e-3 if n + n * k <= budget
            else np.inf for k in range(gamma + 1)]
    assert verify_cost_by_k(cost, n, gamma).tolist() == pytest.approx(want)


def test_entropy_survival_and_the_controller_on_one_request_and_one_draft():
    from dspark_sim.policies.sparsespec import entropy_survival

    h = np.array([[0.5, 0.25, 1.0]])
    # default T = 1: p_i = exp(-H_i), survival = exp(-cumulative H)
    assert entropy_survival(h)[0].tolist() == pytest.approx(np.exp(-np.array([0.5, 0.75, 1.75])))
    assert entropy_survival(h, 2.0)[0].tolist() == pytest.approx(
        np.exp(-np.array([0.25, 0.375, 0.875])))
    # a single request with certain drafts and free draft passes over a flat verify cost
    # verifies all of them; so does one request with one draft (gamma = 1)
    for g in (3, 1):
        cost = StepCost(readonly(np.full(16, 0.01)), readonly(np.zeros(g + 1)), 0, 0.0)
        snap = BatchSnapshot(readonly(np.ones((1, g))), g, 16, cost=cost,
                             fields={"draft_entropy": readonly(np.zeros((1, g)))})
        assert get_policy("sparsespec")(snap).tolist() == [g]
        assert get_policy("sparsespec:conf")(snap).tolist() == [g]
    # the temperature's range is [0.01, 100], both ends in
    assert get_policy("sparsespec:100").name == "sparsespec:100"
    assert get_policy("sparsespec:0.01").name == "sparsespec:0.01"



# -- the context-dependent draft cost ---------------------------------------------------------

SELFSPEC = """
[profile]
name = "t"
[target]
tokens = [1, 4096]
step_ms = [10.0, 50.0]
kv_us_per_token = 0.01
[engine]
max_num_seqs = 64
max_num_batched_tokens = 4096
kv_capacity_tokens = 10000000
max_model_len = 200000
prefill = "disaggregated"
[draft.selfspec]
batch = [1, 64]
time_ms = [8.0, 12.0]
gamma_ref = 1
gamma_slope = 1.0
kv_us_per_token = 0.002
kv_budget_tokens = 1000
sparse_kv_us_per_token = 0.05
select_us_per_context_token = 0.003
"""


def _ctx(policy: str, profile):
    from dspark_sim.sim.api import resolve_calibration
    from dspark_sim.sim.config import DeploymentConfig, SimConfig
    from dspark_sim.sim.engine import SimContext
    from dspark_sim.sim.metrics import RequestLog
    from dspark_sim.traces.schema import load_trace

    cfg = SimConfig(policy=policy, trace="selfspec-synthetic",
                    deployment=DeploymentConfig(replicas=1))
    trace = load_trace("selfspec-synthetic")
    return SimContext(cfg, profile, get_policy(policy), trace, resolve_calibration(cfg, trace),
                      RequestLog.empty(0), lambda k: None)


def test_the_draft_cost_adds_exactly_what_the_profile_says():
    prof = profile_from_dict(tomllib.loads(SELFSPEC), "t.toml")
    d = prof.drafts["selfspec"]
    assert d.kv_budget_tokens == 1000
    assert (d.sparse_kv_s_per_token, d.select_s_per_context_token) == \
        pytest.approx((0.05e-6, 0.003e-6), rel=1e-12)
    context = np.array([500, 3000, 20000])
    kv = 123456
    # fixed:3 drafts 3 tokens per request: the table at 3 requests x (1 + 1 x (3 - 1)),
    # the drafter's KV reads, 3 x min(context, 1000) sparse tokens each, the selection
    table3 = 8.0 + (12.0 - 8.0) * (3 - 1) / 63  # ms, interpolated at 3 requests
    want = (table3 * 3) / 1e3 + 0.002e-6 * kv \
        + 0.05e-6 * 3 * (500 + 1000 + 1000) + 0.003e-6 * (500 + 3000 + 20000)
    ctx = _ctx("fixed:3", prof)
    got = ctx.cost.draft_step_s(context, np.array([3, 3, 3]), kv)
    assert got == pytest.approx(want, rel=1e-12)
    # the stopping controller runs pass j over the requests still drafting at depth j:
    # verify lengths 0, 2, 3 -> passes over 2, 2 and 1 requests; the first request drafts
    # nothing and pays no selection
    ctx = _ctx("sparsespec", prof)
    t = {n: (8.0 + 4.0 * (n - 1) / 63) / 1e3 for n in (1, 2)}
    want = t[2] + t[2] + t[1] + 0.002e-6 * kv + 0.05e-6 * (2 * 1000 + 3 * 1000) \
        + 0.003e-6 * (3000 + 20000)
    got = ctx.cost.draft_step_s(context, np.array([0, 2, 3]), kv)
    assert got == pytest.approx(want, rel=1e-12)
    assert ctx.cost.draft_step_s(context, np.zeros(3, np.int64), kv) == 0.0


def test_the_sparse_term_in_a_whole_run(tiny_cfg):
    """One request whose context always exceeds the KV budget: every step's sparse term is
    K x budget x price, so the runs with and without it differ by exactly that per step."""
    from dspark_sim.sim.api import simulate
    from dspark_sim.sim.config import DeploymentConfig, SimConfig, WorkloadConfig

    data = tomllib.loads(SELFSPEC)
    data["draft"]["selfspec"]["select_us_per_context_token"] = 0.0
    with_sparse = profile_from_dict(data, "a.toml")
    plain = copy.deepcopy(data)
    del plain["draft"]["selfspec"]["sparse_kv_us_per_token"]
    without = profile_from_dict(plain, "b.toml")
    cfg = SimConfig(policy="fixed:3", trace="selfspec-synthetic",
                    deployment=DeploymentConfig(replicas=1),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=1,
                                            num_requests=1, lengths="fixed:5000:200"))
    a = simulate(cfg, profile=with_sparse).summary
    b = simulate(cfg, profile=without).summary
    steps = a["engine_steps"]
    assert steps == b["engine_steps"] > 10
    busy_a = a["mean_step_ms"] * steps
    busy_b = b["mean_step_ms"] * steps
    assert busy_a - busy_b == pytest.approx(steps * 3 * 1000 * 0.05e-3, rel=1e-6)


@pytest.mark.parametrize("edit,message", [
    (("kv_budget_tokens", 0), "kv_budget_tokens"),
    (("kv_budget_tokens", 2.5), "kv_budget_tokens"),
    (("sparse_kv_us_per_token", -1.0), "sparse_kv_us_per_token"),
    (("sparse_kv_us_per_token", "fast"), "sparse_kv_us_per_token"),
    (("select_us_per_context_token", float("nan")), "select_us_per_context_token"),
    (("kv_budget_tokens", None), "needs 'kv_budget_tokens'"),
    (("sparse_kv_us_per_tokens", 1.0), "unknown key(s) sparse_kv_us_per_tokens"),
])
def test_malformed_selfspec_keys_give_one_line_errors(edit, message):
    data = tomllib.loads(SELFSPEC)
    key, value = edit
    if value is None:
        del data["draft"]["selfspec"][key]
    else:
        data["draft"]["selfspec"][key] = value
    with pytest.raises(InputError) as e:
        profile_from_dict(data, "bad.toml")
    text = str(e.value)
    assert "bad.toml [draft.selfspec]" in text and message in text and "\n" not in text


def test_selfspec_profiles_are_current_and_round_trip(tmp_path):
    from dspark_sim.calibration.longctx import selfspec_specs, write_selfspec_profiles

    write_selfspec_profiles(tmp_path)
    for name in selfspec_specs():
        shipped = load_profile(name)
        assert (tmp_path / f"{name}.toml").read_text() == shipped.to_toml()
        d = shipped.drafts["selfspec"]
        assert d.kv_budget_tokens == 2048 and d.sparse_kv_s_per_token > 0
        assert not d.block and d.gamma_ref == 1 and d.gamma_slope == 1.0


def test_the_two_regimes_price_verify_tokens_differently():
    """KV-bound: an extra verify token over a 32k context costs a small fraction of the
    step's KV reads; compute-bound attention: about as much as the KV read itself."""
    ctx = 32768
    for name, low, high in (("selfspec-llama8b-8xh200", 0.0, 0.05),
                            ("selfspec-v3-h200", 0.5, 50.0)):
        p = load_profile(name)
        per_verify = p.attn_s_per_query_ctx * ctx
        kv_read = p.kv_s_per_token * ctx
        assert low <= per_verify / kv_read <= high, name


# -- workloads and traces ----------------------------------------------------------------------


def test_length_presets_ship_inside_the_package(monkeypatch, tmp_path):
    """`mooncake` and `long-context` need nothing outside the installed package."""
    from pathlib import Path

    import dspark_sim.sim
    from dspark_sim.sim.workload import sample_lengths

    monkeypatch.chdir(tmp_path)  # no ../shared relative to here
    data = Path(dspark_sim.sim.__file__).parent / "data"
    assert (data / "lengths.parquet").is_file()  # package data, with its sources stated
    assert "Apache-2.0" in (data / "LENGTHS.md").read_text()
    p, o, desc = sample_lengths("mooncake", 2000, np.random.default_rng(0))
    assert p.size == 2000 and 4000 < np.median(p) < 10000 and p.max() > 32000
    assert "mooncake" in desc
    p, o, _ = sample_lengths("long-context", 4000, np.random.default_rng(0))
    assert abs(np.median(p) / 32768 - 1) < 0.05 and abs(np.median(o) / 512 - 1) < 0.05
    p, o, _ = sample_lengths("long-context:65536:128", 4000, np.random.default_rng(0))
    assert abs(np.median(p) / 65536 - 1) < 0.05
    with pytest.raises(InputError, match="--lengths"):
        sample_lengths("long-context:5", 10, np.random.default_rng(0))


def test_synthetic_entropy_tracks_acceptance():
    from dspark_sim.traces.entropy import entropy_of, rank_auc, synth_entropy
    from dspark_sim.traces.schema import load_trace

    # the entropy of (pi, rest over V) by hand
    assert entropy_of(np.array([0.5]), 1)[0] == pytest.approx(np.log(2))
    assert entropy_of(np.array([0.9]), 4)[0] == pytest.approx(
        -0.9 * np.log(0.9) - 0.1 * np.log(0.1 / 4))
    assert rank_auc(np.array([1.0, 2.0, 3.0, 4.0]), np.array([0, 0, 1, 1])) == 1.0
    assert rank_auc(np.array([1.0, 1.0]), np.array([0, 1])) == 0.5
    base = load_trace("dspark-synthetic")
    t = synth_entropy(base, seed=1)
    h = t.v2.draft_entropy.astype(np.float64)
    assert h.shape == base.conf.shape and np.all(h >= 0)
    m = base.accept_len.astype(np.int64)
    j = np.arange(base.gamma_max)
    reached = j[None, :] <= m[:, None]
    accepted = j[None, :] < m[:, None]
    auc = rank_auc(-h[reached], accepted[reached])
    assert 0.7 < auc < 0.9  # a real but imperfect signal
    # none: no signal; separation 0 leaves only the depth profile
    flat = synth_entropy(base, seed=1, separation=0.0).v2.draft_entropy.astype(np.float64)
    assert rank_auc(-flat[:, 0], accepted[:, 0]) == pytest.approx(0.5, abs=0.03)
    # same seed, same bytes
    assert np.array_equal(synth_entropy(base, seed=1).v2.draft_entropy, t.v2.draft_entropy)


def test_shipped_selfspec_trace_is_current():
    from dspark_sim.traces.entropy import selfspec_trace
    from dspark_sim.traces.schema import load_trace

    shipped = load_trace("selfspec-synthetic")
    fresh = selfspec_trace()
    assert np.array_equal(shipped.accept_len, fresh.accept_len)
    assert np.array_equal(shipped.v2.draft_entropy, fresh.v2.draft_entropy)
    assert shipped.meta.drafter == "selfspec" and shipped.schema_version == 2


# -- the CLI -----------------------------------------------------------------------------------


def test_cli_runs_and_sweeps_the_new_policies_on_shipped_traces(tmp_path):
    """`run` and `sweep` with dfly, dcut and sparsespec on the shipped traces and profiles;
    sparsespec on a profile without a self-speculation table is a one-line error."""
    import json

    import polars as pl
    from typer.testing import CliRunner

    from dspark_sim.cli import app

    runner = CliRunner()
    small = ["--num-requests", "40", "--replicas", "1", "--max-concurrency", "8"]
    for policy, extra in (("dfly", []), ("dcut", []),
                          ("sparsespec", ["--profile", "selfspec-llama8b-8xh200",
                                          "--lengths", "long-context:8192:64"])):
        out = tmp_path / policy
        r = runner.invoke(app, ["run", "--policy", policy, *small, *extra, "--quiet",
                                "--out", str(out)])
        assert r.exit_code == 0, r.output
        s = json.loads((out / "summary.json").read_text())
        assert s["policy"] == policy and s["completed"] == 40
    assert s["trace"].endswith("selfspec-synthetic")
    r = runner.invoke(app, ["run", "--policy", "sparsespec", *small, "--quiet"])
    assert r.exit_code == 2
    assert "[draft.selfspec]" in r.output and "selfspec-llama8b-8xh200" in r.output
    r = runner.invoke(app, ["sweep", "--policies", "sparsespec,sparsespec:conf",
                            "--profiles", "selfspec-v3-h200", "--concurrency", "4",
                            "--num-requests", "16", "--lengths", "mooncake",
                            "--executor", "serial", "--quiet", "--candidate", "sparsespec",
                            "--baseline", "sparsespec:conf", "--out", str(tmp_path / "sw")])
    assert r.exit_code == 0, r.output
    assert pl.read_parquet(tmp_path / "sw" / "results.parquet").height == 2
    # the batch-shared budgets on a sweep's fronts and report, with the baseline they
    # are compared against (the headline runs when both are in the sweep)
    sw = tmp_path / "sw2"
    r = runner.invoke(app, ["sweep", "--policies", "dfly,dcut,none", "--concurrency", "2,8",
                            "--num-requests", "24", "--replicas", "1", "--executor", "serial",
                            "--quiet", "--candidate", "dcut", "--baseline", "dfly",
                            "--out", str(sw)])
    assert r.exit_code == 0, r.output
    from dspark_sim.sim.frontier import compute_fronts

    df = pl.read_parquet(sw / "results.parquet")
    fronts = compute_fronts(df, stable_only=False)
    assert {"dfly", "dcut", "none"} <= set(fronts)
    html = (sw / "report.html").read_text()
    for name in ("dfly", "dcut", "none"):
        assert f'"name":"{name}"' in html.replace(": ", ":"), name
    html = (tmp_path / "sw" / "report.html").read_text().replace(": ", ":")
    assert '"name":"sparsespec"' in html and '"name":"sparsespec:conf"' in html


# -- the two regimes, measured -----------------------------------------------------------------


def test_kv_bound_keeps_speculation_profitable_at_large_batch_compute_bound_does_not():
    """``benchmarks/long_context.py`` at small scale (its own ``point``: 32k prompts,
    disaggregated prefill, reserved KV, the self-speculation trace). On the KV-bound profile
    a verify token rides on a step dominated by each request's KV read, so the gain of
    drafting grows with the batch and is large at the largest one; on the compute-bound one
    every verify token pays its own attention over the context and each draft pass reads
    the whole MoE, so drafting three tokens never gains much and seven lose, at any batch."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "long_context.py"
    spec = importlib.util.spec_from_file_location("long_context_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    pols = ("fixed:3", "fixed:7")
    gain = {}
    for profile in ("selfspec-llama8b-8xh200", "selfspec-v3-h200"):
        for load in (4, 64):
            r = bench.point(profile, load, "long-context:32768:96", 2, policies=pols)
            gain[profile, load] = {p: r[p]["thr"] / r["none"]["thr"] for p in pols}
            gain[profile, load]["batch"] = r["none"]["batch"]
    kv, cb = gain["selfspec-llama8b-8xh200", 64], gain["selfspec-v3-h200", 64]
    small = gain["selfspec-llama8b-8xh200", 4]
    # KV-bound: the large batch runs (KV capacity admits it), drafting pays there, and
    # pays more than at a batch of 4 (where a self-draft pass costs as much as the step)
    assert kv["batch"] > 32
    assert kv["fixed:3"] > 1.2 and kv["fixed:3"] > small["fixed:3"] + 0.2
    # compute-bound: at the same load the gain of three drafts is at most marginal, seven
    # lose, and the KV-bound profile's gain is well above it
    assert cb["fixed:3"] < 1.1 and cb["fixed:7"] < 1.0
    assert kv["fixed:3"] > cb["fixed:3"] + 0.15


def test_a_stopping_drafters_step_cost_carries_the_draft_per_pass_not_in_the_extra():
    """SparseSpec's controller drafts pass by pass and stops at its verify length, so the
    step cost it is handed prices the draft per pass (``draft_pass_s``: the table's 3 ms)
    and leaves it out of ``extra_s``, which on a profile with no other extra term is 0 at
    every admitted draft count (a block drafter's extra holds its draft instead)."""
    from dataclasses import replace

    from dspark_sim.calibration.profile import DraftCost, EngineProfile
    from dspark_sim.sim import api
    from dspark_sim.sim.config import DeploymentConfig, SimConfig, WorkloadConfig

    prof = EngineProfile(name="flat", kind="measured", gpus_per_replica=1,
                         tokens=np.array([1, 8192]), step_s=np.array([0.01, 0.01]),
                         interpolation="step",
                         drafts={"selfspec": DraftCost(np.array([1.0, 2.0]),
                                                       np.array([0.003, 0.003]), 1)})
    inner = get_policy("sparsespec")
    seen = []
    pol = replace(inner, decide=lambda s: (seen.append(s), inner(s))[1])
    cfg = SimConfig(policy="sparsespec", trace="selfspec-synthetic",
                    deployment=DeploymentConfig(replicas=1),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=2, num_requests=2,
                                            lengths="fixed:50:30"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(api, "get_policy", lambda spec: pol)
        s = api.simulate(cfg, profile=prof).summary
    assert seen and s["num_draft_tokens_verified"] > 0
    for snap in seen:
        assert snap.cost.draft_pass_s == pytest.approx(0.003, rel=1e-12)
        assert snap.cost.draft_fixed_s == 0.0
        np.testing.assert_array_equal(snap.cost.extra_s, 0.0)
