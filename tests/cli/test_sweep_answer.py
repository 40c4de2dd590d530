"""`dspark-sim sweep` answers which policy at which load: the per-load table first, goodput
under `--slo` (or the config file's SLO keys), every point of the folder reported, and
mtp1 replaying one trace however it is given."""

from __future__ import annotations

import json
import re

import polars as pl
from browser import rendered_dom, tables
from typer.testing import CliRunner

from dspark_sim.cli import app

runner = CliRunner()
# small closed-loop points on one replica: a second or two each
GRID = ["--concurrency", "2,6", "--num-requests", "60", "--replicas", "1",
        "--executor", "serial", "--quiet"]


def invoke(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "250"})


def _answer_block(output: str) -> str:
    start = output.index("Which policy at which load")
    return output[start:output.index("points in")]


def test_a_second_sweep_into_one_folder_keeps_every_point_in_the_report(tmp_path):
    out = tmp_path / "sw"
    r = invoke("sweep", "--out", str(out), "--policies", "none", *GRID)
    assert r.exit_code == 0, r.output
    r = invoke("sweep", "--out", str(out), "--policies", "fixed:3", *GRID)
    assert r.exit_code == 0, r.output
    assert pl.read_parquet(out / "results.parquet").height == 4
    assert "4 points in" in r.output and "(2 from this sweep, 2 from earlier ones)" in r.output
    # the answer opens the output and weighs both sweeps' policies at each load
    assert r.output.lstrip().startswith("Which policy at which load")
    answer = _answer_block(r.output)
    assert answer.count("fixed:3") >= 2 and "none" in answer
    page = (out / "report.html").read_text()
    assert "4 sweep points in all; of the 4 drawn" in page
    assert page.index("Which policy at which load") < page.index("Headline numbers")
    # a rerun of one point with more requests: the bigger run drawn, the other listed
    r = invoke("sweep", "--out", str(out), "--policies", "none",
               *[a if a != "60" else "90" for a in GRID])
    assert r.exit_code == 0, r.output
    assert "6 points in" in r.output and "2 of them superseded" in r.output
    page = (out / "report.html").read_text()
    assert "6 sweep points in all and 2 superseded" in page


def test_slo_adds_goodput_to_the_answer_from_the_option_and_from_a_config_file(tmp_path):
    # a TTFT no request of this engine meets: goodput 0 for every policy
    r = invoke("sweep", "--out", str(tmp_path / "a"), "--policies", "none,fixed:3",
               "--slo", "ttft:0.001,tpot:1000", *GRID)
    assert r.exit_code == 0, r.output
    answer = _answer_block(r.output)
    assert "TTFT <= 0.001 ms and TPOT <= 1000 ms" in answer and "goodput" in answer
    assert re.search(r"0\.00 ± [0-9.]+; 0 ± ", answer), answer
    page = (tmp_path / "a" / "report.html").read_text()
    assert "Goodput vs interactivity" in page
    # the same SLO as the config file's keys; the points are reused (an SLO reruns none)
    cfg = tmp_path / "c.toml"
    cfg.write_text("[run]\nslo_ttft_ms = 0.001\nslo_tpot_ms = 1000\n")
    r2 = invoke("sweep", "--out", str(tmp_path / "a"), "--policies", "none,fixed:3",
                "--config", str(cfg), *GRID)
    assert r2.exit_code == 0, r2.output
    assert _answer_block(r2.output) == answer
    assert "4 points in" in r2.output and "earlier" not in r2.output
    # a lenient SLO: goodput is the throughput again
    r3 = invoke("sweep", "--out", str(tmp_path / "a"), "--policies", "none,fixed:3",
                "--slo", "ttft:1e6,tpot:1e6", *GRID)
    assert r3.exit_code == 0 and "0.00 ±" not in _answer_block(r3.output), r3.output


def test_default_sla_lines_come_from_the_data(tmp_path):
    r = invoke("sweep", "--out", str(tmp_path / "s"), "--policies", "none", *GRID)
    assert r.exit_code == 0, r.output
    tiers = [float(t) for t in re.search(r"SLA tiers ([0-9., ]+) tok/s/user",
                                         r.output)[1].split(", ")]
    df = pl.read_parquet(tmp_path / "s" / "results.parquet")
    lo, hi = df["steady_median_interactivity"].min(), df["steady_median_interactivity"].max()
    assert len(tiers) == 2 and all(lo * 0.95 <= t <= hi * 1.05 for t in tiers), (tiers, lo, hi)


# a profile without [draft.mtp1] whose [draft.dspark] table prices the trace's drafter:
# mtp1 can run only on the trace given, never on the built-in mtp1 trace
PROFILE, TRACE = "smollm2-cpu-validate", "captured-smollm2-dspark"
MTP1 = ["--num-requests", "20", "--replicas", "1", "--lengths", "fixed:16:16"]


def test_mtp1_replays_the_same_trace_from_trace_traces_and_a_config_file(tmp_path):
    r = invoke("run", "--policy", "mtp1", "--profile", PROFILE, "--trace", TRACE, *MTP1,
               "--qps", "2", "--out", str(tmp_path / "opt"), "--quiet")
    assert r.exit_code == 0, r.output
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[run]\ntrace = "{TRACE}"\n[deployment]\nprofile = "{PROFILE}"\n')
    r = invoke("run", "--policy", "mtp1", "--config", str(cfg), *MTP1, "--qps", "2",
               "--out", str(tmp_path / "file"), "--quiet")
    assert r.exit_code == 0, r.output
    r = invoke("sweep", "--policies", "mtp1", "--profiles", PROFILE, "--traces", TRACE, *MTP1,
               "--qps", "2", "--executor", "serial", "--quiet", "--sla", "5",
               "--out", str(tmp_path / "sw"))
    assert r.exit_code == 0, r.output
    r = invoke("sweep", "--policies", "mtp1", "--config", str(cfg), *MTP1, "--qps", "2",
               "--executor", "serial", "--quiet", "--sla", "5", "--out", str(tmp_path / "sw2"))
    assert r.exit_code == 0, r.output
    runs = [json.loads((tmp_path / d / "summary.json").read_text()) for d in ("opt", "file")]
    runs += [pl.read_parquet(tmp_path / d / "results.parquet").row(0, named=True)
             for d in ("sw", "sw2")]
    keys = ("trace", "total_output_tokens", "spec_decode_acceptance_length", "duration")
    assert all(r["trace"] == f"builtin:{TRACE}" for r in runs)
    assert len({tuple(r[k] for k in keys) for r in runs}) == 1, [
        {k: r[k] for k in keys} for r in runs]


def test_the_report_a_browser_renders_opens_with_the_answer(tmp_path):
    """What a user sees: the page after headless Chromium ran its scripts, whose first
    table is the answer, a row per load naming the policy, its gains and the verdict."""
    out = tmp_path / "sw"
    r = invoke("sweep", "--out", str(out), "--policies", "none,fixed:3", "--seeds", "0,1",
               "--slo", "ttft:1e6,tpot:1e6", *GRID)
    assert r.exit_code == 0, r.output
    heading, rows = tables(rendered_dom(out / "report.html", tmp_path / "chromium"))[0]
    assert heading == "Which policy at which load"
    assert [row["load"] for row in rows] == ["C = 2", "C = 6"]
    for row in rows:
        assert row["deploy"] in ("none", "fixed:3") and row["runner-up"] in ("none", "fixed:3")
        assert re.match(r"^[+-]\d+\.\d% tok/s/GPU, [+-]\d+\.\d% goodput$", row["vs runner-up"])
        assert row["verdict"].startswith(("clear: ", "tie within noise: ", "tie: ")), row
        assert "(95 % CI, 2 seeds)" in row["verdict"] or row["verdict"].startswith("tie: ")
