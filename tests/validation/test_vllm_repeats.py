"""Repeats of a point: read, grouped, summarised (median, spread, noise floor), and what a
fit's Jacobian and the repeats say about its constants; results without --save-detailed
read with what stood in. Fast: no simulation (the fit on repeats is in test_vllm_loop)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dspark_sim.errors import InputError
from dspark_sim.validation.vllm_fit import (
    METRICS,
    read_bench_run,
    read_bench_runs,
    substitution_warnings,
    workload_file,
)
from dspark_sim.validation.vllm_repeats import (
    constant_uncertainty,
    constants_line,
    group_points,
    noise_floor,
    noise_line,
    points_markdown,
)

RECORDED = Path(__file__).parents[1] / "data" / "vllm-cpu" / "run-2" / "runs"


def _repeats(tmp_path: Path, name: str, scales=(1.0, 1.06, 0.97)) -> list[Path]:
    d = json.loads((RECORDED / name).read_text())
    out = []
    for n, scale in enumerate(scales, 1):
        e = {**d, "output_throughput": d["output_throughput"] * scale,
             "median_tpot_ms": d["median_tpot_ms"] / scale, "dspark_round": str(n)}
        p = tmp_path / f"{name[:-5]}.round{n}.json"
        p.write_text(json.dumps(e))
        out.append(p)
    return out


def test_repeats_group_into_one_point_at_the_median(tmp_path):
    files = _repeats(tmp_path, "ngram-k3-c4.json") + _repeats(tmp_path, "none-c4.json",
                                                              (1.0, 1.0, 1.0))
    runs = read_bench_runs([tmp_path])
    assert len(runs) == 6 and sorted(r.round for r in runs) == [1, 1, 2, 2, 3, 3]
    points = group_points(runs)
    spec = next(p for p in points if p.name == "ngram-k3@c4")
    base = json.loads((RECORDED / "ngram-k3-c4.json").read_text())
    assert spec.repeats == 3
    assert spec.median("output_throughput") == pytest.approx(base["output_throughput"])
    assert spec.spread("output_throughput") == pytest.approx(0.045, rel=1e-9)  # (1.06-.97)/2
    assert spec.run.measured["output_throughput"] == pytest.approx(base["output_throughput"])
    assert spec.run.measured["median_tpot_ms"] == pytest.approx(base["median_tpot_ms"])
    floor = noise_floor(points)
    assert floor["output_throughput"] == pytest.approx((0.045 + 0.0) / 2)
    assert floor["acceptance_length"] == 0.0  # tau is the same in every repeat here
    line = noise_line(points)
    assert line.startswith("Noise floor (median relative half-range over 2 points of 3 "
                           "repeats): output tok/s ±2.")
    table = points_markdown(points)
    assert "| ngram-k3@c4 | 3 |" in table and "±4.5%" in table
    assert files[0].name == "ngram-k3-c4.round1.json"


def test_the_same_file_twice_and_repeats_of_other_requests_are_refused(tmp_path):
    f = _repeats(tmp_path, "none-c1.json", (1.0,))[0]
    with pytest.raises(InputError, match="given twice") as exc:
        read_bench_runs([f, f])
    assert exc.value.where == str(f)
    other = json.loads((RECORDED / "none-c4.json").read_text())  # 16 requests, not 12
    (tmp_path / "odd.json").write_text(json.dumps({**other, "max_concurrency": 1}))
    with pytest.raises(InputError, match="a point's repeats must send the same requests") \
            as exc:
        read_bench_runs([tmp_path])
    assert "\n" not in str(exc.value)


def test_a_result_without_save_detailed_says_what_stood_in(tmp_path):
    d = json.loads((RECORDED / "ngram-k3-r0.5.json").read_text())
    for key in ("input_lens", "output_lens", "start_times", "itls", "ttfts"):
        d.pop(key, None)
    p = tmp_path / "bare.json"
    p.write_text(json.dumps(d))
    run = read_bench_run(p)
    assert len(run.substituted) == 3
    assert "every request at the mean" in run.substituted[0]
    assert "sent evenly at its 0.5 req/s" in run.substituted[1]
    assert "not each request's" in run.substituted[2]
    # open loop without send times: spaced at the rate, not all sent at once
    assert np.allclose(np.diff(run.send_s), 2.0)
    rows = [json.loads(x) for x in workload_file(run, tmp_path).read_text().splitlines()]
    assert rows[1]["timestamp"] == 2000.0
    (line,) = substitution_warnings([run, read_bench_run(RECORDED / "none-c1.json")])
    assert line.startswith(str(p)) and "--save-detailed" in line and "\n" not in line


def test_constant_uncertainty_flags_bounds_and_unidentified_constants():
    rng = np.random.default_rng(0)
    jac = rng.normal(size=(12, 4))
    jac[:, 3] = 0.0  # nothing the runs measure moves the fourth constant
    res = 0.05 * rng.normal(size=12)
    theta = np.array([70.0, 2.0, 1e-5, 3.0])
    unc = constant_uncertainty(jac, res, theta, ("a_ms", "b_ms", "c_ms", "d_ms"), [],
                               METRICS)
    assert unc["a_ms"]["flag"] == "" and 0 < unc["a_ms"]["relative_sd"] < 0.2
    assert unc["c_ms"]["flag"] == "at its bound 0"
    assert unc["d_ms"]["flag"] == "not identified" and unc["d_ms"]["relative_sd"] is None
    line = constants_line(unc, 4)
    assert line.startswith("a_ms 70 ±") and "c_ms 1e-05 (at its bound 0)" in line
    assert line.endswith("4 constants from 4 points; 2 not set by these runs")
    assert constants_line(unc, 3).endswith("fewer points than constants, some are set by "
                                           "their start, not by the runs")


def test_the_repeats_bootstrap_is_seeded_and_widens_the_uncertainty(tmp_path):
    _repeats(tmp_path, "none-c1.json", (1.0, 1.2, 0.8))
    _repeats(tmp_path, "none-c4.json", (1.0, 1.1, 0.9))
    points = group_points(read_bench_runs([tmp_path]))
    jac = np.array([[1.0, 0.2], [0.5, 0.1], [0.2, 0.0], [1.0, 1.0], [0.5, 0.4], [0.2, 0.1]])
    res = np.zeros(6)  # a perfect fit: all the uncertainty is the repeats'
    one = constant_uncertainty(jac, res, np.array([5.0, 1.0]), ("a", "b"), points, METRICS,
                               seed=1)
    again = constant_uncertainty(jac, res, np.array([5.0, 1.0]), ("a", "b"), points,
                                 METRICS, seed=1)
    assert one == again
    assert one["a"]["relative_sd"] > 0.01
    alone = constant_uncertainty(jac, res, np.array([5.0, 1.0]), ("a", "b"),
                                 [p for p in points][:0], METRICS)
    assert alone["a"]["relative_sd"] == 0.0  # n > p and a perfect fit, no repeats


def test_compare_without_the_servers_token_budget_names_the_option(tmp_path):
    """A measure folder whose manifest is missing (an interrupted run) gives the fit no
    step token budget: refused in one line naming the option, not guessed."""
    import shutil

    from input_checks import one_line_error
    from typer.testing import CliRunner

    from dspark_sim.cli import app
    from dspark_sim.validation.vllm_compare import load_engine

    src = Path(__file__).parents[1] / "data" / "vllm-cpu" / "run-2" / "runs"
    shutil.copytree(src, tmp_path / "m" / "runs")
    r = CliRunner().invoke(app, ["vllm", "compare", str(tmp_path / "m"),
                                 "--out", str(tmp_path / "o")])
    one_line_error(r, "--max-num-batched-tokens", "manifest.json")
    assert not (tmp_path / "o").exists()
    # the option supplies it
    assert load_engine(tmp_path / "m" / "manifest.json",
                       max_num_batched_tokens=1024).max_num_batched_tokens == 1024


def test_held_out_figures_are_held_to_the_bound_or_their_own_spread():
    """10 % on throughput and TPOT, 20 % on TTFT, widened to a point's measured spread
    where that is wider; fitted points and tau are not held to them."""
    import polars as pl

    from dspark_sim.validation.vllm_compare import Comparison

    rows = [("a@c1", "held-out", "output_throughput", 0.12, 0.15),  # spread covers it
            ("a@c1", "held-out", "median_tpot_ms", -0.12, 0.05),  # outside 10 %
            ("a@c1", "held-out", "median_ttft_ms", 0.15, None),  # inside 20 %
            ("a@c2", "held-out", "median_ttft_ms", -0.21, 0.02),  # outside 20 %
            ("a@c2", "held-out", "acceptance_length", 0.5, 0.0),  # not bounded
            ("b@c1", "fitted", "output_throughput", 0.5, 0.0)]  # fitted: not held out
    table = pl.DataFrame(rows, schema=["run", "split", "figure", "error", "spread"],
                         orient="row")
    got = Comparison(table=table, regimes=pl.DataFrame(), fit=None, split="").against_bounds()
    assert got.select("run", "figure", "within").rows() == [
        ("a@c1", "output_throughput", True), ("a@c1", "median_tpot_ms", False),
        ("a@c1", "median_ttft_ms", True), ("a@c2", "median_ttft_ms", False)]
    assert got["allowed"].to_list() == pytest.approx([0.15, 0.10, 0.20, 0.20])
