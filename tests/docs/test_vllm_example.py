"""docs/validation.md's "Your own vLLM deployment", run as written on the recorded bench
folder it names (real `vllm bench serve` results, tests/data/vllm-cpu/run-2/runs): the
commands are read from the doc's code block, so the doc cannot drift from what runs, and
the end is checked as a new user meets it: a report whose first table names, for each
load, the policy to deploy, its gain, and whether it is a tie, read from the page that
headless Chromium rendered."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from browser import rendered_dom, tables

from dspark_sim.calibration.profile import load_profile
from dspark_sim.traces.schema import read_trace

# Slow (a fit and a 90-point sweep, about a minute on two cores): in .ci/run's slow leg.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
DOC = ROOT / "docs" / "validation.md"
SECTION = "### Your own vLLM deployment"
ANSWER = "Which policy at which load"


def _section() -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index(SECTION)
    return text[start:text.index("\n## ", start)]


def doc_commands() -> list[list[str]]:
    """The section's first bash block, continuation lines joined and comments dropped:
    each ``dspark-sim`` command's arguments (the ``vllm bench serve`` step is what the
    recording stands in for)."""
    block = re.search(r"```bash\n(.*?)```", _section(), re.S)[1]
    lines = (ln.split("#", 1)[0].strip() for ln in block.replace("\\\n", " ").splitlines())
    return [shlex.split(ln)[1:] for ln in lines if ln.startswith("dspark-sim ")]


def doc_link() -> tuple[Path, str]:
    """What the doc tells a new user to link, and as what: (the recording, the name)."""
    target, name = re.search(r"`ln -s\s+(\S+)\s+(\S+)`", _section()).groups()
    return ROOT / target, name


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> dict:
    """The doc's commands, each a fresh process in an empty folder holding only the link
    the doc says to make; returns the folder and each command's output."""
    work = tmp_path_factory.mktemp("example")
    recording, name = doc_link()
    assert recording.is_dir() and list(recording.glob("*.json")), recording
    (work / name).symlink_to(recording, target_is_directory=True)
    outputs = []
    for args in doc_commands():
        done = subprocess.run([sys.executable, "-c", "from dspark_sim.cli import main; main()",
                               *args], cwd=work, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "COLUMNS": "250"})
        assert done.returncode == 0, f"dspark-sim {shlex.join(args)}\n{done.stdout}\n{done.stderr}"
        outputs.append(done.stdout)
    return {"work": work, "outputs": outputs}


def _sweep_args() -> list[str]:
    return next(a for a in doc_commands() if a[0] == "sweep")


def _option(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_the_doc_runs_calibrate_then_a_sweep_on_its_own_requests():
    commands = doc_commands()
    assert [a[:2] for a in commands] == [["calibrate", "vllm"], ["sweep", "--out"]]
    sweep = _sweep_args()
    # the bench's own requests, and the policies' answer under SLOs and with noise measured
    assert _option(sweep, "--lengths") in ("trace", "trace:sample")
    assert "--slo" in sweep and len(_option(sweep, "--seeds").split(",")) >= 3
    assert "--replicas" not in sweep  # the calibrated profile says one server by itself


def test_the_fit_is_one_server_replaying_the_benchs_requests(example):
    work = example["work"]
    profile = load_profile(work / "my-engine" / "profile.toml")
    assert profile.default_replicas == 1
    trace = read_trace(work / "my-engine" / "trace.parquet")
    assert trace.has_lengths and set(trace.req_output_tokens.tolist()) == {64}
    df = pl.read_parquet(work / _option(_sweep_args(), "--out") / "results.parquet")
    assert df["replicas"].unique().to_list() == [1]
    loads = [int(c) for c in _option(_sweep_args(), "--concurrency").split(",")]
    policies = _option(_sweep_args(), "--policies").split(",")
    assert df.height == len(loads) * len(policies) * 3
    # the requests are the bench's, not a chat distribution: 64 output tokens each
    assert (df["completed"] == df["num_requests"]).all()
    assert (df["total_output_tokens"] == 64 * df["completed"]).all()


def _check_answer(rows: list[dict[str, str]], policies: list[str], loads: list[int]) -> None:
    assert [r["load"] for r in rows] == [f"C = {c}" for c in loads]
    for r in rows:
        assert r["deploy"] in policies, r
        assert re.match(r"^[+-]\d+\.\d% tok/s/GPU, ", r["vs runner-up"]), r
        if r["deploy"] != "none":
            assert re.match(r"^[+-]\d+\.\d% tok/s/GPU", r["vs none"]), r
        assert "goodput" in r["ranked on"] and "goodput (req/s; tok/s/GPU)" in r
        assert r["verdict"].startswith(("clear: ", "tie within noise: ", "tie: ")), r
        if r["verdict"].startswith("tie within noise"):
            assert re.search(r"about [\d,]+ seeds per point would settle", r["verdict"]), r


def test_the_sweep_prints_the_answer_first(example):
    # what follows the progress bar (the doc's sweep is not --quiet)
    lines = [ln.strip() for ln in example["outputs"][-1].splitlines()
             if ln.strip() and not ln.startswith("sweep ")]
    assert lines[0] == f"{ANSWER} (TTFT <= 1000 ms and TPOT <= 200 ms)", lines[:3]


def test_the_report_opens_with_the_answer_in_headless_chromium(example, tmp_path):
    sweep = _sweep_args()
    page = example["work"] / _option(sweep, "--out") / "report.html"
    dom = rendered_dom(page, tmp_path / "chromium-profile")
    rendered = tables(dom)
    heading, rows = rendered[0]
    assert heading == ANSWER  # the first table the page shows
    loads = [int(c) for c in _option(sweep, "--concurrency").split(",")]
    _check_answer(rows, _option(sweep, "--policies").split(","), loads)
    # the page's scripts (the Plotly figures) ran without taking the table away
    assert tables(page.read_text(encoding="utf-8"))[0] == (heading, rows)
    assert dom.count("plotly-graph-div") >= 2 and "main-svg" in dom
