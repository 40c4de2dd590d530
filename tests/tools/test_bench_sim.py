"""benchmarks/bench_sim.py's merge of interleaved rounds: each figure keeps its fastest
run, figure by figure (the timing itself is the benchmark's, never a test's)."""

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_sim.py"
    spec = importlib.util.spec_from_file_location("bench_sim", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _res(standard_s, none_s, conf_s, step_us):
    return {"dspark_sim": "tree",
            "standard": {"cpu_s": standard_s, "steps": 10},
            "matched": {"none": {"cpu_s": none_s}, "confidence": {"cpu_s": conf_s}},
            "step": {"none@1": {"us_per_step": step_us}}}


def test_each_figure_keeps_its_own_fastest_round(bench):
    col: dict = {}
    bench.keep_best(col, _res(7.0, 2.0, 1.5, 9.0))
    bench.keep_best(col, _res(6.0, 2.5, 1.2, 9.5))
    bench.keep_best(col, _res(6.5, 1.9, 1.4, 8.0))
    assert col["standard"]["cpu_s"] == 6.0
    assert col["matched"]["none"]["cpu_s"] == 1.9
    assert col["matched"]["confidence"]["cpu_s"] == 1.2
    assert col["step"]["none@1"]["us_per_step"] == 8.0
    assert col["dspark_sim"] == "tree"


def test_a_round_without_a_task_keeps_the_figures_held(bench):
    col: dict = {}
    bench.keep_best(col, _res(7.0, 2.0, 1.5, 9.0))
    bench.keep_best(col, {"dspark_sim": "tree"})
    assert col["standard"]["cpu_s"] == 7.0 and col["step"]["none@1"]["us_per_step"] == 9.0


def test_rounds_below_one_are_refused(bench, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["bench_sim.py", "--rounds", "0", "--before", "none"])
    with pytest.raises(SystemExit, match="--rounds: need a whole number >= 1, got 0"):
        bench.main()
