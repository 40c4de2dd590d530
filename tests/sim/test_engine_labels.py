"""A sweep keeps each run's confidence source and whether the deployment's measured
drafter can run the policy (confidences, engine_can_run, engine_note), and the report and
the per-load answer label a policy it cannot run: still simulated, never recommended
while a runnable one holds the load, and named where it would rank higher."""

from __future__ import annotations

import json
from dataclasses import replace

import polars as pl
import pytest

from dspark_sim.sim import frontier as fr
from dspark_sim.sim.config import preset
from dspark_sim.sim.report import build_report, engine_rows
from dspark_sim.sim.sweep import build_points, run_points
from dspark_sim.traces.importers import import_vllm_counters
from dspark_sim.traces.schema import write_trace

NOTE = "simulated only: it ranks drafts by confidence and the measured drafter has none"


def _rows(policy: str, thr: float, *, can: bool = True, load: float = 8.0) -> list[dict]:
    return [{"policy": policy, "policy_spec": policy, "profile_spec": "p", "trace_spec": None,
             "load_kind": "concurrency", "load": load, "concurrency": int(load),
             "arrival": "closed", "seed": 0, "point_id": f"{policy}-{load:g}", "stable": True,
             "num_requests": 1000, "completed": 1000, "median_interactivity": 50.0,
             "output_throughput_per_gpu": thr, "output_throughput": 4 * thr,
             "request_throughput": thr / 100, "steady_output_throughput_rse": 0.01,
             "confidences": None if can else "synthetic:0.85 (--conf-source: assumed)",
             "engine_can_run": can, "engine_note": None if can else NOTE}]


def _frame(*groups: list[dict]) -> pl.DataFrame:
    return pl.DataFrame([r for g in groups for r in g], infer_schema_length=None)


def test_the_answer_recommends_the_best_runnable_policy_and_names_a_better_simulated_one():
    df = _frame(_rows("none", 80), _rows("fixed:3", 100), _rows("fixed:2", 90),
                _rows("confidence", 130, can=False))
    (row,) = fr.answer(df)
    assert row["best"] == "fixed:3" and row["runner_up"] == "fixed:2"
    assert row["undeployable_best"] == "confidence"
    assert row["undeployable_gain"] == pytest.approx(0.30)
    assert row["undeployable_note"] == NOTE
    assert "confidence would rank first (+30.0%) but is simulated only" in row["verdict"]
    (table,) = fr.answer_rows([row])
    assert table["deploy"] == "fixed:3"
    assert table["ranks higher, not deployable"] == "confidence (+30.0%)"
    # a runnable winner needs no such column
    (plain,) = fr.answer_rows(fr.answer(_frame(_rows("none", 80), _rows("fixed:3", 100))))
    assert "ranks higher, not deployable" not in plain


def test_with_nothing_runnable_the_pick_is_labelled_simulated_only():
    df = _frame(_rows("confidence", 130, can=False), _rows("vllm-adaptive", 120, can=False))
    (row,) = fr.answer(df)
    assert row["best"] == "confidence" and row["deployable"] is False
    assert fr.answer_rows([row])[0]["deploy"] == "confidence (simulated only: not deployable)"
    assert "can run none of these policies" in row["verdict"]
    # the only runnable policy beside simulated-only ones is the only deployable one
    (one,) = fr.answer(_frame(_rows("fixed:3", 100), _rows("confidence", 130, can=False)))
    assert one["verdict"].startswith("fixed:3 is the only deployable policy")


def test_results_from_before_the_columns_count_as_runnable():
    df = _frame(_rows("fixed:3", 100), _rows("fixed:2", 120)).drop(
        "engine_can_run", "engine_note", "confidences")
    (row,) = fr.answer(df)
    assert row["best"] == "fixed:2" and row["undeployable_best"] is None
    assert engine_rows(df) == []


@pytest.fixture(scope="module")
def ngram_sweep(tmp_path_factory):
    """A real sweep on an n-gram drafter's trace (it proposes at ~36 % of steps and has
    no confidence head): fixed:3 runs with it; confidence with assumed confidences and
    vLLM's adaptive verification do not."""
    tmp = tmp_path_factory.mktemp("ngram")
    bench = {"completed": 8, "total_output_tokens": 512, "spec_decode_num_drafts": 108,
             "spec_decode_draft_tokens": 320, "spec_decode_accepted_tokens": 204,
             "spec_decode_per_position_acceptance_rates": [0.7407, 0.6204, 0.5278],
             "spec_decode_acceptance_length": 2.889}
    (tmp / "bench.json").write_text(json.dumps(bench))
    write_trace(import_vllm_counters(tmp / "bench.json", requests=64, positions=512, seed=0),
                tmp / "ngram.parquet")
    cfg = preset("tiny")
    cfg = replace(cfg, trace=str(tmp / "ngram.parquet"), conf_source="synthetic:0.85",
                  workload=replace(cfg.workload, num_requests=40))
    points = build_points(cfg, concurrency=[1, 8],
                          policies=["fixed:3", "confidence", "vllm-adaptive"])
    out = tmp / "sweep"
    return out, run_points(points, out=out, executor="serial", progress=False)


def test_sweep_rows_keep_the_confidence_source_and_what_the_engine_can_run(ngram_sweep):
    out, df = ngram_sweep
    assert df.schema["confidences"] == pl.Utf8 and df.schema["engine_note"] == pl.Utf8
    assert df.schema["engine_can_run"] == pl.Boolean
    by = {p: g.row(0, named=True) for (p,), g in df.group_by("policy")}
    assert by["fixed:3"]["engine_can_run"] is True and by["fixed:3"]["confidences"] is None
    for pol in ("confidence", "vllm-adaptive"):
        assert by[pol]["engine_can_run"] is False
        assert by[pol]["confidences"].startswith("synthetic:0.85 (--conf-source")
        assert by[pol]["engine_note"].startswith("simulated only")
    # a point file of a policy reading no confidences stacks with the others as text
    one = pl.read_parquet(next((out / "points").glob("*.parquet")))
    assert one.schema["confidences"] == pl.Utf8


def test_the_report_labels_a_policy_the_deployment_cannot_run(ngram_sweep, tmp_path):
    out, df = ngram_sweep
    page = build_report(out, tmp_path / "r.html").read_text()
    assert "Policies and the measured drafter" in page
    assert "confidence (simulated only)" in page  # its front's legend entry
    assert "SIMULATED ONLY" in page  # each of its points' hover
    rows = {r["policy"]: r for r in engine_rows(df)}
    assert rows["fixed:3"]["runs in the deployment's engine"] == "yes"
    assert rows["vllm-adaptive"]["runs in the deployment's engine"] == "no: simulated only"
    assert "drafter method" in rows["vllm-adaptive"]["note"]  # it needs vLLM's dspark method
    # the per-load answer never recommends what the deployment cannot run
    for row in fr.answer(fr.metric_view(df)):
        assert row["best"] == "fixed:3"
