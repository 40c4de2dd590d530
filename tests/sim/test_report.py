"""What a reader of the HTML report sees: titles that fit, a key to every marker, lines
that do not hide each other, sections that are not empty, and a steady-window rule that
reads as a sentence. Checked on the page's own figure JSON, without a browser."""

from __future__ import annotations

import json
import re

import numpy as np
import polars as pl

from dspark_sim.sim import frontier as fr
from dspark_sim.sim import report as rp
from dspark_sim.sim.metrics import StepSeries, steady_window

# At a desktop width (1,400 px window, the page's 1,200 px column) a 17-px plot title
# was cut after 153 characters; 120 leaves room for a narrower window.
MAX_TITLE_CHARS = 120
POLICIES = ("mtp1", "fixed:3", "confidence", "skip:0.9")


def _frame() -> pl.DataFrame:
    """Three lossless policies and a lossy one at four closed-loop loads; every policy
    has the same TTFT (as a disaggregated prefill gives), E2E differs."""
    rows = []
    for p, pol in enumerate(POLICIES):
        for i, c in enumerate((16, 64, 256, 1024)):
            x = 150.0 - 30 * i + 5 * p
            rows.append({
                "policy": pol, "policy_spec": pol, "profile_spec": "v4flash-h200",
                "trace_spec": None, "seed": 0, "load_kind": "concurrency", "load": float(c),
                "concurrency": c, "qps": None, "mean_concurrency": 0.9 * c,
                fr.X: x, fr.Y: 1000.0 + 8 * c ** 0.8 + 40 * p, "stable": True,
                "lossy": pol.startswith("skip"), "changed_token_fraction":
                0.01 if pol.startswith("skip") else 0.0,
                "mean_verify_tokens_per_request_step": 2.0 + p,
                "spec_decode_acceptance_length": 1.9 + p / 2, "verification_waste": 0.1 * p,
                "mean_draft_tokens_per_request_step": 1.0, "mean_decode_batch": 0.8 * c,
                "median_ttft_ms": 46.2, "p90_ttft_ms": 120.0 + c / 10,
                "median_e2el_ms": 800.0 + c * (1 + p), "p90_e2el_ms": 1500.0 + c * (2 + p),
                "deployment": "1 replica", "workload": "closed loop", "profile": "v4flash-h200",
                "trace": "builtin:dspark-synthetic", "point_id": f"{pol}-{c}"})
    return pl.DataFrame(rows)


def _vllm(tmp_path):
    d = tmp_path / "vllm"
    d.mkdir()
    for c, (tps, tpot) in {16: (3200.0, 7.0), 64: (8000.0, 11.0)}.items():
        (d / f"c{c}.json").write_text(json.dumps({
            "output_throughput": tps, "median_tpot_ms": tpot, "max_concurrency": c,
            "num_gpus": 4, "label": "confidence"}))
    return d


def _figures(page: str) -> list[tuple[list, dict]]:
    """Each ``Plotly.newPlot(id, data, layout, ...)`` call's data and layout."""
    dec = json.JSONDecoder()
    out = []
    for m in re.finditer(r'Plotly\.newPlot\(\s*"[^"]+",\s*', page):
        data, end = dec.raw_decode(page, m.end())
        layout, _ = dec.raw_decode(page, page.index("{", end))
        out.append((data, layout))
    return out


def _points(x) -> int:
    """How many values a trace's x holds (a list, or plotly's base64 typed array)."""
    if isinstance(x, dict):
        return len(x.get("bdata", ""))
    return len(x or [])


def _lines(text: str) -> list[str]:
    return re.sub(r"<[^>]+>", "\n", text.replace("<br>", "\n")).split("\n")


def test_the_front_title_fits_and_the_marker_key_is_under_the_plot():
    fig = rp.fronts_figure(_frame(), tiers=[80])
    title = fig.layout.title.text
    assert len(title) <= MAX_TITLE_CHARS and "diamond" not in title.lower(), title
    key = [a.text for a in fig.layout.annotations if "Markers:" in a.text]
    assert len(key) == 1 and all(len(s) <= MAX_TITLE_CHARS for s in _lines(key[0]))
    assert "Diamonds and dashed fronts: LOSSY" in key[0]
    lossless = rp.fronts_figure(_frame().filter(~pl.col("lossy")), tiers=[80])
    assert "Diamonds" not in " ".join(a.text for a in lossless.layout.annotations)


def test_measured_vllm_points_have_their_own_symbol_and_the_key_names_it(tmp_path):
    vllm = rp.read_vllm_results(_vllm(tmp_path))
    fig = rp.fronts_figure(_frame(), tiers=[80], vllm=vllm)
    measured = [t for t in fig.data if t.name.startswith("vLLM measured")]
    measured_symbols = {t.marker.symbol for t in measured}
    sweep_symbols = set()
    for t in fig.data:
        if not t.name.startswith("vLLM") and t.mode == "markers":
            sweep_symbols |= {s.removesuffix("-open")
                              for s in np.atleast_1d(t.marker.symbol).tolist()}
    assert "diamond" in sweep_symbols  # the lossy policy's
    assert not {s.removesuffix("-open") for s in measured_symbols} & sweep_symbols
    assert "Stars (in dark colours no policy line uses): measured vLLM" in " ".join(
        a.text.replace("<br>", " ") for a in fig.layout.annotations)


def test_coinciding_latency_lines_are_each_visible_and_named():
    fig = rp.latency_figure(_frame())
    ttft = [t for t in fig.data if t.yaxis in (None, "y") and "(p90)" not in t.name]
    order = [t.name for t in ttft]  # plot order
    assert sorted(order) == sorted(POLICIES)
    # drawn widest first: each coinciding line shows as a band round the next
    widths = [t.line.width for t in ttft]
    assert widths == sorted(widths, reverse=True) and len(set(widths)) == len(ttft)
    assert len({t.marker.symbol for t in ttft}) == len(ttft)
    titles = [a.text for a in fig.layout.annotations]
    assert "median and p90: all 4 policies coincide" in titles[0]
    assert "coincide" not in titles[1]  # E2E differs: nothing to say, plain widths
    e2e = [t for t in fig.data if t.yaxis == "y2" and "(p90)" not in t.name]
    assert {t.line.width for t in e2e} == {2}
    assert all(len(s) <= MAX_TITLE_CHARS for t in titles for s in _lines(t))


def test_the_coincidence_note_counts_where_the_names_do_not_fit():
    many = [f"policy-with-a-long-name-{i}" for i in range(6)]
    note = rp._coincidence_note({"median": [many], "p90": [many]}, 60)
    assert note == "median and p90: 6 policies coincide"
    sets = {"median": [["a", "b", "c"]], "p90": [["a", "b"]]}
    assert rp._coincidence_note(sets, 80, ["a", "b", "c", "d"]) == \
        "median: all but d coincide; p90: a = b coincide"


def test_steady_window_rule_reads_as_a_sentence():
    t = np.linspace(0.01, 10.0, 400)
    batch = np.minimum(t / 2.0, 1.0) * 50.0  # fills to 50 requests over 2 s
    w = steady_window(StepSeries.of(t, 0.025, decode_batch=batch, emitted_tokens=batch),
                      np.linspace(0.0, 10.0, 200), closed=False)
    assert "reaches 90 % of its steady level of 50.0 requests, at " in w.rule, w.rule
    assert not re.search(r"steady [0-9.]+ to", w.rule)
    assert "(cut at " in w.rule


def test_every_report_section_has_content_and_no_title_is_cut(tmp_path):
    page = rp.build_report(_frame(), tmp_path / "r.html", tiers=[80, 120],
                           vllm_results=_vllm(tmp_path), candidate="confidence",
                           baseline="mtp1").read_text()
    sections = re.split(r"<h2>", page)[1:]
    assert len(sections) >= 8
    for s in sections:
        name, body = s.split("</h2>", 1)
        body = re.sub(r"<!--.*?-->", "", body, flags=re.S)
        nothing_left_off = name == "Points left off the fronts" and "<p>(none)</p>" in body
        assert "Plotly.newPlot" in body or "<td>" in body or nothing_left_off, \
            f"section {name!r} is empty"
        assert "No headline comparison" not in body, name
    figures = _figures(page)
    assert len(figures) == page.count("Plotly.newPlot") == 5  # lossy axis included
    for data, layout in figures:
        assert any(_points(t.get("x")) for t in data), layout.get("title")
        texts = [layout.get("title", {}).get("text", "")]
        texts += [a.get("text", "") for a in layout.get("annotations", [])]
        for text in texts:
            for line in _lines(text):
                assert len(line) <= MAX_TITLE_CHARS, line

