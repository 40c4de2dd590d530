"""Each speculative setting replays its own measured per-request acceptance in `vllm
compare` and `calibrate vllm` (acceptance/<setting>.jsonl, vllm measure's pass), bench
requests matched to their rows although the benchmark shuffles the prompts; without the
file, the pooled counters stand in, said in one warning line. The measured folder is the
stand-in server's (tests/fake_vllm.py): its bench client shuffles the prompt file as
vLLM's does and reports the acceptance counters of the steps its server gives each
prompt, so a per-request replay must reproduce them exactly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dspark_sim.cli import app
from dspark_sim.traces.schema import read_trace
from dspark_sim.validation.vllm_acceptance import match_rows, setting_traces
from dspark_sim.validation.vllm_compare import compare, load_engine, markdown
from dspark_sim.validation.vllm_fit import read_bench_runs
from dspark_sim.validation.vllm_live import LiveConfig, measure, parse_settings

FAKE = Path(__file__).parents[1] / "fake_vllm.py"
SPLIT = "none,ngram-k3@c1,ngram-k3@c4"


def test_rows_match_by_prompt_length_then_text_whatever_the_order():
    # five prompts in file order; two share a length, one is sent twice
    row_len = np.array([30, 41, 41, 12, 57])
    row_text = ("a", "b", "c", "d", "e")
    # the bench sends them shuffled, counting one more token each (a BOS)
    sent = [2, 4, 0, 1, 3, 2]
    rows, miss = match_rows(row_len[sent] + 1, [row_text[i] for i in sent], row_len, row_text)
    assert rows.tolist() == sent and not miss.any()
    # without texts, equal lengths go to the least-used row in file order
    rows, _ = match_rows(row_len[[2, 1]], None, row_len, row_text)
    assert sorted(rows.tolist()) == [1, 2]
    # a length no response has is flagged, not paired with a stranger
    rows, miss = match_rows(np.array([30, 99]), None, row_len, row_text)
    assert rows.tolist() == [0, -1] and miss.tolist() == [False, True]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A measured folder: none and n-gram k = 1, 3, 5 at C = 1 and 4, one round, with the
    acceptance pass of every speculative setting."""
    tmp = tmp_path_factory.mktemp("live")
    wrapper = tmp / "python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    wrapper.chmod(0o755)
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = LiveConfig(python=wrapper, model_dir=model,
                     settings=parse_settings("none,ngram:1,ngram:3,ngram:5"),
                     concurrencies=(1, 4), rates=(), startup_timeout_s=60, rounds=1)
    out = tmp / "run"
    measure(cfg, out)
    return out


def test_every_setting_replays_its_own_measured_trace_and_reproduces_vllms_tau(measured):
    runs = read_bench_runs([measured / "runs"])
    cmp = compare(runs, engine=load_engine(measured / "manifest.json"), split=SPLIT)
    assert cmp.warnings == ()
    assert set(cmp.acceptance) == {"ngram-k1", "ngram-k3", "ngram-k5"}
    assert all(v.startswith("measured per request") for v in cmp.acceptance.values())
    # fitted and held out alike, every k replays its own steps: vLLM's tau, exactly
    tau = cmp.table.filter(cmp.table["figure"] == "acceptance_length")
    assert tau.height == 6
    assert np.abs(tau["error"].to_numpy()).max() < 1e-9
    assert set(tau.filter(tau["split"] == "held-out")["setting"]) == {"ngram-k1", "ngram-k5"}
    # k = 5 is measured at its own length, not extrapolated from the fitted k = 3
    traces = cmp.fit.traces
    assert {s: m.trace.gamma_max for s, m in traces.measured.items()} == {
        "ngram-k1": 1, "ngram-k3": 3, "ngram-k5": 5}
    assert traces.pooled is None
    assert cmp.fit.trace.gamma_max == 3  # the written trace: the largest fitted k's
    assert "**Acceptance:** ngram-k1, ngram-k3, ngram-k5 replay their own measured" in \
        markdown(cmp)


def test_shuffled_bench_requests_replay_the_rows_of_their_own_prompts(measured):
    runs = [r for r in read_bench_runs([measured / "runs"]) if r.k]
    traces = setting_traces(runs, runs)
    for r in runs:
        m = traces.measured[r.setting]
        rows = traces.rows[r.path]
        assert [m.texts[i] for i in rows] == list(r.generated_texts)
        assert rows.tolist() != list(range(len(rows)))  # the bench's order is not the file's


def test_a_missing_acceptance_file_falls_back_to_pooled_counters_in_one_warning(measured,
                                                                               tmp_path):
    import shutil

    folder = tmp_path / "run"
    shutil.copytree(measured, folder)
    (folder / "acceptance" / "ngram-k5.jsonl").unlink()
    runs = read_bench_runs([folder / "runs"])
    cmp = compare(runs, engine=load_engine(folder / "manifest.json"), split=SPLIT)
    (warning,) = cmp.warnings
    assert str(folder / "acceptance" / "ngram-k5.jsonl") in warning
    assert "ngram-k5 replays the pooled counters of ngram-k3@c1, ngram-k3@c4, positions " \
           "4-5 extrapolated from k = 3" in warning and "\n" not in warning
    assert cmp.acceptance["ngram-k5"].startswith("pooled counters")
    assert cmp.acceptance["ngram-k1"].startswith("measured")
    tau = cmp.table.filter(cmp.table["figure"] == "acceptance_length")
    k1 = tau.filter(tau["setting"] == "ngram-k1")["error"].abs().max()
    assert k1 < 1e-9  # the settings still measured replay exactly


def test_the_commands_use_the_measured_folder_and_say_what_they_replayed(measured, tmp_path):
    r = CliRunner().invoke(app, ["vllm", "compare", str(measured), "--out",
                                 str(tmp_path / "cmp"), "--fit", SPLIT])
    assert r.exit_code == 0, r.output
    assert "warning" not in r.output and "replay their own measured" in r.output
    head = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert set(head["acceptance"]) == {"ngram-k1", "ngram-k3", "ngram-k5"}
    # calibrate on the runs/ folder: the acceptance/ beside it is found
    r = CliRunner().invoke(app, ["calibrate", "vllm", str(measured / "runs"), "--out",
                                 str(tmp_path / "cal"), "--max-num-seqs", "64",
                                 "--max-num-batched-tokens", "1024"])
    assert r.exit_code == 0, r.output
    fit = json.loads((tmp_path / "cal" / "fit.json").read_text())
    assert all(v.startswith("measured") for v in fit["acceptance"].values())
    # the trace it writes is the largest k's, as measured (no proposal kept as its own state)
    trace = read_trace(tmp_path / "cal" / "trace.parquet")
    assert trace.gamma_max == 5 and (trace.draft_tokens == 0).any()
