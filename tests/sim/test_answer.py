"""The per-load answer (frontier.answer): the best policy per load, its gains, goodput under
SLOs, and a tie called a tie within measured noise; one run per point; SLA tiers from the
data; measured stars in colours of their own."""

import math

import polars as pl
import pytest

from dspark_sim.sim import frontier as fr
from dspark_sim.sim import report as rp


def _rows(policy: str, thr: list[float], *, load: float = 8.0, inter: float = 50.0,
          requests: int = 1000, rse: float | None = None, **extra) -> list[dict]:
    """One closed-loop row per seed with the given throughputs per GPU."""
    return [{"policy": policy, "policy_spec": policy, "profile_spec": "p", "trace_spec": None,
             "load_kind": "concurrency", "load": load, "concurrency": int(load),
             "arrival": "closed", "seed": i, "mean_verify_tokens_per_request_step": 2.0,
             "verification_waste": 0.1, "median_ttft_ms": 100.0, "p90_ttft_ms": 150.0,
             "median_e2el_ms": 900.0, "p90_e2el_ms": 1200.0,
             "point_id": f"{policy}-{load:g}-{i}-{requests}", "stable": True,
             "num_requests": requests, "completed": requests,
             "median_interactivity": inter, "output_throughput_per_gpu": t,
             "output_throughput": 4 * t, "request_throughput": t / 100,
             "steady_output_throughput_rse": rse} | extra
            for i, t in enumerate(thr)]


def _frame(*groups: list[dict]) -> pl.DataFrame:
    return pl.DataFrame([r for g in groups for r in g], infer_schema_length=None)


def test_two_policies_within_noise_are_a_tie_that_says_how_many_seeds_settle_it():
    df = _frame(_rows("none", [80, 81, 79]), _rows("fixed:3", [100, 104, 96]),
                _rows("fixed:2", [101, 95, 103]))
    (row,) = fr.answer(df)
    assert row["rank"] == "throughput"  # a closed loop without SLOs
    assert {row["best"], row["runner_up"]} == {"fixed:3", "fixed:2"}
    assert row["tie"] is True
    # the gap (0.33 tok/s/GPU) inside a 95 % interval of several tok/s/GPU: seeds to
    # settle it grow as (half-width / gap)^2
    want = math.ceil(3 * (row["half_width"] / row["diff"]) ** 2)
    assert f"about {want:,} seeds per point" in row["verdict"]
    assert row["verdict"].startswith("tie within noise")
    # the gain over no speculation is still given
    assert row["gain_throughput_vs_none"] == pytest.approx(100 / 80 - 1, abs=0.01)


def test_a_clear_winner_is_called_clear():
    df = _frame(_rows("none", [80, 81, 79]), _rows("fixed:3", [150, 152, 149]),
                _rows("fixed:2", [100, 101, 99]))
    (row,) = fr.answer(df)
    assert (row["best"], row["runner_up"], row["tie"]) == ("fixed:3", "fixed:2", False)
    assert row["verdict"].startswith("clear: fixed:3 over fixed:2 by +50.3%")
    assert row["gain_throughput_vs_runner_up"] == pytest.approx(451 / 300 - 1)
    text = fr.format_answer([row])
    assert "| C = 8 | fixed:3 |" in text


def test_one_seed_uses_the_runs_batch_means_error_and_names_requests_to_settle():
    df = _frame(_rows("fixed:3", [101], rse=0.02), _rows("fixed:2", [100], rse=0.02))
    (row,) = fr.answer(df)
    assert row["tie"] is True
    assert "1 seed, the runs' own batch-means error" in row["verdict"]
    factor = (row["half_width"] / row["diff"]) ** 2
    assert f"({math.ceil(1000 * factor):,})" in row["verdict"]  # of the 1,000 requests run
    # no measured error at all: the noise is said to be unmeasured, not guessed
    (bare,) = fr.answer(_frame(_rows("fixed:3", [101]), _rows("fixed:2", [100])))
    assert bare["tie"] is None and "noise not measured" in bare["verdict"]


def _sample(ttft_ms: float, n: int = 200) -> dict:
    return {"sample_arrival_s": [float(i) for i in range(n)],
            "sample_ttft_ms": [ttft_ms] * n, "sample_tpot_ms": [10.0] * n,
            "sample_output_tokens": [100.0] * n}


def test_goodput_ranks_a_policy_that_meets_the_slo_over_one_with_more_tokens():
    # none serves more tokens per GPU but its TTFT misses the SLO
    df = _frame(_rows("none", [200, 201, 199], **_sample(2700.0)),
                _rows("fixed:3", [190, 191, 189], **_sample(500.0)))
    (plain,) = fr.answer(df)
    assert plain["best"] == "none"
    slo = fr.Slo(ttft_ms=1000, tpot_ms=100)
    (row,) = fr.answer(df, slo=slo, basis="whole")
    assert (row["best"], row["runner_up"], row["rank"]) == ("fixed:3", "none", "goodput")
    assert row["estimates"]["none"][fr.GOODPUT].mean == 0.0
    assert row["estimates"]["fixed:3"][fr.GOODPUT].mean == pytest.approx(1.9)
    assert row["gain_goodput_vs_none"] is None  # over nothing: no ratio
    (table,) = fr.answer_rows([row])
    assert table["goodput (req/s; tok/s/GPU)"].startswith("1.90")
    g = fr.with_goodput(df, slo, basis="whole")
    assert g.filter(pl.col("policy") == "none")[fr.GOODPUT_Y].to_list() == [0.0] * 3
    assert g.filter(pl.col("policy") == "fixed:3")[fr.GOODPUT_Y].to_list() == [190, 191, 189]
    # goodput is an axis a front can use
    fronts = fr.compute_fronts(g, y=fr.GOODPUT_Y, basis="whole")
    assert fronts["fixed:3"].y_range[1] == pytest.approx(190)


def test_unstable_and_lossy_policies_do_not_compete():
    df = _frame(_rows("fixed:3", [300], stable=False), _rows("asd", [400], lossy=True),
                _rows("none", [100]))
    (row,) = fr.answer(df)
    assert row["best"] == "none" and row["unstable"] == ["fixed:3"]
    assert "only policy" in row["verdict"] and "unstable: fixed:3" in row["verdict"]


def test_a_rerun_of_one_point_is_drawn_once_and_the_other_run_listed():
    first = _rows("none", [100], requests=500)
    again = _rows("none", [110], requests=2000)
    other = _rows("fixed:3", [150], requests=500)
    kept, gone = fr.one_run_per_point(_frame(first, again, other))
    assert sorted(kept["point_id"].to_list()) == ["fixed:3-8-0-500", "none-8-0-2000"]
    assert gone["point_id"].to_list() == ["none-8-0-500"]
    assert gone["reason"].to_list() == ["superseded"]
    assert "none-8-0-2000 with 2000 requests (this one 500)" in gone["detail"][0]


def test_default_sla_tiers_lie_inside_the_data():
    df = _frame(_rows("none", [100], inter=15.0), _rows("fixed:3", [90], inter=25.0))
    tiers = fr.default_tiers(df, basis="whole")
    assert len(tiers) == 2 and all(15 < t < 25 for t in tiers)


def test_measured_stars_have_colours_and_shapes_of_their_own(tmp_path):
    df = _frame(*(_rows(p, [100 + 10 * i], inter=20.0 + i) for i, p in enumerate(
        ["none", "fixed:3", "vllm-adaptive", "confidence"])))
    vllm = pl.DataFrame({"label": ["vllm-adaptive", "ngram"], "file": ["a.json", "b.json"],
                         "interactivity": [20.0, 21.0], "throughput_per_gpu": [90.0, 95.0],
                         "max_concurrency": [8, 8], "request_rate": [None, None]})
    fig = rp.fronts_figure(df, tiers=[20], vllm=vllm, basis="whole")
    lines = {t.line.color for t in fig.data if t.mode == "lines"}
    stars = [t for t in fig.data if t.name.startswith("vLLM measured")]
    assert len(stars) == 2
    assert not {t.marker.color for t in stars} & (lines | set(rp.PALETTE))
    assert len({t.marker.symbol for t in stars}) == 2
    assert all("star" in t.marker.symbol or t.marker.symbol == "hexagram" for t in stars)


def test_the_report_opens_with_the_answer_and_draws_goodput_fronts(tmp_path):
    df = _frame(_rows("none", [200, 201, 199], **_sample(2700.0)),
                _rows("fixed:3", [190, 191, 189], **_sample(500.0)),
                _rows("none", [100], requests=100))  # an older, smaller run of none's seed 0
    page = rp.build_report(df, tmp_path / "r.html", slo=fr.Slo(ttft_ms=1000), basis="whole")
    text = page.read_text()
    assert text.index("Which policy at which load") < text.index("Headline numbers")
    assert "Goodput vs interactivity" in text
    assert "7 sweep points in all and 1 superseded" in text
    assert "superseded</td>" in text


def _open(policy: str, *, stable: bool, inter: float | None, load: float = 80.0) -> list[dict]:
    """One open-loop point: a steady window too short for a latency sample leaves its
    median interactivity null while its throughput and stability are measured."""
    return [r | {"load_kind": "qps", "qps": load, "concurrency": None, "arrival": "poisson",
                 "median_interactivity": inter, "steady_window_requests": 0}
            for r in _rows(policy, [1000.0 if stable else 900.0], load=load, requests=200,
                           stable=stable)]


def test_a_stable_policy_without_the_ranking_figure_holds_the_load_and_says_why():
    # the tiny preset at 80 req/s: none and fixed:3 unstable, confidence stable but its
    # 0.8 s steady window held no request's latency: it holds the load, and is named
    df = _frame(_open("none", stable=False, inter=None),
                _open("fixed:3", stable=False, inter=None),
                _open("confidence", stable=True, inter=None))
    (row,) = fr.answer(df)
    assert row["best"] == "confidence" and row["rank"] == "interactivity"
    assert row["verdict"].startswith("confidence is the only policy that holds this load, "
                                     "without a median interactivity figure (too few requests")
    assert "--num-requests" in row["verdict"] and "unstable: none, fixed:3" in row["verdict"]
    assert fr.answer_rows([row])[0]["deploy"] == "confidence"
    # two such policies cannot be ranked: neither is picked, both are named
    (two,) = fr.answer(_frame(_open("fixed:3", stable=True, inter=None),
                              _open("confidence", stable=True, inter=None)))
    assert two["best"] is None
    assert two["verdict"].startswith("cannot rank: fixed:3, confidence hold this load but "
                                     "have no median interactivity figure")
    # beside a ranked winner, one without the figure is said to hold the load too
    (mixed,) = fr.answer(_frame(_open("fixed:3", stable=True, inter=None),
                                _open("confidence", stable=True, inter=200.0)))
    assert mixed["best"] == "confidence" and mixed["runner_up"] is None
    assert "confidence is the only policy with a median interactivity figure" in \
        mixed["verdict"]
    assert "fixed:3 also holds this load but without" in mixed["verdict"]


def test_a_goodput_gain_over_a_policy_meeting_no_slo_is_said_in_words():
    df = _frame(_rows("none", [200, 201, 199], **_sample(2700.0)),
                _rows("fixed:3", [190, 191, 189], **_sample(500.0)))
    (row,) = fr.answer(df, slo=fr.Slo(ttft_ms=1000, tpot_ms=100), basis="whole")
    (table,) = fr.answer_rows([row])
    assert table["vs none"] == "-5.0% tok/s/GPU, none meets no request's SLOs (goodput 0)"
    assert table["vs runner-up"] == table["vs none"]
    # the verdict gives the gap in tok/s/GPU, not a ratio over zero
    assert row["verdict"].startswith("clear: fixed:3 over none by 190.0 ± ")
    assert "tok/s/GPU (none's goodput is 0)" in row["verdict"]
    # no policy meeting the SLOs: said so, not a gain
    (both,) = fr.answer(df, slo=fr.Slo(ttft_ms=100), basis="whole")
    assert "none and fixed:3 meet the SLOs on no request" in fr.answer_rows([both])[0]["vs runner-up"]
