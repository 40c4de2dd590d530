"""Real-world shapes of third-party acceptance data (vllm-counters, specdecode-bench):
/metrics as prometheus_client really prints it (text 0.0.4 and OpenMetrics), vllm bench
serve results as its versions write them, SpecDecode-Bench's single-table variant.
Every fixture is hand-made here; the expected numbers are derived by hand in comments.
What a file cannot say unambiguously is refused in one line naming the file."""

from __future__ import annotations

import json

import pytest
from hostile_inputs import HOSTILE
from hypothesis import given
from hypothesis import strategies as st
from input_checks import assert_rejects_file
from typer.testing import CliRunner

from dspark_sim.cli import app
from dspark_sim.errors import InputError
from dspark_sim.traces.importers import (
    import_specdecode_bench,
    import_vllm_counters,
    read_vllm_counters,
)
from dspark_sim.traces.schema import read_trace

runner = CliRunner()

# prometheus_client's text format 0.0.4, as vLLM's /metrics serves it: HELP/TYPE name the
# _total sample, _created is its own gauge, labels in vLLM's order (model_name, engine,
# then position), two data-parallel engines, other metrics between, a histogram with
# le="+Inf", a float in scientific notation. Hand sums over the two engines:
#   drafts 1200 + 800 = 2000; per position 1000+600, 700+400, 400+200, 250+50
#   = 1600, 1100, 600, 300 -> survival 0.8, 0.55, 0.3, 0.15; acceptance length 2.8;
#   accepted 2350 + 1250 = 3600 = sum of the positions; draft tokens 8000 = 4 x 2000.
M = 'model_name="meta-llama/Llama-3.1-8B-Instruct"'
TEXT_004 = f"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{M},engine="0"}} 3.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{{{M},engine="0"}} 1.2e+03
vllm:spec_decode_num_drafts_total{{{M},engine="1"}} 800.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{{{M},engine="0"}} 1.7331e+09
vllm:spec_decode_num_drafts_created{{{M},engine="1"}} 1.7331e+09
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{{{M},engine="0"}} 4800.0
vllm:spec_decode_num_draft_tokens_total{{{M},engine="1"}} 3200.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{{{M},engine="0"}} 2350.0
vllm:spec_decode_num_accepted_tokens_total{{{M},engine="1"}} 1250.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{{{M},engine="0",position="0"}} 1000.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{{{M},engine="0",position="1"}} 700.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{{{M},engine="0",position="2"}} 400.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{{{M},engine="0",position="3"}} 250.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{{{M},engine="1",position="0"}} 600.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{{{M},engine="1",position="1"}} 400.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{{{M},engine="1",position="2"}} 200.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{{{M},engine="1",position="3"}} 50.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{{{M},engine="0",position="0"}} 1.7331e+09
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{{{M},engine="0",le="+Inf"}} 42.0
"""
SURVIVAL = [0.8, 0.55, 0.3, 0.15]


def _write(tmp_path, name, text, newline="\n"):
    p = tmp_path / name
    p.write_bytes(text.replace("\n", newline).encode())
    return p


@pytest.mark.parametrize("newline", ["\n", "\r\n"], ids=["lf", "crlf"])
def test_text_format_scrape_of_two_engines(tmp_path, newline):
    p = _write(tmp_path, "metrics.txt", TEXT_004, newline)
    c = read_vllm_counters(p)
    assert c["num_drafts"] == 2000 and c["accepted_per_pos"] == [1600, 1100, 600, 300]
    assert c["survival"] == pytest.approx(SURVIVAL)
    assert c["model_name"] == "meta-llama/Llama-3.1-8B-Instruct"
    t = import_vllm_counters(p, requests=64, positions=1024, seed=5)
    g = t.meta.generator
    assert g["acceptance_length"] == pytest.approx(2.8) and g["draft_tokens_per_draft"] == 4.0
    assert g["model_name"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert t.meta.target == "meta-llama/Llama-3.1-8B-Instruct (vLLM counters)"
    # served tau at k is 1 + the first k rates: 2.8 at K = 4, 2.35 at 2, 1.8 at 1
    for k, tau in ((4, 2.8), (2, 2.35), (1, 1.8)):
        assert t.served_tau(k) == pytest.approx(tau, rel=0.01)


def _escaped(v: str) -> str:
    """A label value as the exposition formats write it."""
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


ENGINE = st.tuples(st.integers(1, 10**6), st.lists(st.floats(0, 1), min_size=3, max_size=3))


@HOSTILE
@given(model=st.text(alphabet='ab/ -_.,{}="\\\n', max_size=12),
       engines=st.lists(ENGINE, min_size=1, max_size=3), data=st.data())
def test_any_label_order_escaping_and_number_format_reads_the_same_counts(tmp_path_factory,
                                                                          model, engines,
                                                                          data):
    # per engine: drafts d and per-position counts a_0 >= a_1 >= a_2 <= d (vLLM's
    # counters); survival = sum over engines of a_j / sum of d, however the lines are
    # ordered, the labels ordered and the numbers written
    lines, drafts, acc = [], 0, [0, 0, 0]
    for e, (d, fracs) in enumerate(engines):
        counts = sorted((int(f * d) for f in fracs), reverse=True)
        drafts += d
        acc = [x + y for x, y in zip(acc, counts, strict=True)]
        for name, n, pos in [("drafts", d, None)] + [("accepted_tokens_per_pos", c, j)
                                                     for j, c in enumerate(counts)]:
            labels = [f'model_name="{_escaped(model)}"', f'engine="{e}"']
            labels += [] if pos is None else [f'position="{pos}"']
            labels = data.draw(st.permutations(labels))
            value = data.draw(st.sampled_from([str(n), f"{float(n)}", f"{float(n):.15e}"]))
            lines.append(f"vllm:spec_decode_num_{name}_total{{{','.join(labels)}}} {value}")
    lines = data.draw(st.permutations(lines))
    p = tmp_path_factory.mktemp("prop") / "metrics.txt"
    p.write_text("# TYPE vllm:spec_decode_num_drafts counter\n" + "\n".join(lines) + "\n")
    c = read_vllm_counters(p)
    assert c["num_drafts"] == drafts and c["accepted_per_pos"] == acc
    assert c["survival"] == pytest.approx([a / drafts for a in acc])
    assert c["model_name"] == model


# OpenMetrics (Accept: application/openmetrics-text): HELP/TYPE name the family without
# _total, a timestamp and an exemplar after a value, '# EOF' at the end, and a model name
# holding an escaped quote, a comma, a brace and a backslash. Engine 1 drafted nothing:
#   survival (450 + 0)/(500 + 0), (300 + 0)/500 = 0.9, 0.6; acceptance length 2.5.
ODD = r'model_name="org/m \"v2\", {x} \\ y"'
OPENMETRICS = f"""# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{{engine="0",{ODD}}} 500.0 1733100000.123
vllm:spec_decode_num_drafts_created{{engine="0",{ODD}}} 1733100000.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",{ODD},position="0"}} 450 # {{trace_id="a1"}} 1.0 1733100000.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",{ODD},position="1"}} 3.0e2
vllm:spec_decode_num_drafts_total{{engine="1",{ODD}}} 0.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="1",{ODD},position="0"}} 0.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="1",{ODD},position="1"}} 0.0
# EOF
"""


def test_openmetrics_scrape_with_exemplar_timestamp_and_escaped_labels(tmp_path):
    c = read_vllm_counters(_write(tmp_path, "om.txt", OPENMETRICS))
    assert c["num_drafts"] == 500 and c["survival"] == pytest.approx([0.9, 0.6])
    assert c["model_name"] == 'org/m "v2", {x} \\ y'  # unescaped
    assert c["num_draft_tokens"] is None  # no totals in this scrape: nothing to check


def _other_model(text: str) -> str:
    """The same counters again under a second model, with halved acceptance."""
    lines = []
    for ln in text.splitlines():
        if ln.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total"):
            name, val = ln.rsplit(" ", 1)
            ln = f"{name} {float(val) / 2}"
        elif ln.startswith("vllm:spec_decode_num_accepted_tokens_total"):
            continue
        lines.append(ln.replace(M, 'model_name="small-model"'))
    return "\n".join(lines) + "\n"


def test_scrape_of_two_models_is_refused_unless_one_is_picked(tmp_path):
    p = _write(tmp_path, "two.txt", TEXT_004 + _other_model(TEXT_004))
    with pytest.raises(InputError, match="counters of 2 models in one scrape .*'small-model'"
                                         ".* --model-name") as exc:
        read_vllm_counters(p)
    assert str(p) in str(exc.value)
    assert read_vllm_counters(p, "meta-llama/Llama-3.1-8B-Instruct")["survival"] == \
        pytest.approx(SURVIVAL)
    assert read_vllm_counters(p, "small-model")["survival"] == \
        pytest.approx([x / 2 for x in SURVIVAL])
    with pytest.raises(InputError, match="^--model-name: .* no counters of model 'nope'"):
        read_vllm_counters(p, "nope")
    out = tmp_path / "t.parquet"
    r = runner.invoke(app, ["traces", "import", "--format", "vllm-counters", str(p),
                            "--model-name", "small-model", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert read_trace(out).meta.generator["model_name"] == "small-model"
    r = runner.invoke(app, ["traces", "import", "--format", "per-position", str(p),
                            "--model-name", "small-model", "--out", str(out)])
    assert r.exit_code == 2 and "--model-name: does not apply" in r.output


def _drop(text: str, *needles: str) -> str:
    return "\n".join(ln for ln in text.splitlines() if not any(n in ln for n in needles))


@pytest.mark.parametrize("text,match", [
    # two scrapes pasted into one file: summing would double-count one window
    (TEXT_004 + TEXT_004, r"line 3\d: the series on line 6 again \(two scrapes"),
    (TEXT_004.replace("} 2350.0", "} NaN"), r"line 16: counter value must be finite"),
    (TEXT_004.replace("} 800.0", "} +Inf"), r"line 7: counter value must be finite"),
    # every engine drafted nothing (per-position counts 0 too)
    (_drop(TEXT_004, 'engine="1"').replace("} 1.2e+03", "} 0.0").replace("} 1000.0", "} 0")
     .replace("} 700.0", "} 0").replace("} 400.0", "} 0").replace("} 250.0", "} 0"),
     "num_drafts_total is 0"),
    # a total that the per-position counters do not add up to: not the same drafts
    (TEXT_004.replace("} 2350.0", "} 9350.0"), "per-position counts sum to 3600"),
    # more draft tokens than K x drafts: a position's counters were cut from the file
    (_drop(TEXT_004, 'position="3"'), "more than 3 positions x 2000 drafts"),
    (TEXT_004.replace('engine="1",position="2"', 'engine="1",position="two"'),
     r"line 25: per-position counter whose position is not .* label is 'two'"),
    # vLLM V0 reported only totals and gauges: no per-position survival to recover
    ("vllm:spec_decode_draft_acceptance_rate{model_name=\"m\"} 0.61\n"
     "vllm:spec_decode_num_accepted_tokens_total{model_name=\"m\"} 610.0\n"
     "vllm:spec_decode_num_draft_tokens_total{model_name=\"m\"} 1000.0\n",
     "V0 engines report only totals"),
    ('vllm:spec_decode_num_drafts_total{model_name="m",engine="0} 5\n', "line 1: not a Prometheus"),
    # vLLM's log lines: rounded 10 s windows, not counters
    ("INFO 12-01 12:00:00 [metrics.py:96] SpecDecoding metrics: Mean acceptance length: "
     "2.80, Accepted: 3600 tokens, Drafted: 8000 tokens, Per-position acceptance rate: "
     "0.800, 0.550, 0.300, 0.150\n", "a vLLM log"),
], ids=["two-scrapes", "nan", "inf", "zero-drafts", "totals-disagree", "position-missing",
        "bad-position", "v0", "unclosed-quote", "log"])
def test_ambiguous_or_broken_scrapes_are_refused(tmp_path, text, match):
    assert_rejects_file(tmp_path / "m.txt", text, read_vllm_counters, match)


# vllm bench serve --save-result (vLLM 0.10+/0.11): the spec-decode keys beside the run's
# others; acceptance_rate is a percent of draft tokens, the per-position rates fractions.
# Hand: 3000 drafts, rates 0.85, 0.6, 0.35 -> accepted 3000 x 1.8 = 5400, length 2.8,
# draft tokens 9000 -> rate 60 %; a draft at every step: output tokens = 100 first
# tokens + 3000 steps + 5400 accepted = 8500.
BENCH = {"date": "20251201-120000", "backend": "vllm", "model_id": "org/target",
         "num_prompts": 100, "completed": 100, "failed": 0, "duration": 61.5,
         "total_input_tokens": 12800, "total_output_tokens": 8500,
         "output_lens": [85] * 100, "ttfts": [0.05] * 100, "errors": [""] * 100,
         "spec_decode_acceptance_rate": 60.0, "spec_decode_acceptance_length": 2.8,
         "spec_decode_num_drafts": 3000, "spec_decode_draft_tokens": 9000,
         "spec_decode_accepted_tokens": 5400,
         "spec_decode_per_position_acceptance_rates": [0.85, 0.6, 0.35]}


def test_bench_serve_result(tmp_path):
    p = _write(tmp_path, "bench.json", json.dumps(BENCH, indent=4))
    c = read_vllm_counters(p)
    assert c["num_drafts"] == 3000 and c["accepted_per_pos"] == [2550, 1800, 1050]
    assert c["model_name"] == "org/target"
    t = import_vllm_counters(p, requests=64, positions=1024)
    assert t.meta.generator["acceptance_length"] == pytest.approx(2.8)
    assert t.meta.generator["draft_fraction"] == 1.0 and t.draft_tokens is None
    assert t.served_tau(3) == pytest.approx(2.8, rel=0.01)
    assert t.served_tau(1) == pytest.approx(1.85, rel=0.01)
    with pytest.raises(InputError, match="^--model-name: .* for model_id 'org/target'"):
        read_vllm_counters(p, "other")
    # acceptance_rate is not read: a percent (vLLM) or a fraction (other scripts writing
    # vLLM's keys) gives the same curve
    q = _write(tmp_path, "frac.json", _bench(spec_decode_acceptance_rate=0.6))
    assert read_vllm_counters(q)["survival"] == c["survival"]


def _bench(**change) -> str:
    d = {k: v for k, v in {**BENCH, **change}.items() if v is not None}
    return json.dumps(d)


@pytest.mark.parametrize("text,match", [
    # --append-result: one result per line
    (_bench() + "\n" + _bench(), "line 2: a second JSON document; .* --append-result"),
    ("[" + _bench() + "]", "got a JSON list"),
    # a run without speculative decoding writes no spec_decode_* key at all
    (_bench(**{k: None for k in BENCH if k.startswith("spec_decode_")}), "no spec_decode_"),
    # totals written, per-position list empty (a server without per-position counters)
    (_bench(spec_decode_per_position_acceptance_rates=[]), "no per-position rates"),
    # per-position rates without draft counts (MAX serve's histogram means)
    (_bench(spec_decode_num_drafts=None, spec_decode_draft_tokens=None,
            spec_decode_accepted_tokens=None, spec_decode_acceptance_length=None,
            spec_decode_acceptance_rate=None), "spec_decode_num_drafts must be a positive"),
    # TensorRT-LLM's convention (AL - 1) under vLLM's key
    (_bench(spec_decode_acceptance_length=1.8), r"is not 1 \+ the sum .* AL - 1"),
    # conditional rates P(k | 1..k-1) 0.85, 0.706, 0.583 in vLLM's key: no longer add up
    (_bench(spec_decode_per_position_acceptance_rates=[0.85, 0.706, 0.583]),
     r"is not 1 \+ the sum"),
    # rates as percentages
    (_bench(spec_decode_per_position_acceptance_rates=[85, 60, 35]), r"lie in \[0, 1\]"),
    (_bench(spec_decode_accepted_tokens=54000), "sum to 5400"),
    (_bench(spec_decode_draft_tokens="9000"), "must be a count"),
], ids=["appended", "list", "no-spec", "empty-rates", "max-style", "trt-length",
        "conditional", "percent", "accepted-disagrees", "string-count"])
def test_ambiguous_bench_serve_results_are_refused(tmp_path, text, match):
    assert_rejects_file(tmp_path / "bench.json", text, read_vllm_counters, match)


def test_specdecode_bench_single_acc_table(tmp_path):
    # request.py's fallback: a line without acc_<column> reads a single 'acc' table;
    # acc_len is tokens per step incl. the bonus, so accept_len = acc_len - 1
    p = tmp_path / "combined_x.jsonl"
    # b's list is shorter than its generated ids (as in many published acc_eagle lists):
    # its output length is the list's, as SpecDecode-Bench replays it, and it is counted
    rows = [{"id": "a", "prompt_token_ids": [1, 2, 3], "generated_token_ids": [7] * 4,
             "acc": {"acc_len": [3, 2, 1, 1]}},
            {"id": "b", "prompt_token_ids": [1], "generated_token_ids": [7] * 5,
             "acc": {"acc_len": [1, 2]}}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = import_specdecode_bench(p, column="ngram")
    assert t.accept_len.tolist() == [2, 1, 0, 0, 0, 1]
    assert t.req_output_tokens.tolist() == [4, 2] and t.req_prompt_tokens.tolist() == [3, 1]
    assert t.meta.generator["requests_where_generated_token_ids_length_differs"] == 1
    assert t.meta.generator["column"] == "acc.acc_len" and t.meta.drafter == "specdecode-bench-acc"
    # one line with the drafter's own table among 'acc' lines: two tables in one trace
    rows.append({"id": "c", "prompt_token_ids": [1], "acc_ngram": {"acc_len": [1]},
                 "acc": {"acc_len": [1]}})
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(InputError, match="line 3: acceptance read from 'acc_ngram', but from "
                                         "'acc' on line 1"):
        import_specdecode_bench(p, column="ngram")
