"""Frontier maths on hand-made points with known answers, and the HTML report."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import polars as pl
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from dspark_sim.errors import InputError
from dspark_sim.sim import frontier as fr
from dspark_sim.sim.frontier import (
    Front,
    compute_fronts,
    matched_throughput_gain,
    pareto_front,
    tier_gain,
    tier_throughput,
)
from dspark_sim.sim.report import build_report, read_vllm_results


# -- Pareto front --------------------------------------------------------------------------
def test_pareto_front_hand_made_points():
    pts = [(1.0, 10.0), (2.0, 8.0), (1.5, 7.0), (3.0, 3.0), (2.0, 8.0), (0.5, 9.0),
           (3.0, 2.0), (float("nan"), 99.0), (2.5, 3.0)]
    x, y = zip(*pts, strict=True)
    idx = pareto_front(x, y)
    assert [pts[i] for i in idx] == [(1.0, 10.0), (2.0, 8.0), (3.0, 3.0)]
    assert len(set(idx.tolist()) & {1, 4}) == 1  # one of the duplicates
    assert pareto_front([], []).size == 0
    assert pareto_front([5.0], [5.0]).tolist() == [0]


def brute_force_front(x, y) -> set[tuple[float, float]]:
    """Distinct finite (x, y) values no other finite point dominates (O(n^2))."""
    pts = [(a, b) for a, b in zip(x, y, strict=True) if math.isfinite(a) and math.isfinite(b)]
    return {p for p in pts
            if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in pts)}


COORD = st.one_of(st.integers(0, 6).map(float), st.sampled_from([math.nan, math.inf, -math.inf]),
                  st.floats(0, 6, allow_nan=False))


@given(st.lists(st.tuples(COORD, COORD), max_size=25))
@example([(1.0, 2.0), (1.0, 5.0), (1.0, 3.0)])  # ties on x: only the highest y survives
@example([(4.0, 1.0), (2.0, 1.0), (3.0, 1.0)])  # ties on y: only the highest x survives
@example([(2.0, 2.0), (2.0, 2.0), (1.0, 3.0), (1.0, 3.0)])  # duplicates: one of each
def test_pareto_front_equals_brute_force(pts):
    x = [p[0] for p in pts]
    y = [p[1] for p in pts]
    idx = pareto_front(x, y)
    got = [(x[i], y[i]) for i in idx.tolist()]
    assert len(got) == len(set(got))  # of duplicates one is kept
    assert set(got) == brute_force_front(x, y)
    # ordered by increasing x, so y strictly decreases
    assert all(a[0] < b[0] and a[1] > b[1] for a, b in zip(got, got[1:], strict=False))
    f = Front.from_points("f", x, y)
    assert list(zip(f.x.tolist(), f.y.tolist(), strict=True)) == got
    # the front's throughput at a tier is the best y of any point at or beyond that x
    for t in sorted({p[0] for p in got}):
        best = max(b for a, b in zip(x, y, strict=True)
                   if math.isfinite(a) and math.isfinite(b) and a >= t)
        assert f.throughput_at(t) == best


def test_front_interpolates_and_never_extrapolates():
    f = Front.from_points("a", [10, 20, 40], [300, 200, 100])
    assert f.throughput_at(15) == pytest.approx(250.0)
    assert f.throughput_at(30) == pytest.approx(150.0)
    assert f.throughput_at(5) == pytest.approx(300.0)  # below the front: its best
    assert f.throughput_at(40.5) is None
    assert f.interactivity_at(250) == pytest.approx(15.0)
    assert f.interactivity_at(350) is None and f.interactivity_at(50) is None
    assert f.x_range == (10.0, 40.0) and f.y_range == (100.0, 300.0)


def _line(a: float, b: float, xs) -> tuple[list[float], list[float]]:
    xs = list(map(float, xs))
    return xs, [a + b * x for x in xs]


# Front A: y = 1000 - 10 x on x in [20, 80] (y 800..200)
# Front B: y =  900 - 20 x on x in [ 5, 40] (y 800..100)
# At equal y: x_A / x_B = 2 (1000 - y) / (900 - y), gain(y) = 1 + 200 / (900 - y),
# over the overlap y in [200, 800]: min 1 + 2/7 at y = 200, max 3 at y = 800,
# mean 1 + ln(7) / 3.
A = Front.from_points("A", *_line(1000, -10, range(20, 81, 10)))
B = Front.from_points("B", *_line(900, -20, range(5, 41, 5)))


def test_matched_throughput_gain_on_linear_fronts():
    g = matched_throughput_gain(A, B, samples=4001)
    assert g["feasible"]
    assert g["y_lo"] == pytest.approx(200.0) and g["y_hi"] == pytest.approx(800.0)
    assert g["gain_min"] == pytest.approx(1 + 2 / 7)
    assert g["gain_max"] == pytest.approx(3.0)
    assert g["gain_at_lo"] == pytest.approx(1 + 2 / 7) and g["gain_at_hi"] == pytest.approx(3.0)
    assert g["gain_mean"] == pytest.approx(1 + math.log(7) / 3, rel=2e-3)
    back = matched_throughput_gain(B, A)
    assert back["gain_max"] == pytest.approx(1 / (2 + 2 / 7) - 1)  # ratio 16/7 inverted


@pytest.mark.parametrize("call,needle", [
    # numpy's own errors: a zero-size reduction, a negative count, a float count
    (lambda: matched_throughput_gain(A, B, samples=0), "samples must be a positive integer"),
    (lambda: matched_throughput_gain(A, B, samples=-1), "samples must be a positive integer"),
    (lambda: matched_throughput_gain(A, B, samples=2.5), "samples must be a positive integer"),
    # silently wrong: 'feasible' with y_hi NaN, or no floor at all
    (lambda: matched_throughput_gain(A, B, ceil_fraction=math.nan), "ceil_fraction must lie"),
    (lambda: matched_throughput_gain(A, B, floor_fraction=math.nan), "floor_fraction must"),
    (lambda: matched_throughput_gain(A, B, ceil_fraction=math.inf), "ceil_fraction must lie"),
    (lambda: matched_throughput_gain(A, B, floor_fraction=-0.5), "floor_fraction must lie"),
    (lambda: tier_throughput(A, math.nan), "tier must be a number"),  # 'ok', NaN tok/s
    (lambda: tier_gain(A, B, [math.nan]), "tier must be a number"),  # 'infeasible for A'
    (lambda: pareto_front([1.0, 2.0], [1.0]), "one length"),  # IndexError
])
def test_comparisons_refuse_arguments_that_would_give_nan_or_numpy_errors(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()


def test_a_baseline_at_zero_throughput_is_not_blamed_on_the_candidate():
    # both feasible at the tier, the baseline serving nothing there: no ratio, and the
    # text said "infeasible for A" although A serves 500 tok/s/GPU
    zero = Front.from_points("Z", [10, 50], [1.0, 0.0])
    (row,) = tier_gain(A, zero, [50])
    assert row["gain"] is None and row["text"].startswith("no gain: Z serves ")
    assert "A: 500 tok/s/GPU" in row["text"]


def test_matched_gain_without_overlap_says_why():
    lo = Front.from_points("lo", [10, 20], [100, 50])
    hi = Front.from_points("hi", [10, 20], [900, 800])
    g = matched_throughput_gain(lo, hi)
    assert not g["feasible"] and "do not overlap" in g["reason"]


def test_tiers_feasible_infeasible_and_below_sweep():
    r = tier_throughput(A, 50)
    assert r.status == "ok" and r.throughput == pytest.approx(500.0)
    r = tier_throughput(B, 50)
    assert r.status == "infeasible" and r.throughput is None
    assert r.max_interactivity == pytest.approx(40.0)
    assert "infeasible" in r.text()
    r = tier_throughput(A, 10)
    assert r.status == "below-sweep" and r.throughput == pytest.approx(800.0)
    rows = tier_gain(A, B, [30, 50, 100])
    assert rows[0]["gain"] == pytest.approx(700 / 300 - 1)
    assert rows[1]["gain"] is None and rows[1]["text"].startswith("infeasible for B")
    assert rows[2]["text"] == "infeasible for both"


# -- from sweep-shaped frames ------------------------------------------------------------------
def _frame() -> pl.DataFrame:
    rows = []
    for pol, (a, b), xs in (("confidence-async", (1000, -10), range(20, 81, 10)),
                            ("mtp1", (900, -20), range(5, 41, 5))):
        for i, x in enumerate(xs):
            for seed, jitter in ((0, -1.0), (1, 1.0)):
                rows.append({
                    "policy": pol, "policy_spec": pol, "profile_spec": "v4flash-h200",
                    "trace_spec": None, "seed": seed, "load_kind": "concurrency",
                    "load": float(256 >> i), "concurrency": 256 >> i, "qps": None,
                    "mean_concurrency": float(256 >> i) * 0.9,
                    fr.X: float(x) + jitter, fr.Y: a + b * float(x) - b * jitter,
                    "stable": True, "mean_verify_tokens_per_request_step": 2.0 if pol == "mtp1"
                    else 4.0 + i * 0.3, "spec_decode_acceptance_length": 1.9,
                    "verification_waste": 0.1 if pol == "mtp1" else 0.3,
                    "mean_draft_tokens_per_request_step": 1.0, "mean_decode_batch": 10.0,
                    "point_id": f"{pol}-{i}-{seed}",
                })
    # an unstable point that would dominate everything: excluded from the fronts
    rows.append(dict(rows[0], **{fr.X: 500.0, fr.Y: 5000.0, "stable": False, "seed": 2,
                                 "load": 999.0, "point_id": "bad"}))
    return pl.DataFrame(rows)


def test_compute_fronts_averages_seeds_and_drops_unstable():
    fronts = compute_fronts(_frame())
    assert list(fronts) == ["confidence-async", "mtp1"]
    a = fronts["confidence-async"]
    # seed jitter cancels in the mean: exactly the line again
    np.testing.assert_allclose(a.x, np.arange(20, 81, 10))
    np.testing.assert_allclose(a.y, 1000 - 10 * a.x)
    assert 500.0 not in a.x
    with_unstable = compute_fronts(_frame(), stable_only=False, seeds="all")
    assert with_unstable["confidence-async"].x.tolist() == [500.0]
    only = compute_fronts(_frame(), policies=["mtp1"])
    assert list(only) == ["mtp1"]


def test_headline_and_tables():
    h = fr.headline(_frame(), tiers=[30, 50])
    (e,) = h
    assert e["matched"]["gain_min"] == pytest.approx(1 + 2 / 7, rel=1e-3)
    assert e["matched"]["gain_max"] == pytest.approx(3.0, rel=1e-3)
    t30, t50 = e["tiers"]
    assert t30["gain"] == pytest.approx(700 / 300 - 1)
    assert t50["gain"] is None and "infeasible for mtp1" in t50["text"]
    md = fr.format_headline(h)
    assert "+129% to +300%" in md and "infeasible" in md
    budget = fr.budget_table(_frame())
    closed = budget.filter(pl.col("policy") == "mtp1")
    assert closed["concurrency_x"].to_list() == sorted(float(256 >> i) for i in range(8))
    assert (closed["mean_verify_tokens_per_request_step"] == 2.0).all()
    open_ = fr.budget_table(_frame().with_columns(pl.lit("qps").alias("load_kind")))
    assert open_["concurrency_x"].max() == pytest.approx(256 * 0.9)
    waste = fr.waste_table(_frame())
    assert set(waste["verification_waste"].to_list()) == {0.1, 0.3}


# -- report ------------------------------------------------------------------------------------
def _vllm_dir(tmp_path):
    d = tmp_path / "vllm"
    d.mkdir()
    (d / "c16.json").write_text(json.dumps({"output_throughput": 3200.0, "median_tpot_ms": 12.5,
                                            "max_concurrency": 16, "request_rate": "inf",
                                            "num_gpus": 8, "policy": "mtp1"}))
    (d / "c32.json").write_text(json.dumps({"output_throughput": 4800.0, "median_itl_ms": 20.0,
                                            "max_concurrency": 32, "request_rate": "inf"}))
    return d


def test_read_vllm_results(tmp_path):
    d = _vllm_dir(tmp_path)
    with pytest.raises(InputError, match="gpus"):
        read_vllm_results(d)
    v = read_vllm_results(d, gpus=16).sort("max_concurrency")
    assert v["interactivity"].to_list() == pytest.approx([80.0, 50.0])
    assert v["throughput_per_gpu"].to_list() == pytest.approx([400.0, 300.0])  # num_gpus wins
    assert v["label"].to_list() == ["mtp1", "vllm"]
    (d / "bad.json").write_text(json.dumps({"foo": 1}))
    with pytest.raises(InputError, match="bench serve"):
        read_vllm_results(d, gpus=16)
    # bench serve --append-result: two runs in one file, said as such
    two = d / "bad.json"
    two.write_text(json.dumps(GOOD_RESULT) + "\n" + json.dumps(GOOD_RESULT) + "\n")
    with pytest.raises(InputError, match=r"bad.json: line 2: a second JSON document; bench "
                                         r"serve --append-result"):
        read_vllm_results(d, gpus=16)
    with pytest.raises(InputError, match="no.json: result file or folder not found"):
        read_vllm_results(tmp_path / "no.json")
    with pytest.raises(InputError, match="/dev/null: is not a regular file"):
        read_vllm_results("/dev/null")


GOOD_RESULT = {"output_throughput": 3200.0, "median_tpot_ms": 12.5, "max_concurrency": 16,
               "request_rate": "inf", "num_gpus": 8}


@pytest.mark.parametrize("key", ["output_throughput", "median_tpot_ms", "num_gpus",
                                 "max_concurrency", "request_rate"])
@pytest.mark.parametrize("value", ["abc", [1], {"a": 1}, math.nan, math.inf, -1, 2**70, 1.5,
                                   True, 1e-320])  # 1000 / 1e-320 ms: infinite interactivity
def test_a_bench_serve_field_of_the_wrong_kind_is_one_line_naming_the_file(tmp_path, key,
                                                                           value):
    """Each field a report reads is a number where it must be one (float("abc"), int(inf),
    int(nan), an int past int64 in the polars column were tracebacks); a refusal names the
    file and the field, an acceptance gives finite figures. 1.5 is a fine rate or
    throughput, not a GPU or client count."""
    d = tmp_path / "vllm"
    d.mkdir()
    f = d / "r.json"
    f.write_text(json.dumps({**GOOD_RESULT, key: value}))  # NaN / Infinity: Python's JSON
    try:
        v = read_vllm_results(d, gpus=8)
    except InputError as exc:
        assert str(f) in str(exc) and key in str(exc) and "\n" not in str(exc), str(exc)
        return
    row = v.row(0, named=True)
    assert math.isfinite(row["interactivity"]) and math.isfinite(row["throughput_per_gpu"])
    assert row["num_gpus"] >= 1 and (row["max_concurrency"] or 1) >= 1
    # what may pass: a text rate (bench serve's "inf" is one), a fractional rate/throughput
    assert (key == "request_rate" and isinstance(value, str)) or (
        value == 1.5 and key in ("output_throughput", "request_rate", "median_tpot_ms")) or (
        value == 1e-320 and key in ("output_throughput", "request_rate")), \
        (key, value, row)


def test_a_folder_named_like_a_result_file_is_not_read_as_one(tmp_path):
    d = _vllm_dir(tmp_path)
    (d / "sub.json").mkdir()  # IsADirectoryError was a traceback
    assert read_vllm_results(d, gpus=16).height == 2


def test_report_is_self_contained_html(tmp_path):
    d = _vllm_dir(tmp_path)
    out = build_report(_frame(), tmp_path / "rep", tiers=[30, 50], vllm_results=d, gpus=16)
    assert out == tmp_path / "rep" / "report.html"
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>")
    assert '<script src="http' not in text  # plotly.js inlined, no CDN
    assert len(text) > 1_000_000 and text.count("Plotly.newPlot") == 4
    for s in ("confidence-async", "mtp1", "vLLM measured: mtp1", "infeasible for mtp1",
              "+129% to +300%", "Verification budget", "legendgroup", "Queueing"):
        assert s in text, s
    with pytest.raises(InputError):
        build_report(_frame().head(0), tmp_path / "empty.html")


# -- edges, found by mutation testing (tools/mutation.py) ------------------------------------
def test_front_ends_are_inside_and_the_tolerance_is_tiny():
    f = Front.from_points("a", [10, 20, 40], [300, 200, 100])
    assert f.throughput_at(40) == pytest.approx(100.0)  # the last point is feasible
    assert f.throughput_at(40 + 1e-13) == pytest.approx(100.0)
    assert f.throughput_at(40.01) is None
    assert f.interactivity_at(100) == pytest.approx(40.0)  # both ends of the range are in
    assert f.interactivity_at(300) == pytest.approx(10.0)
    assert f.interactivity_at(100 - 1e-13) == pytest.approx(40.0)
    assert f.interactivity_at(300 + 1e-13) == pytest.approx(10.0)
    assert f.interactivity_at(99.5) is None and f.interactivity_at(300.5) is None
    # the tolerance is closed: exactly 1e-12 outside still counts as inside
    assert f.throughput_at(f.x[-1] + 1e-12) == pytest.approx(100.0)
    assert f.interactivity_at(f.y_range[0] - 1e-12) == pytest.approx(40.0)
    assert f.interactivity_at(f.y_range[1] + 1e-12) == pytest.approx(10.0)
    # fronts and tier results are values: frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.label = "b"
    with pytest.raises(dataclasses.FrozenInstanceError):
        tier_throughput(f, 20).tier = 1.0
    empty = Front.from_points("e", [], [])
    assert empty.empty and empty.throughput_at(1.0) is None and empty.interactivity_at(1) is None


def test_matched_gain_edges():
    empty = Front.from_points("e", [], [])
    g = matched_throughput_gain(A, empty)
    assert not g["feasible"] and g["reason"] == "a front is empty"
    assert matched_throughput_gain(empty, A)["reason"] == "a front is empty"
    # ranges touching at one throughput: a single matched point, x_a / x_b there
    lo = Front.from_points("lo", [10, 20], [300, 200])
    hi = Front.from_points("hi", [5, 8], [400, 300])
    g = matched_throughput_gain(lo, hi)
    assert g["feasible"] and g["y_lo"] == g["y_hi"] == 300.0
    assert g["gain_min"] == g["gain_max"] == pytest.approx(10 / 8 - 1)
    # the mean is over `samples` evenly spaced throughputs (401 by default): by hand from
    # the analytic gain 1 + 200 / (900 - y) of the module's linear fronts A and B
    ys = np.linspace(200.0, 800.0, 401)
    assert matched_throughput_gain(A, B)["gain_mean"] == pytest.approx(
        float(np.mean(1 + 200 / (900 - ys))), rel=1e-9)


def test_tier_text_and_edges():
    empty = Front.from_points("e", [], [])
    r = tier_throughput(empty, 50)
    assert r.status == "infeasible" and r.text() == "infeasible (no points)"
    assert tier_throughput(B, 50).text() == "infeasible (max 40 tok/s/user)"
    at_first = tier_throughput(A, 20)  # exactly the front's lowest interactivity: measured
    assert at_first.status == "ok" and at_first.throughput == pytest.approx(800.0)
    assert at_first.text() == "800 tok/s/GPU"
    below = tier_throughput(A, 19)
    assert below.status == "below-sweep" and below.text() == "800 tok/s/GPU (>=, below sweep)"
    rows = tier_gain(A, B, [10])  # below A's sweep (A: 800 or more, B: 700): the text says so
    assert rows[0]["gain"] == pytest.approx(800 / 700 - 1)
    assert rows[0]["bound"] == "lower"  # A's throughput is a lower bound, so the gain is
    assert rows[0]["text"] == (">= +14% (its throughput a lower bound, A: the sweep has no "
                               "heavier load; extend the load range)")
    assert tier_gain(A, B, [30])[0]["text"] == f"{700 / 300 - 1:+.0%}"
    # a baseline at zero throughput has no gain; at 0.5 tok/s/GPU it has one
    zero = Front.from_points("z", [10, 30], [100, 0])
    assert tier_gain(A, zero, [30])[0]["gain"] is None
    half = Front.from_points("h", [10, 30], [100, 0.5])
    assert tier_gain(A, half, [30])[0]["gain"] == pytest.approx(700 / 0.5 - 1)


def test_aggregate_usable_and_labels():
    df = _frame()
    agg = fr.aggregate_seeds(df)
    assert agg.height == 15 + 1  # 7 + 8 points, plus the unstable outlier (its own load)
    assert set(agg["seeds"].to_list()) == {2, 1}
    assert agg["policy"].to_list()[:7] == ["confidence-async"] * 7  # first-seen order
    one_bad = df.with_columns(pl.when((pl.col("seed") == 1) & (pl.col("load") == 256.0))
                              .then(False).otherwise(pl.col("stable")).alias("stable"))
    agg = fr.aggregate_seeds(one_bad)
    assert agg.filter(pl.col("load") == 256.0)["stable"].to_list() == [False, False]
    single = df.head(1)
    assert fr.aggregate_seeds(single)["seeds"].to_list() == [1]
    no_seed = df.drop("seed")
    assert fr.aggregate_seeds(no_seed).equals(no_seed)
    # usable: finite x and y, stable unless asked otherwise; a missing stable flag is unstable
    bad = pl.DataFrame({"policy": ["p"] * 5, fr.X: [1.0, None, 3.0, float("nan"), 5.0],
                        fr.Y: [1.0, 2.0, None, 4.0, float("inf")],
                        "stable": [True, True, True, True, True]})
    assert fr.usable(bad)[fr.X].to_list() == [1.0]
    flags = pl.DataFrame({"policy": ["p"] * 3, fr.X: [1.0, 2.0, 3.0], fr.Y: [3.0, 2.0, 1.0],
                          "stable": [True, False, None]})
    assert fr.usable(flags)[fr.X].to_list() == [1.0]
    assert fr.usable(flags, stable_only=False).height == 3
    two = df.with_columns(pl.when(pl.col("seed") == 0).then(pl.lit("v4flash-b200"))
                          .otherwise(pl.col("profile_spec")).alias("profile_spec"))
    labels = fr.with_labels(two)["front_label"].unique().sort().to_list()
    assert "mtp1 | v4flash-b200" in labels and "mtp1 | v4flash-h200" in labels
    assert fr.with_labels(df)["front_label"].unique().sort().to_list() == [
        "confidence-async", "mtp1"]


def test_compute_fronts_order_and_one_point_groups():
    df = _frame()
    assert list(compute_fronts(df, policies=["mtp1", "confidence-async"])) == [
        "mtp1", "confidence-async"]
    one = df.filter((pl.col("policy") == "mtp1") & (pl.col("load") == 256.0)
                    & (pl.col("seed") == 0))
    fronts = compute_fronts(one, seeds="all")
    assert list(fronts) == ["mtp1"] and fronts["mtp1"].x.tolist() == [4.0]
    assert compute_fronts(df.head(0)) == {}
    with pytest.raises(InputError, match="policy"):
        compute_fronts(df.drop("policy"))
    # one point per group of a two-profile sweep (the group's first row is its label)
    two = df.filter(pl.col("load") == 256.0).with_columns(
        pl.when(pl.col("seed") == 0).then(pl.lit("v4flash-b200"))
        .otherwise(pl.col("profile_spec")).alias("profile_spec"))
    keys = list(compute_fronts(two, seeds="all"))
    assert keys == ["confidence-async | v4flash-b200",
                    "confidence-async | v4flash-h200",
                    "mtp1 | v4flash-b200", "mtp1 | v4flash-h200"]


def test_headline_defaults_and_missing_fronts():
    df = _frame()
    (e,) = fr.headline(df)
    assert [t["tier"] for t in e["tiers"]] == list(fr.DEFAULT_TIERS) == [80.0, 120.0]
    only_cand = df.filter(pl.col("policy") == "confidence-async")
    (e,) = fr.headline(only_cand)
    assert not e["matched"]["feasible"]
    assert e["matched"]["reason"] == "mtp1 not in the results (policies: confidence-async)"
    assert e["baseline_front"].empty and not e["candidate_front"].empty
    only_base = df.filter(pl.col("policy") == "mtp1")
    (e,) = fr.headline(only_base)
    assert e["candidate_front"].empty and not e["baseline_front"].empty
    # a typo in candidate= is named as such, with what the sweep did run
    (e,) = fr.headline(df, candidate="confidenc-async")
    assert e["matched"]["reason"] == ("confidenc-async not in the results (policies: "
                                      "confidence-async, mtp1)")
    unstable = df.with_columns(pl.lit(False).alias("stable"))
    (e,) = fr.headline(unstable)
    assert e["context"] == "" and e["tiers"] == [] and e["candidate_front"] is None
    reason = "confidence-async has no stable point; mtp1 has no stable point"
    assert e["matched"]["reason"] == reason
    assert f"no matched range: {reason}" in fr.format_headline([e])
    one_unstable = df.with_columns((pl.col("policy") == "mtp1").alias("stable"))
    (e,) = fr.headline(one_unstable)
    assert e["matched"]["reason"] == "confidence-async has no stable point"
    # stable points without the basis' figures are told apart from unstable ones
    mtp1 = pl.col("policy") == "mtp1"
    no_x = pl.when(mtp1).then(None).otherwise(pl.col(fr.X))
    (e,) = fr.headline(df.with_columns(no_x.alias(fr.X)))
    assert e["matched"]["reason"] == "mtp1 has no point with whole-run figures"
    steady = df.with_columns(no_x.alias(fr.STEADY + fr.X), pl.col(fr.Y).alias(fr.STEADY + fr.Y))
    (e,) = fr.headline(steady)
    assert e["basis"] == "steady" and e["matched"]["reason"] == (
        "mtp1 has no point with steady-state figures (every steady window too short: run "
        "more requests per point)")
    (e,) = fr.headline(steady, basis="whole")
    assert e["matched"]["feasible"]
    # a two-profile sweep: the reason names the context whose front is empty
    b200 = df.with_columns(pl.lit("v4flash-b200").alias("profile_spec"))
    two = pl.concat([df, b200.with_columns(pl.col("stable") & ~mtp1)])
    reasons = {e["context"]: e["matched"]["reason"] for e in fr.headline(two)}
    assert reasons == {"v4flash-b200": "mtp1 has no stable point (v4flash-b200)",
                       "v4flash-h200": None}


def test_budget_table_puts_unknown_concurrency_last():
    """Open-loop points take Little's-law concurrency; one without it sorts last."""
    df = _frame().with_columns(
        pl.lit("qps").alias("load_kind"),
        pl.when(pl.col("load") == 256.0).then(None).otherwise(pl.col("mean_concurrency"))
        .alias("mean_concurrency"))
    t = fr.budget_table(df).filter(pl.col("policy") == "mtp1")
    xs = t["concurrency_x"].to_list()
    assert xs[-1] is None and xs[:-1] == sorted(0.9 * float(256 >> i) for i in range(1, 8))


def test_metric_view_and_basis():
    df = pl.DataFrame({"policy": ["p", "q"], fr.X: [1.0, 2.0], fr.Y: [10.0, 20.0],
                       "steady_" + fr.X: [1.5, 2.5], "steady_" + fr.Y: [11.0, 21.0],
                       "steady_only": [7.0, 8.0], "other": [0.0, 0.0],
                       "cached_other": [5.0, 5.0]})  # a 7-letter prefix that is not steady_
    v = fr.metric_view(df)
    assert v["other"].to_list() == [0.0, 0.0] and "whole_other" not in v.columns
    assert v[fr.X].to_list() == [1.5, 2.5] and v[fr.Y].to_list() == [11.0, 21.0]
    assert v["whole_" + fr.X].to_list() == [1.0, 2.0] and v["whole_" + fr.Y].to_list() == [10.0, 20.0]
    assert "whole_only" not in v.columns and "only" not in v.columns  # no plain twin: left
    assert fr.metric_view(v).equals(v)  # idempotent
    assert fr.metric_view(df, "whole").equals(df)
    plain = df.select("policy", fr.X, fr.Y, "other")
    assert fr.metric_view(plain).equals(plain)  # nothing steady to swap in
    with pytest.raises(InputError, match="--basis"):
        fr.metric_view(df, "bogus")
    assert fr.basis_used(df) == "steady" and fr.basis_used(v) == "steady"
    assert fr.basis_used(df, "whole") == "whole" and fr.basis_used(plain) == "whole"
    assert fr.basis_used(df.drop("steady_" + fr.Y)) == "whole"  # needs both front columns
    with pytest.raises(InputError, match="--basis"):
        fr.basis_used(df, "bogus")


def test_short_windows_and_the_figures_row():
    df = _frame().with_columns(
        (pl.col("seed") == 1).and_(pl.col("load") == 256.0).alias("steady_window_short"))
    agg = fr.aggregate_seeds(df)
    short = agg.filter(pl.col("steady_window_short"))
    assert short["load"].to_list() == [256.0, 256.0]  # one short seed makes the point short
    rows = fr.headline_rows(fr.headline(_frame(), tiers=[30]))
    figures = [r for r in rows if r["metric"] == "figures"]
    assert len(figures) == 1 and figures[0]["value"] == fr.BASIS_TEXT["whole"]
    assert rows[-1] is figures[0]


def test_matched_gain_keeps_the_practical_band_of_the_overlap():
    # DSpark's "practical throughput levels": only [floor, ceil] x the overlap's top (800
    # tok/s/GPU for A and B). Floor 0.5, ceil 0.75: y in [400, 600], where the gain is
    # 1 + 200 / (900 - y) (see A and B above): 1.4 at 400, 1 + 2/3 at 600.
    g = matched_throughput_gain(A, B, floor_fraction=0.5, ceil_fraction=0.75)
    assert g["feasible"]
    assert g["y_lo"] == pytest.approx(400.0) and g["y_hi"] == pytest.approx(600.0)
    assert g["gain_at_lo"] == pytest.approx(1.4) and g["gain_at_hi"] == pytest.approx(1 + 2 / 3)
    # a floor under the fronts' own range changes nothing: the overlap starts at 200
    assert matched_throughput_gain(A, B, floor_fraction=0.1)["y_lo"] == pytest.approx(200.0)
    empty_band = matched_throughput_gain(A, B, floor_fraction=0.8, ceil_fraction=0.5)
    assert not empty_band["feasible"] and "do not overlap" in empty_band["reason"]


def test_select_lossy_reads_a_missing_flag_as_lossless():
    # results concatenated from runs with and without the `lossy` column carry nulls there:
    # those rows came from lossless runs
    df = pl.DataFrame({"policy": ["asd", "mtp1", "none"], "lossy": [True, None, False]})
    assert fr.select_lossy(df, False)["policy"].to_list() == ["mtp1", "none"]
    assert fr.select_lossy(df, True)["policy"].to_list() == ["asd"]
    assert fr.select_lossy(df, None).height == 3
    old = df.drop("lossy")  # results written before the column existed: all lossless
    assert fr.select_lossy(old, False).height == 3 and fr.select_lossy(old, True).height == 0


# -- what a reader of the headline is told ---------------------------------------------------------
def test_a_gain_with_a_lower_bound_is_a_bound_and_two_lower_bounds_give_none():
    """Below A's sweep (A: 800 or more; B: 700) the gain is at least +14 %; with the sides
    swapped at most -12 %; below both sweeps there is no gain (a ratio of two lower
    bounds). A bound reads as one (">= +14%", never a plain "+14%"), and the remedy
    follows from the cause each side gives."""
    (lower,) = tier_gain(A, B, [10])
    (upper,) = tier_gain(B, A, [10])
    (both,) = tier_gain(A, B, [3])
    assert (lower["bound"], upper["bound"]) == ("lower", "upper")
    assert lower["text"].startswith(">= +14% (its throughput a lower bound, A: ")
    assert upper["text"].startswith("<= -12% (its throughput a lower bound, A: ")
    assert both["gain"] is None and both["bound"] is None
    assert both["text"] == ("no gain: both fronts stay above this tier, so both throughputs "
                            "are lower bounds (A: the sweep has no heavier load; B: the sweep "
                            "has no heavier load; extend the load range)")
    (exact,) = tier_gain(A, B, [30])
    assert exact["bound"] == "exact" and exact["text"] == "+133%"


def test_a_tier_that_a_dominated_point_reached_is_exact():
    """(5, 250) is dominated by (10, 300): the front starts at 10 tok/s/user, but the
    sweep did fall to 5, so at 7 the most throughput is 300, measured, not a bound."""
    f = Front.from_points("d", [10, 20, 40, 5], [300, 200, 100, 250])
    assert f.x.tolist() == [10, 20, 40] and f.reach == 5.0
    r = tier_throughput(f, 7)
    assert (r.status, r.throughput) == ("ok", 300.0)
    assert tier_throughput(f, 4).status == "below-sweep"


def test_infeasible_tier_cell_says_it_once():
    (row,) = [r for r in fr.headline_rows(fr.headline(_frame(), tiers=[50]))
              if "50 tok/s/user" in r["metric"]]
    assert row["value"] == ("infeasible for mtp1 [confidence-async: 500 tok/s/GPU; mtp1: "
                            "infeasible (max 40 tok/s/user)]")


@pytest.mark.parametrize(("swept", "given", "want"), [
    (["mtp1", "fixed:3", "fixed:5", "confidence", "confidence-async", "none"], (None, None),
     ("confidence", "mtp1")),
    (["confidence-async", "mtp1"], (None, None), ("confidence-async", "mtp1")),
    (["confidence", "none"], (None, None), ("confidence", "none")),
    (["fixed:3", "fixed:5"], ("FIXED:3", None), ("fixed:3", "fixed:5")),
    (["mtp1", "dcut"], ("mtp1", None), ("mtp1", "dcut")),
    (["dcut", "dfly"], ("dcut", "dfly"), ("dcut", "dfly")),
])
def test_headline_pair_takes_the_defaults_then_the_one_other_policy(swept, given, want):
    assert fr.DEFAULT_CANDIDATE == "confidence" == fr.SimConfig().policy  # run's default
    assert fr.headline_pair(swept, *given) == (*want, None)


def test_headline_pair_says_when_a_side_is_open():
    assert fr.headline_pair(["fixed:3", "fixed:5", "mtp1"]) == (
        "confidence", "mtp1", "no candidate: confidence is not swept and no single other "
        "policy is left to take (name one with --candidate) (policies: fixed:3, fixed:5, mtp1)")
    assert fr.headline_pair(["dcut"])[1:] == (
        "mtp1", "no baseline: mtp1 is not swept and no single other policy is left to take "
        "(name one with --baseline) (policies: dcut)")
    assert fr.headline_pair(["dcut", "dfly"], "dfly", "mtp1")[2] == (
        "mtp1 not in the results (policies: dcut, dfly)")


def test_the_default_headline_compares_the_runs_default_policy():
    """A sweep of the README's default `confidence` against mtp1 gets its headline without
    naming either (it said "needs both confidence-async and mtp1"), and the report's
    table has no empty context column and a load column for the front points."""
    df = _frame().with_columns(pl.col("policy").str.replace("confidence-async", "confidence"))
    (e,) = fr.headline(df, tiers=[30])
    assert (e["candidate"], e["baseline"]) == ("confidence", "mtp1") and e["matched"]["feasible"]


def test_report_headline_and_front_table(tmp_path):
    df = _frame().with_columns(pl.col("policy").str.replace("confidence-async", "confidence"))
    text = build_report(df, tmp_path / "r.html", tiers=[30, 50]).read_text()
    head = text[text.index("<h2>Headline numbers"):text.index("<h2>Throughput vs")]
    assert "confidence vs mtp1" in head and "+133%" in head
    assert "<th>context</th>" not in head
    assert "infeasible for mtp1 [" in head and "infeasible for mtp1 (infeasible" not in head
    fronts = text[text.index("<h2>Front points"):text.index("<h2>Points left off")]
    assert "<th>front</th><th>load</th>" in fronts and "<td>C = 256</td>" in fronts
    only = build_report(df.filter(pl.col("policy") != "mtp1"), tmp_path / "o.html").read_text()
    assert "No headline comparison: no baseline: mtp1 is not swept" in only


def _left_out_frame() -> pl.DataFrame:
    """The frame's figures as steady ones (2,000 requests a point, 300 in each latency
    sample), except at C = 256, whose window held no latency sample."""
    heavy = pl.col("load") == 256.0
    return _frame().with_columns(
        pl.when(heavy).then(None).otherwise(pl.col(fr.X)).alias(fr.STEADY + fr.X),
        pl.col(fr.Y).alias(fr.STEADY + fr.Y),
        pl.when(heavy).then(0).otherwise(300).alias("steady_window_requests"),
        pl.lit(2000).alias("num_requests"))


def test_points_left_off_the_fronts_are_listed_with_why_and_the_remedy():
    left = fr.left_out(_left_out_frame())
    assert sorted(zip(left["policy"], left["load"], left["seed"], left["reason"],
                      strict=True)) == [
        ("confidence-async", 256.0, 0, "too few requests"),
        ("confidence-async", 256.0, 1, "too few requests"),
        ("confidence-async", 999.0, 2, "unstable"),
        ("mtp1", 256.0, 0, "too few requests"), ("mtp1", 256.0, 1, "too few requests")]
    few = left.filter(pl.col("reason") == "too few requests").row(0, named=True)
    assert few["detail"] == "0 requests in the steady window's latency sample, of 2,000 run"
    assert "--requests-per-client K" in few["remedy"] and "--max-doublings D" in few["remedy"]
    assert fr.left_out(_left_out_frame(), stable_only=False)["reason"].to_list().count(
        "unstable") == 0
    no_window = _left_out_frame().with_columns(pl.lit(None, pl.Float64).alias(fr.STEADY + fr.Y),
                                               pl.lit("no steady state").alias(
                                                   "steady_window_note"))
    assert set(fr.left_out(no_window)["detail"]) >= {"no steady state"}
    assert set(fr.left_out(no_window)["reason"]) == {"no steady window"}


def test_a_front_cut_short_by_too_few_requests_says_so_not_extend_the_load_range():
    """With C = 256 left off for too few requests, confidence-async's front starts at
    ~30 tok/s/user and mtp1's at ~10: at 20 the gain is a lower bound and the row says
    why (the heavier loads left off) and what to do (more requests, not more load); at 5
    neither front falls to the tier: no gain. The headline lists the points it lost."""
    (e,) = fr.headline(_left_out_frame(), tiers=[20, 5])
    t20, t5 = e["tiers"]
    assert t20["bound"] == "lower" and t20["text"].startswith(">= ")
    assert ("confidence-async: heavier loads (C = 256, C = 999) left off, too few requests; "
            "run more requests per point (--requests-per-client, --max-doublings)") in t20["text"]
    assert "extend the load range" not in t20["text"]
    assert t5["gain"] is None and t5["text"].startswith("no gain: both fronts stay above")
    rows = {r["metric"]: r["value"] for r in fr.headline_rows([e])}
    listed = rows["points left off the fronts, confidence-async vs mtp1"]
    assert listed.startswith("confidence-async at C = 256: too few requests, 2 seeds (0 "
                             "requests in the steady window's latency sample, of 2,000 run)")
    assert "confidence-async at C = 999: unstable (requests unfinished, or the queue grew)" in listed
    assert "mtp1 at C = 256: too few requests, 2 seeds" in listed


def test_the_report_lists_every_point_left_off(tmp_path):
    text = build_report(_left_out_frame(), tmp_path / "r.html").read_text()
    assert "5 left off the fronts in all" in text
    section = text[text.index("<h2>Points left off"):text.index("<h2>Configuration")]
    assert section.count("<td>too few requests</td>") == 4
    assert section.count("<td>unstable</td>") == 1
