"""The CLI through typer's CliRunner: real runs, written outputs, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from dspark_sim.cli import app

runner = CliRunner()
SMALL = ["--num-requests", "120", "--replicas", "1", "--qps", "20"]


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_run_prints_summary_and_writes_outputs(tmp_path):
    out = tmp_path / "run"
    r = invoke("run", "--policy", "confidence", *SMALL, "--out", str(out))
    assert r.exit_code == 0, r.output
    assert "output throughput per GPU" in r.output
    s = json.loads((out / "summary.json").read_text())
    # the default profile's replica is one rank of an EP group, beside its prefill instances
    assert f"1 decode replica(s) = {s['gpus_per_replica']} GPUs, each replica one rank" in \
        " ".join(r.output.split())
    assert f"{s['prefill_instances']} prefill instance(s)" in s["deployment"]
    assert s["policy"] == "confidence" and s["completed"] == 120
    assert pl.read_parquet(out / "requests.parquet").height == 120


# draft tokens verified per request-step, from each policy's definition (None: it varies
# with the survivals, between 1 and gamma_max = 7)
DRAFTS_PER_STEP = {"fixed:5": 5, "mtp1": 1, "none": 0, "confidence-async": None,
                   "threshold:0.6": None}


@pytest.mark.parametrize("policy", list(DRAFTS_PER_STEP))
def test_run_policies(policy, tmp_path):
    """--policy reaches the simulator: the summary names it, and the draft tokens it
    verified are what the policy asks for per request-step (it checked only exit 0)."""
    r = invoke("run", "--policy", policy, *SMALL, "--quiet", "--out", str(tmp_path / "o"))
    assert r.exit_code == 0, r.output
    assert r.output == ""
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert s["policy"] == policy and s["completed"] == 120 and s["num_drafts"] > 0
    verified, steps = s["num_draft_tokens_verified"], s["num_drafts"]
    assert 0 <= s["num_accepted_tokens"] <= verified
    if DRAFTS_PER_STEP[policy] is None:
        assert steps < verified < 7 * steps
    else:
        assert verified == DRAFTS_PER_STEP[policy] * steps


def test_run_options(tmp_path):
    out = tmp_path / "o"
    r = invoke("run", "--max-concurrency", "8", "--num-requests", "40", "--replicas", "2",
               "--router", "round-robin", "--slo", "ttft:500,tpot:20", "--seed", "3",
               "--domain", "math", "--lengths", "fixed:128:64", "--out", str(out), "--quiet")
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    assert s["slo_tpot_ms"] == 20 and s["slo_ttft_ms"] == 500
    # goodput by hand: finished requests with TTFT <= 500 ms and TPOT <= 20 ms (a one-token
    # request has no TPOT and passes), per second of the whole run
    req = pl.read_parquet(out / "requests.parquet").filter(pl.col("finished"))
    ok = req.filter((pl.col("ttft_ms") <= 500) & ~(pl.col("tpot_ms") > 20).fill_null(False))
    assert s["goodput"] == pytest.approx(ok.height / s["duration"], rel=1e-12)
    assert "closed loop, 8 clients" in s["workload"]
    r = invoke("run", "--qps", "30", "--burstiness", "0.5", *SMALL[:4], "--quiet",
               "--out", str(out))
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    assert s["workload"].startswith("gamma(burstiness=0.5) arrivals at 30 req/s"), s["workload"]


def test_workload_replay_cli(shared_dir, tmp_path):
    wl = shared_dir / "data/workloads/AzureLLMInferenceTrace_conv.csv"
    out = tmp_path / "w"
    r = invoke("run", "--workload", str(wl), "--qps", "40", "--num-requests", "150",
               "--replicas", "1", "--out", str(out), "--quiet")
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    assert "time-scaled to 40 req/s" in s["workload"]
    # the replay sends the file's first 150 rows in order, at its timestamps' offsets all
    # scaled by one factor (it checked the description only)
    import numpy as np

    rows = pl.read_csv(wl, n_rows=150)
    req = pl.read_parquet(out / "requests.parquet").sort("request_id")
    assert req["prompt_tokens"].to_list() == rows["ContextTokens"].to_list()
    assert req["output_tokens"].to_list() == rows["GeneratedTokens"].to_list()
    ts = rows["TIMESTAMP"].str.to_datetime().dt.epoch("us").to_numpy() / 1e6
    native_s = ts - ts[0]
    arrival_s = req["arrival_s"].to_numpy()
    np.testing.assert_allclose(arrival_s, native_s * (arrival_s[-1] / native_s[-1]),
                               rtol=1e-6, atol=1e-9)


def _one_line_error(r, *needles):
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.output
    assert lines[0].startswith("error: ")
    assert "Traceback" not in r.output
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_bad_inputs_give_one_line_errors(tmp_path):
    _one_line_error(invoke("run", "--policy", "bogus"), "--policy", "bogus")
    _one_line_error(invoke("run", "--qps", "-5"), "--qps")
    _one_line_error(invoke("run", "--policy", "fixed:x"), "--policy")
    _one_line_error(invoke("run", "--slo", "ttft:abc"), "--slo")
    bad_trace = tmp_path / "bad.parquet"
    bad_trace.write_bytes(b"not parquet at all")
    _one_line_error(invoke("run", "--trace", str(bad_trace)), str(bad_trace))
    bad_prof = tmp_path / "bad.toml"
    bad_prof.write_text("[profile]\nname='x'\n[target]\ntokens=[1,2]\nstep_ms=[1.0]\n")
    _one_line_error(invoke("run", "--profile", str(bad_prof)), str(bad_prof), "length")
    bad_wl = tmp_path / "bad.csv"
    bad_wl.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,12,x\n")
    _one_line_error(invoke("run", "--workload", str(bad_wl)), str(bad_wl))
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"timestamp": 0, "input_length": 5}\n')
    _one_line_error(invoke("run", "--workload", str(bad_jsonl)), str(bad_jsonl), "line 1")
    _one_line_error(invoke("run", "--profile", "no-such-profile"), "--profile")


def test_bad_input_keeps_existing_outputs(tmp_path):
    out = tmp_path / "keep"
    assert invoke("run", *SMALL, "--out", str(out), "--quiet").exit_code == 0
    before = (out / "summary.json").read_bytes()
    r = invoke("run", *SMALL, "--policy", "nope", "--out", str(out))
    assert r.exit_code == 2
    assert (out / "summary.json").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["requests.parquet", "summary.json"]


def test_traces_synth_and_inspect(tmp_path):
    p = tmp_path / "iid.parquet"
    r = invoke("traces", "synth", "--kind", "iid", "--alpha", "0.7", "--gamma", "4",
               "--requests", "8", "--positions", "200", "--out", str(p))
    assert r.exit_code == 0, r.output
    r = invoke("traces", "inspect", str(p))
    assert r.exit_code == 0, r.output
    # the tau table's row l = 4 by hand from the written file: served (a fixed-4 chain
    # through each request) and per position (mean of min(4, m_t) + 1)
    import re

    from dspark_sim.traces.schema import load_trace

    tr = load_trace(p)
    m = tr.accept_len.astype(int)
    tokens = steps = 0
    for a, b in zip(tr.req_offsets[:-1], tr.req_offsets[1:], strict=True):
        t = int(a)
        while t < b:
            tokens, steps, t = tokens + min(4, m[t]) + 1, steps + 1, t + min(4, m[t]) + 1
    served, per_pos = tokens / steps, float((m.clip(max=4) + 1).mean())
    # columns: per request-step, per position (this drafter proposes at every step, so
    # per proposal is the same and not shown)
    row = re.search(r"│\s*4\s*│\s*([\d.]+)\s*│\s*([\d.]+)\s*│", r.output)
    assert row and row.groups() == (f"{served:.2f}", f"{per_pos:.2f}"), r.output
    assert "per proposal is not shown" in r.output
    # both near Leviathan's (1 - 0.7^5) / 0.3 = 2.77 for iid acceptance (1,600 positions)
    assert abs(served - (1 - 0.7**5) / 0.3) < 0.1 and abs(per_pos - (1 - 0.7**5) / 0.3) < 0.1
    assert "P(k | 1..k-1)" in r.output
    r = invoke("run", "--trace", str(p), "--policy", "fixed:2", *SMALL, "--quiet",
               "--out", str(tmp_path / "run"))
    assert r.exit_code == 0, r.output
    # the run served this trace: iid acceptance 0.7 at position 1, 0.7^2 at position 2
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["trace"] == str(p) and s["trace_drafter"] == "iid-alpha0.7"
    assert s["num_draft_tokens_verified"] == 2 * s["num_drafts"]
    assert s["acceptance_per_position"][:2] == pytest.approx([0.7, 0.49], abs=0.04)
    r = invoke("traces", "inspect", "dspark-synthetic")
    assert r.exit_code == 0, r.output
    # served tau per request-step at l = 7 per domain, every domain within the terminal's
    # 80 columns: DSpark Table 1's math 5.57, code 5.12, chat 3.49
    row7 = re.search(r"│ 7 │(.*)│", r.output).group(1).split("│")
    assert [float(v) for v in row7[2::2]] == [5.57, 5.12, 3.49], r.output
    _one_line_error(invoke("traces", "synth", "--kind", "iid", "--alpha", "1.5",
                           "--out", str(tmp_path / "x.parquet")), "--alpha")
    assert not (tmp_path / "x.parquet").exists()


def test_profiles_commands():
    from dspark_sim.calibration.profile import builtin_profiles, load_profile

    r = invoke("profiles", "list")
    assert r.exit_code == 0, r.output
    # every shipped profile is listed (it checked for the default one only)
    assert [n for n in builtin_profiles() if n not in r.output] == []
    r = invoke("profiles", "show", "v4flash-h200")
    assert r.exit_code == 0 and "draft [dspark]" in r.output
    # every term is printed, set or not, with the draft tables' gamma_slope and KV term
    p = load_profile("v4flash-h200")
    for key in ("kv_us_per_token", "multi_kv_us_per_token", "attn_ns_per_query_ctx",
                "logits_us_per_row", "request_us", "eager_penalty_ms", "gamma_slope",
                "kv_capacity_tokens", "max_model_len", "prefill"):
        assert key in r.output, key
    assert f"kv_capacity_tokens     {p.limits.kv_capacity_tokens}" in r.output
    assert f"window {p.attn_window_tokens:,} tokens" in r.output
    assert "default trace (what run replays without --trace): unset" in r.output
    r = invoke("profiles", "show", "smollm2-cpu")  # measured: limits unset, terms fitted
    assert r.exit_code == 0 and "max_num_seqs           unset" in r.output
    # a profile that names its published setup's trace says so
    r = invoke("profiles", "show", "v4flash-b300")
    want = load_profile("v4flash-b300").default_trace
    assert want and f"default trace (what run replays without --trace): {want}" in r.output


def test_sweep_cli_writes_results_report_and_headline(tmp_path):
    out = tmp_path / "sw"
    args = ["sweep", "--out", str(out), "--policies", "mtp1,confidence-async",
            "--concurrency", "4,32", "--num-requests", "80", "--replicas", "1",
            "--executor", "serial", "--quiet"]
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    df = pl.read_parquet(out / "results.parquet")
    assert df.height == 4 and set(df["policy_spec"]) == {"mtp1", "confidence-async"}
    assert (out / "report.html").stat().st_size > 100_000
    assert "matched throughput" in r.output and "one load per policy" not in r.output
    # no --qps / --concurrency: the base's own load, one point per policy, and a hint
    r = invoke("sweep", "--out", str(tmp_path / "one"), "--policies", "mtp1",
               "--num-requests", "40", "--replicas", "1", "--executor", "serial", "--quiet")
    assert r.exit_code == 0 and "one load per policy: a front needs several" in r.output, r.output
    _one_line_error(invoke("sweep", "--out", str(tmp_path / "x"), "--qps", "5:1:0"), "--qps")


def test_sweep_cli_headline_defaults_and_lists_points_left_off(tmp_path, monkeypatch):
    """The README's default `confidence` against mtp1 is the headline without naming
    either. At C = 32, 80 requests leave each steady window without a latency sample:
    the headline gives no gain at 80 tok/s/user (both fronts stay above it: two lower
    bounds), blames too few requests with the sizing options, not the load range, and
    every point left off is listed (the headline's two, then none's)."""

    monkeypatch.setenv("COLUMNS", "400")  # each sentence on one line
    r = invoke("sweep", "--out", str(tmp_path / "sw"), "--policies", "mtp1,confidence,none",
               "--concurrency", "4,32", "--num-requests", "80", "--replicas", "1",
               "--executor", "serial", "--quiet", "--sla", "80,120")
    assert r.exit_code == 0, r.output
    assert "| throughput gain at 80 tok/s/user, confidence vs mtp1 | no gain: both fronts " \
        "stay above this tier" in r.output
    assert "confidence: heavier loads (C = 32) left off, too few requests" in r.output
    assert "extend the load range" not in r.output
    assert "| points left off the fronts, confidence vs mtp1 | confidence at C = 32: too few " \
        "requests (0 requests in the steady window's latency sample, of 80 run); mtp1 at " \
        "C = 32" in r.output
    assert "\n1 point left off the fronts: none at C = 32: too few requests" in r.output
    assert "--requests-per-client K" in r.output and "--max-doublings D" in r.output
    r = invoke("sweep", "--out", str(tmp_path / "sw2"), "--policies", "fixed:3,none",
               "--concurrency", "4,32", "--num-requests", "80", "--replicas", "1",
               "--executor", "serial", "--quiet")
    assert r.exit_code == 0, r.output
    assert "no headline: no candidate: confidence is not swept" in r.output


def test_sweep_cli_basis_and_sizing(tmp_path):
    """--requests-per-client sizes each closed-loop point at max(--num-requests, K x C);
    --basis whole draws the headline from the whole-run columns, and says so."""
    out = tmp_path / "sw"
    args = ["sweep", "--out", str(out), "--policies", "mtp1,confidence-async",
            "--concurrency", "2,8", "--num-requests", "20", "--replicas", "1",
            "--requests-per-client", "5", "--executor", "serial", "--quiet"]
    r = invoke(*args, "--basis", "whole")
    assert r.exit_code == 0, r.output
    assert "figures: whole run" in r.output and "| figures | whole run" in r.output
    df = pl.read_parquet(out / "results.parquet").sort("policy_spec", "concurrency")
    assert df["num_requests"].to_list() == [20, 40, 20, 40]  # max(20, 5 x {2, 8})
    r = invoke(*args)  # resumed: the same points, the default (steady) figures
    assert r.exit_code == 0, r.output
    assert "figures: steady state" in r.output and "| figures | steady state" in r.output


def test_validate_cli_rejects_bad_options():
    pytest.importorskip("torch")  # validate imports the capture stack before its checks
    _one_line_error(invoke("validate", "--rates", "-1"), "--rates")
    _one_line_error(invoke("validate", "--policies", "bogus", "--rates", "0.5"), "error: --policies:")


def test_run_policy_profile(tmp_path):
    """--policy-profile prices the scheduler's SPS curve only: the run's own profile
    (v4flash-h200) as the policy profile changes nothing; another one changes the drafts
    the confidence scheduler verifies, not the engine that runs them."""
    def summary(*extra: str) -> dict:
        out = tmp_path / f"o{len(list(tmp_path.iterdir()))}"
        r = invoke("run", "--policy", "confidence", *SMALL, *extra, "--out", str(out),
                   "--quiet")
        assert r.exit_code == 0, r.output
        s = json.loads((out / "summary.json").read_text())
        s.pop("outputs")
        return s

    plain = summary()
    assert "policy_profile" not in plain
    assert summary("--policy-profile", "v4flash-h200") == plain | {"policy_profile": "v4flash-h200"}
    other = summary("--policy-profile", "qwen3-8b-h100")
    assert other["profile"] == plain["profile"] == "v4flash-h200"
    assert other["policy_profile"] == "qwen3-8b-h100"  # the outputs say which table decided
    assert other["num_draft_tokens_verified"] != plain["num_draft_tokens_verified"]
    bad = tmp_path / "bad.toml"
    bad.write_text("[profile]\nname = 'x'\n")
    _one_line_error(invoke("run", "--policy", "confidence", *SMALL, "--policy-profile", str(bad)),
                    "bad.toml")


# -- arrival options override the arrival kind of a lower layer (flag > --config > --preset)
FAST = ["--num-requests", "20", "--lengths", "fixed:64:16", "--quiet"]


def _run_workload(tmp_path, *args: str) -> dict:
    out = tmp_path / "out"
    r = invoke("run", *args, *FAST, "--out", str(out))
    assert r.exit_code == 0, r.output
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("flags,workload", [
    (["--qps", "5"], "Poisson arrivals at 5 req/s, fixed"),
    (["--burstiness", "0.5"], "gamma(burstiness=0.5) arrivals at 200 req/s"),
    (["--duration-s", "0.2", "--qps", "400"], "Poisson arrivals at 400 req/s"),
])
def test_an_open_loop_option_opens_a_closed_loop_preset(tmp_path, flags, workload):
    """single-replica is a closed loop of 64 clients: --qps / --burstiness / --duration-s
    on the command line override its arrival kind (not refused as 'does not apply to
    closed arrivals'); the preset's other settings (one replica) stay."""
    s = _run_workload(tmp_path, "--preset", "single-replica", *flags)
    assert s["workload"].startswith(workload), s["workload"]
    assert s["replicas"] == 1 and s["completed"] == s["num_requests"] > 0


def test_an_open_loop_option_or_key_overrides_the_config_files_closed_loop(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[workload]\narrival = "closed"\nmax_concurrency = 8\n')
    s = _run_workload(tmp_path, "--config", str(cfg), "--qps", "5")
    assert s["workload"].startswith("Poisson arrivals at 5 req/s")
    # the file's qps over the closed-loop preset: the file wins over the preset
    cfg.write_text("[workload]\nqps = 7.0\n")
    s = _run_workload(tmp_path, "--config", str(cfg), "--preset", "single-replica")
    assert s["workload"].startswith("Poisson arrivals at 7 req/s") and s["replicas"] == 1
    # and --max-concurrency closes a file's (or the tiny preset's) open loop
    s = _run_workload(tmp_path, "--config", str(cfg), "--preset", "tiny",
                      "--max-concurrency", "4")
    assert s["workload"].startswith("closed loop, 4 clients")


def test_a_rate_over_a_closed_loop_sending_a_files_requests_replays_the_file(tmp_path):
    """A closed loop that sends a workload file's requests opens into a replay of the
    file, time-scaled to --qps (as --workload --qps is)."""
    w = tmp_path / "w.csv"
    w.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:{i:02d}.0,{50 + i},{10 + i}\n" for i in range(20)))
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[workload]\nmax_concurrency = 4\nworkload_path = "{w}"\n')
    out = tmp_path / "out"
    r = invoke("run", "--config", str(cfg), "--qps", "2", "--quiet", "--out", str(out))
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    assert s["workload"].startswith("replay of w.csv (1.00 req/s native, time-scaled to 2 req/s")
    # --burstiness cannot shape a replay: it opens nothing, the conflict is named
    _one_line_error(invoke("run", "--config", str(cfg), "--burstiness", "2", "--quiet"),
                    "--burstiness", "closed arrivals", f"chosen by {cfg} [workload]")


def test_rate_and_concurrency_on_one_command_line_still_conflict(tmp_path):
    out = tmp_path / "out"
    _one_line_error(invoke("run", "--preset", "single-replica", "--qps", "5",
                           "--max-concurrency", "4", "--out", str(out)),
                    "--qps", "does not apply to closed arrivals (chosen by --max-concurrency)")
    assert not out.exists()


@pytest.mark.parametrize("loop", [[], ["--max-concurrency", "4"]], ids=["replay", "closed"])
def test_the_printed_workload_says_when_lengths_override_the_files(tmp_path, monkeypatch,
                                                                    loop):
    """--workload F --lengths L: the requests' lengths are L's, not F's, and the printed
    workload line (and summary.json's) says so; without --lengths it names the file's."""

    monkeypatch.setenv("COLUMNS", "250")  # the workload line unwrapped
    w = tmp_path / "w.csv"
    w.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:{i:02d}.0,{50 + i},{10 + i}\n" for i in range(20)))

    def workload_line(*extra: str) -> str:
        r = invoke("run", "--workload", str(w), *loop, "--replicas", "1", *extra)
        assert r.exit_code == 0, r.output
        return next(ln for ln in r.output.splitlines() if ln.startswith("workload "))

    line = workload_line("--lengths", "fixed:30:5")
    assert "fixed 30 in / 5 out, overriding the file's lengths" in line, line
    line = workload_line()
    assert "overriding" not in line
    if loop:  # a closed loop names the file's lengths; a replay's go without saying
        assert "lengths of w.csv" in line


def test_inspect_prints_no_data_for_a_position_no_chain_reached(tmp_path, monkeypatch):
    """Accepted lengths 0, 1, 2, 2, 0 with gamma 4: P(k | 1..k-1) is 3/5, 2/3, 0/2 and,
    at k = 4, 0/0: no chain reached it, printed n/a (it printed 0.000, a rate that was
    never measured); the library returns NaN there, a real 0 stays 0."""
    import math
    import re
    from dataclasses import replace

    import numpy as np

    from dspark_sim.traces.schema import write_trace
    from dspark_sim.traces.synth import synth_iid

    t = synth_iid(0.5, 4, num_requests=1, positions=5, seed=0)
    t = replace(t, accept_len=np.array([0, 1, 2, 2, 0], dtype=t.accept_len.dtype))
    cond = t.conditional_acceptance()
    assert cond[:3].tolist() == pytest.approx([3 / 5, 2 / 3, 0.0]) and math.isnan(cond[3])
    p = write_trace(t, tmp_path / "t.parquet")
    monkeypatch.setenv("COLUMNS", "200")
    r = invoke("traces", "inspect", str(p))
    assert r.exit_code == 0, r.output
    pos = r.output[r.output.index("per-position acceptance"):]
    rows = {int(m[0]): m[1] for m in re.findall(r"│\s*(\d)\s*│\s*(\S+)\s*│", pos)}
    assert rows == {1: "0.600", 2: "0.667", 3: "0.000", 4: "n/a"}


def test_user_text_with_brackets_prints_as_written(tmp_path):
    # rich markup is off: a description holding "[/]" would crash `profiles show`
    # (MarkupError), and "[draft.x]" vanish from it; error lines keep brackets too
    src = (Path(__file__).resolve().parents[2] / "calibration" / "data"
           / "qwen3-8b-h100.toml").read_text()
    prof = tmp_path / "p.toml"
    prof.write_text(src.replace('description = "', 'description = "odd [/] and [draft.x] ', 1))
    r = invoke("profiles", "show", str(prof))
    assert r.exit_code == 0, r.output
    assert "odd [/] and [draft.x] Roofline" in r.output.replace("\n", " ")
    r = invoke("profiles", "show", str(tmp_path / "[bold]missing.toml"))
    assert r.exit_code == 2 and "[bold]missing.toml" in r.output


@pytest.mark.parametrize("label", ["odd [/bold] target", "model [v2]", "[/]", "a[bold]b"])
def test_progress_labels_print_as_written(tmp_path, capsys, label):
    # a label holding "[/bold]" would crash the bar (MarkupError), "[v2]" vanish from it
    pytest.importorskip("torch")
    from dspark_sim.io import progress_bar
    from dspark_sim.traces.capture import _run_chunks

    manifest = {"done": {}}
    _run_chunks([[0], [1]], manifest, tmp_path / "manifest.json", lambda ci, chunk: {"ci": ci},
                f"capture {label}", progress=True, fail_after=None)
    assert manifest["done"] == {"0": {"ci": 0}, "1": {"ci": 1}}
    assert f"capture {label}" in capsys.readouterr().out
    bar = progress_bar(transient=False)  # the sweep's and training's bars: the same columns
    with bar:
        task = bar.add_task("start", total=2)
        bar.update(task, advance=2, description=f"{label} qps=1")
    assert f"{label} qps=1" in capsys.readouterr().out


def test_run_help_lists_every_policy_and_length_model():
    # the help text is where a user looks first; it must not drift behind the registry
    from dspark_sim.policies.registry import kinds
    from dspark_sim.sim.workload import TRACE_LENGTHS

    r = invoke("run", "--help")
    assert r.exit_code == 0
    text = "".join(" ".join(r.output.replace("│", " ").split()).split())  # no wrap spaces
    assert [k.usage for k in kinds() if k.usage.replace(" ", "") not in text] == []
    assert "[@BASE]" in text  # the grammar's brackets survive rich markup
    assert [n for n in ("azure-conv", "azure-code", "mooncake", "long-context", "fixed:",
                        "lognormal:", *TRACE_LENGTHS) if n not in text] == []


def test_run_help_panels_name_the_config_table_of_each_option():
    """run --help groups its options by the --config table holding the same setting: a
    panel that names the wrong table sends the user to the wrong key."""
    import typer

    from dspark_sim.sim.config import OPTION_FIELDS

    params = typer.main.get_command(app).commands["run"].params
    panels = {p.name: p.rich_help_panel for p in params if p.name != "help"}
    for name, path in OPTION_FIELDS.items():
        table = path.split(".")[0] if "." in path else "run"
        assert f"table: {table})" in panels[name] or f"tables: {table}," in panels[name] \
            or f", {table})" in panels[name], (name, path, panels[name])
    assert set(panels) - set(OPTION_FIELDS) == {"slo", "policy_profile", "config",
                                                 "preset_name", "out", "quiet", "executor",
                                                 "workers"}
    assert "table: run" in panels["slo"]  # [run] slo_ttft_ms, slo_tpot_ms
    r = invoke("run", "--help")
    assert r.exit_code == 0 and "Load (config table: workload)" in r.output


def test_validate_and_traces_help_say_what_the_code_accepts():
    # validate --drafter did not say it takes a checkpoint folder, --profile lacked auto
    # and insitu-self, and the traces group said "schema v1" beside v2 traces
    pytest.importorskip("torch")  # traces.train builds torch modules at import
    import typer

    from dspark_sim.traces.schema import SCHEMA_VERSIONS
    from dspark_sim.traces.train import LEARNED_KINDS
    from dspark_sim.validation.harness import INSITU, INSITU_SELF

    group = typer.main.get_command(app)
    helps = {p.opts[0]: p.help for p in group.commands["validate"].params}
    assert [w for w in ("auto", "lookup", *LEARNED_KINDS, "checkpoint folder", "deepspec:DIR")
            if w not in helps["--drafter"]] == []
    assert [w for w in ("auto", "measure", INSITU, INSITU_SELF, "TOML")
            if w not in helps["--profile"]] == []
    traces_help = group.commands["traces"].help
    assert [v for v in SCHEMA_VERSIONS if f"v{v}" not in traces_help] == []
