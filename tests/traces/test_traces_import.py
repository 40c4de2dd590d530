"""Importers (SpecDecode-Bench JSONL, generic per-position JSONL/CSV, vLLM counters) and
the vLLM synthetic-sampler export: values checked against the source files read
independently here, malformed input refused with one line naming the file and line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from input_checks import assert_rejects_file
from typer.testing import CliRunner

from dspark_sim.cli import app
from dspark_sim.errors import InputError
from dspark_sim.traces.export import vllm_synthetic_config
from dspark_sim.traces.importers import (
    import_per_position,
    import_specdecode_bench,
    import_vllm_counters,
    read_vllm_counters,
)
from dspark_sim.traces.schema import read_trace, write_trace
from dspark_sim.traces.synth import synth_iid

FIXTURE = Path(__file__).parents[1] / "data" / "specdecode_bench" / "combined_fixture.jsonl"
runner = CliRunner()


def _rows(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


@pytest.mark.parametrize("column", ["eagle", "ngram"])
def test_specdecode_bench_fixture(tmp_path, column):
    src = _rows(FIXTURE)
    t = import_specdecode_bench(FIXTURE, column=column)
    acc = [np.asarray(r[f"acc_{column}"]["acc_len"]) for r in src]
    assert t.req_ids.tolist() == [r["id"] for r in src]  # the source's string ids, file order
    assert t.meta.source == "imported" and t.conf is None
    assert t.meta.domains == ("fixture",)  # combined_fixture.jsonl -> "fixture"
    assert t.gamma_max == max(int(a.max()) for a in acc) - 1
    assert t.req_prompt_tokens.tolist() == [len(r["prompt_token_ids"]) for r in src]
    assert t.req_output_tokens.tolist() == [len(a) for a in acc]
    for i, a in enumerate(acc):  # accepted drafts = tokens per step - 1
        assert t.accept_len[t.req_offsets[i]:t.req_offsets[i + 1]].tolist() == (a - 1).tolist()
    u = read_trace(write_trace(t, tmp_path / "sdb.parquet"))
    assert u.req_ids.tolist() == t.req_ids.tolist()
    assert np.array_equal(u.accept_len, t.accept_len)
    assert u.req_output_tokens.tolist() == t.req_output_tokens.tolist()


def test_specdecode_bench_gamma_cut_is_exact_below_it():
    full = import_specdecode_bench(FIXTURE)
    cut = import_specdecode_bench(FIXTURE, gamma_max=5)
    assert cut.gamma_max == 5 and cut.meta.extra["clipped_positions"] > 0
    for k in (1, 3, 5):
        assert cut.served_tau(k) == full.served_tau(k)
    # the extremes --gamma-max allows: one draft, and 127 (accept_len is stored as int8)
    one = import_specdecode_bench(FIXTURE, gamma_max=1)
    assert one.gamma_max == 1 and one.accept_len.max() == 1
    assert one.served_tau(1) == full.served_tau(1)
    assert import_specdecode_bench(FIXTURE, gamma_max=127).gamma_max == 127
    for bad in (0, 128):
        with pytest.raises(InputError, match=f"^--gamma-max: .*{bad}"):
            import_specdecode_bench(FIXTURE, gamma_max=bad)


def test_specdecode_bench_counts_what_it_skips_and_what_disagrees(tmp_path):
    """An empty acc_len is skipped (as SpecDecode-Bench's simulator does); a
    generated_token_ids list of another length is imported but counted."""
    rows = [
        {"id": "a", "prompt_token_ids": [1, 2], "generated_token_ids": [5, 6],
         "acc_eagle": {"acc_len": [2, 1]}},
        {"id": "b", "prompt_token_ids": [1], "generated_token_ids": [5, 6, 7],
         "acc_eagle": {"acc_len": [3]}},  # 3 ids, 1 position: differs
        {"id": "c", "prompt_token_ids": [1], "acc_eagle": {"acc_len": [1]}},  # no ids: nothing to compare
        {"id": "d", "prompt_token_ids": [1], "generated_token_ids": [], "acc_eagle": {"acc_len": []}},
    ]
    p = tmp_path / "combined_mini.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = import_specdecode_bench(p)
    assert t.meta.generator["requests_where_generated_token_ids_length_differs"] == 1
    assert t.meta.generator["skipped_empty_requests"] == 1
    assert t.req_ids.tolist() == ["a", "b", "c"] and t.req_output_tokens.tolist() == [2, 1, 1]
    assert t.accept_len.tolist() == [1, 0, 2, 0] and t.meta.domains == ("mini",)


@pytest.mark.skipif(not os.environ.get("DSPARK_SPECDECODE_BENCH_FILE"),
                    reason="set DSPARK_SPECDECODE_BENCH_FILE to a SpecDecode-Bench JSONL")
def test_specdecode_bench_real_file():
    p = Path(os.environ["DSPARK_SPECDECODE_BENCH_FILE"])
    t = import_specdecode_bench(p)
    src = [r for r in _rows(p) if r["acc_eagle"]["acc_len"]]
    assert t.num_requests == len(src)
    assert t.num_positions == sum(len(r["acc_eagle"]["acc_len"]) for r in src)


@pytest.mark.parametrize("line,match", [
    ('{"id": "1", "prompt_token_ids": [1], "acc_eagle": {"acc_len": [1, 0]}}', r"integers in \[1, 2\*\*31 - 1\].*got 0$"),
    ('{"id": "1", "prompt_token_ids": [1], "acc_eagle": {"acc_len": [1, 2.5]}}', r"integers in \[1, 2\*\*31 - 1\].*got 2.5$"),
    ('{"id": "1", "prompt_token_ids": [1]}', "no 'acc_eagle.acc_len'"),
    ('{"id": [1], "prompt_token_ids": [1], "acc_eagle": {"acc_len": [1]}}', "'id'"),
    ('{"id": "1", "prompt_token_ids": 5, "acc_eagle": {"acc_len": [1]}}', "prompt_token_ids"),
    ('{"id": "1", ', "not JSON"),
    ('[1, 2]', "JSON object"),
])
def test_specdecode_bench_malformed(tmp_path, line, match):
    good = '{"id": "0", "prompt_token_ids": [1, 2], "acc_eagle": {"acc_len": [2, 1]}}'
    p = tmp_path / "bad.jsonl"
    p.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(InputError, match=match) as exc:
        import_specdecode_bench(p)
    msg = str(exc.value)
    assert str(p) in msg and "line 3" in msg and "\n" not in msg


def test_import_source_missing_folder_or_device_said_as_such(tmp_path):
    with pytest.raises(InputError, match="no.jsonl: source file not found"):
        import_specdecode_bench(tmp_path / "no.jsonl")
    with pytest.raises(InputError, match="is a folder, not a source file"):
        import_specdecode_bench(tmp_path)
    with pytest.raises(InputError, match="not a regular file"):
        import_specdecode_bench("/dev/null")


def test_specdecode_bench_duplicate_id(tmp_path):
    row = '{"id": "7", "prompt_token_ids": [1], "acc_eagle": {"acc_len": [2]}}\n'
    p = tmp_path / "dup.jsonl"
    p.write_text(row * 2)
    with pytest.raises(InputError, match="line 2: duplicate id '7'"):
        import_specdecode_bench(p)


def test_per_position_jsonl(tmp_path):
    p = tmp_path / "pp.jsonl"
    rows = [  # interleaved requests, positions out of order, one request with no domain change
        {"request_id": "b", "position": 1, "tokens_per_step": 1, "domain": "chat",
         "conf": [0.5, 0.2]},
        {"request_id": "a", "position": 0, "tokens_per_step": 3, "domain": "code",
         "conf": [0.9, 0.8]},
        {"request_id": "b", "position": 0, "tokens_per_step": 2, "domain": "chat",
         "conf": [0.7, 0.1]},
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = import_per_position(p)
    assert t.req_ids.tolist() == ["b", "a"]
    assert t.accept_len.tolist() == [1, 0, 2]  # b: pos 0, 1; a: pos 0 (tokens - 1)
    assert t.gamma_max == 2
    assert np.allclose(t.conf, [[0.7, 0.1], [0.5, 0.2], [0.9, 0.8]])
    assert t.req_domain.tolist() == ["chat", "code"]


def test_per_position_integer_ids_are_int32_to_its_limits_and_digits_past_them(tmp_path):
    p = tmp_path / "pp.jsonl"

    def ids_of(*rids):
        p.write_text("".join(json.dumps({"request_id": r, "position": 0, "accept_len": 1}) + "\n"
                             for r in rids))
        return import_per_position(p).req_ids

    lo, hi = -(2**31), 2**31 - 1  # int32's range: ids in it stay integers, in ascending order
    edge = ids_of(hi, lo)
    assert edge.dtype == np.int32 and edge.tolist() == [lo, hi]
    assert ids_of(lo).tolist() == [lo]  # one request of one position is a trace
    assert ids_of(lo - 1, 0).tolist() == [str(lo - 1), "0"]
    assert ids_of(0, hi + 1).tolist() == ["0", str(hi + 1)]
    with pytest.raises(InputError, match="request ids mix integers and strings"):
        ids_of(1, "a")


@pytest.mark.parametrize("conf", [[], 0.5, "0.5"])
def test_per_position_conf_must_be_a_non_empty_list(tmp_path, conf):
    p = tmp_path / "pp.jsonl"
    p.write_text(json.dumps({"request_id": "r", "position": 0, "accept_len": 0, "conf": conf}) + "\n")
    with pytest.raises(InputError, match="line 1: conf must be a non-empty list of numbers"):
        import_per_position(p)


def test_per_position_csv_names_the_line_of_an_empty_id(tmp_path):
    p = tmp_path / "pp.csv"
    p.write_text("request_id,position,accept_len\na,0,1\n  ,0,1\n")  # "a": a one-letter id
    with pytest.raises(InputError, match="line 3: empty request_id"):
        import_per_position(p)


def test_per_position_csv_and_errors(tmp_path):
    p = tmp_path / "pp.csv"
    p.write_text("request_id,position,accept_len,prompt_tokens,output_tokens\n"
                 "r1,0,3,50,3\nr1,1,0,50,3\nr1,2,1,50,3\nr2,0,0,9,1\n")
    t = import_per_position(p, domain="gsm8k")
    p.write_text("request_id,position,accept_len,conf_1\nr1,0,1,1\nr1,1,0,0\n")
    assert import_per_position(p).conf.tolist() == [[1.0], [0.0]]  # [0, 1] holds its ends
    p.write_text("request_id,position,accept_len,prompt_tokens,output_tokens\n"
                 "r1,0,3,50,3\nr1,1,0,50,3\nr1,2,1,50,3\nr2,0,0,9,1\n")
    t = import_per_position(p, domain="gsm8k")
    assert t.accept_len.tolist() == [3, 0, 1, 0] and t.conf is None
    assert t.req_prompt_tokens.tolist() == [50, 9] and t.req_output_tokens.tolist() == [3, 1]
    assert t.meta.domains == ("gsm8k",) and t.gamma_max == 3
    cases = {
        "request_id,position,accept_len\nr1,0,1\nr1,2,1\n": "line 3: positions of request 'r1'",
        "request_id,position,accept_len\nr1,0,1\nr1,1,2.5\n": "line 3: accept_len must be an integer",
        "request_id,position,accept_len,tokens_per_step\nr1,0,1,2\n": "exactly one",
        "request_id,position,tokens_per_step\nr1,0,0\n": "line 2: tokens_per_step must be >= 1",
        "request_id,position,accept_len,prompt_tokens\nr1,0,1,5\nr1,1,1,6\n":
            "line 3: prompt_tokens differs",
        "request_id,position,accept_len,conf_1\nr1,0,1,1.5\n": "line 2: conf values",
        "request_id,position,accept_len,conf_1\nr1,0,1,0.5\nr1,1,0,-0.5\n": "line 3: conf values",
        "request_id,position,accept_len,conf_1\nr1,0,1,abc\n": "line 2: conf values",
        "request_id,position,accept_len,conf_1\nr1,0,2,0.5\n": "longer than the 1 confidences",
    }
    for text, match in cases.items():
        p.write_text(text)
        with pytest.raises(InputError, match=match) as exc:
            import_per_position(p)
        assert str(p) in str(exc.value)


PROM = """# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 600.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 400.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 1800.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 480.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 320.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 330.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="1"} 220.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 180.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="2"} 120.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="m",position="0"} 1.7e9
"""


def test_vllm_counters_prometheus_and_bench_serve(tmp_path):
    p = tmp_path / "metrics.txt"
    p.write_text(PROM)
    c = read_vllm_counters(p)
    # summed over engines: 800/1000, 550/1000, 300/1000
    assert c["num_drafts"] == 1000 and c["survival"] == pytest.approx([0.8, 0.55, 0.3])
    j = tmp_path / "bench.json"
    j.write_text(json.dumps({"spec_decode_num_drafts": 1000, "spec_decode_acceptance_length": 2.65,
                             "spec_decode_per_position_acceptance_rates": [0.8, 0.55, 0.3]}))
    assert read_vllm_counters(j)["survival"] == pytest.approx([0.8, 0.55, 0.3])
    t = import_vllm_counters(p, requests=64, positions=512, seed=3)
    assert t.meta.source == "synthetic" and t.conf is None and t.gamma_max == 3
    assert t.meta.generator["accepted_per_pos"] == [800, 550, 300]
    assert t.survival() == pytest.approx([0.8, 0.55, 0.3], abs=0.01)
    # i.i.d. positions: served tau at K is vLLM's acceptance length 1 + sum(rates)
    assert t.served_tau(3) == pytest.approx(2.65, rel=0.01)
    assert t.served_tau(1) == pytest.approx(1.8, rel=0.01)
    # and the export hands the same rates back to a real engine
    cfg = vllm_synthetic_config(t)
    assert cfg["synthetic_acceptance_rates"] == pytest.approx([0.8, 0.55, 0.3], abs=0.015)


@pytest.mark.parametrize("requests,positions", [(1, 10**9), (10**9, 1)])
def test_vllm_counters_too_many_cells_names_both_options(tmp_path, requests, positions):
    # either option may be the large one: the refusal names the product (it blamed
    # --requests for a huge --positions)
    p = tmp_path / "metrics.txt"
    p.write_text(PROM)
    with pytest.raises(InputError, match=r"^--requests x --positions: .* exceeds") as exc:
        import_vllm_counters(p, requests=requests, positions=positions)
    assert f"{requests:,} x {positions:,}" in str(exc.value)


def test_vllm_counters_edge_counts(tmp_path):
    """A position never accepted is a zero rate; a single verified draft is a count."""
    p = tmp_path / "metrics.txt"
    p.write_text(PROM.replace("} 180.0", "} 0.0").replace("} 120.0", "} 0.0"))
    assert read_vllm_counters(p)["survival"] == pytest.approx([0.8, 0.55, 0.0])
    p.write_text("vllm:spec_decode_num_drafts_total 1\n"
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 1\n'
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 0\n')
    c = read_vllm_counters(p)
    assert (c["num_drafts"], c["survival"]) == (1, [1.0, 0.0])
    j = tmp_path / "bench.json"
    j.write_text(json.dumps({"spec_decode_num_drafts": 1,
                             "spec_decode_per_position_acceptance_rates": [1.0]}))
    c = read_vllm_counters(j)
    assert (c["num_drafts"], c["survival"], c["accepted_per_pos"]) == (1, [1.0], [1])


@pytest.mark.parametrize("total,ok", [(1650, True), (1666, True), (1666.5, True),
                                       (1667, False), (1633, False)])
def test_vllm_counters_accepted_total_within_one_percent(tmp_path, total, ok):
    """docs/traces.md: the accepted-tokens total is the per-position counts' sum
    (800 + 550 + 300 = 1650 here) with 1 % slack: 16.5 tokens either way."""
    p = tmp_path / "metrics.txt"
    p.write_text(PROM + f"vllm:spec_decode_num_accepted_tokens_total{{model_name=\"m\"}} {total}\n")
    if ok:
        assert read_vllm_counters(p)["num_drafts"] == 1000
    else:
        with pytest.raises(InputError, match="per-position counts sum to 1650"):
            read_vllm_counters(p)


def test_vllm_counters_positions_up_to_127(tmp_path):
    """accept_len is int8: K = 127 draft positions import, 128 are refused."""
    j = tmp_path / "bench.json"
    for k in (127, 128):
        j.write_text(json.dumps({"spec_decode_num_drafts": 10,
                                 "spec_decode_per_position_acceptance_rates": [0.5] * k}))
        if k == 127:
            assert import_vllm_counters(j, requests=1, positions=4).gamma_max == 127
        else:
            with pytest.raises(InputError, match="128 draft positions exceed 127"):
                import_vllm_counters(j, requests=1, positions=4)


@pytest.mark.parametrize("name,value", [("requests", 0), ("requests", True),
                                        ("positions", "8"), ("positions", 2.0)])
def test_vllm_counters_requests_and_positions_are_counts(tmp_path, name, value):
    p = tmp_path / "metrics.txt"
    p.write_text(PROM)
    with pytest.raises(InputError, match=f"^--{name}: must be an integer >= 1"):
        import_vllm_counters(p, **{name: value})


def test_vllm_counters_metadata_rounds_to_six_decimals(tmp_path):
    j = tmp_path / "bench.json"
    j.write_text(json.dumps({"spec_decode_num_drafts": 3.0,
                             "spec_decode_per_position_acceptance_rates": [1 / 3]}))
    gen = import_vllm_counters(j, requests=2, positions=5).meta.generator
    assert gen["num_drafts"] == 3 and gen["accepted_per_pos"] == [1]
    assert gen["survival_per_step"] == [0.333333] and gen["acceptance_length"] == 1.333333


def test_vllm_counters_cells_cap_is_twenty_million(tmp_path):
    """docs/traces.md: --requests x --positions at most 20,000,000. Checked before the
    file is read, so a missing file tells which side of the cap a product is on."""
    missing = tmp_path / "none.txt"
    with pytest.raises(InputError, match="file not found"):
        import_vllm_counters(missing, requests=4000, positions=5000)
    with pytest.raises(InputError, match=r"^--requests x --positions: .*20,000,001 exceeds"):
        import_vllm_counters(missing, requests=20_000_001, positions=1)


@pytest.mark.parametrize("text,match", [
    (PROM.replace("600.0", "0.0").replace("400.0", "0.0"), "num_drafts_total is 0"),
    (PROM.replace("} 600.0", "} -600.0"), "line 3: counter value must be finite and >= 0"),
    (PROM.replace("} 600.0", "} inf"), "line 3: counter value must be finite and >= 0"),
    ('{"spec_decode_num_drafts": 1000.5, "spec_decode_per_position_acceptance_rates": [0.5]}',
     "spec_decode_num_drafts must be a positive integer .*got 1000.5"),
    ('{"spec_decode_num_drafts": "1000", "spec_decode_per_position_acceptance_rates": [0.5]}',
     "spec_decode_num_drafts must be a positive integer .*got '1000'"),
    (PROM.replace('position="1"} 330.0', 'position="1"} 600.0'), "increase along the draft"),
    ("\n".join(ln for ln in PROM.splitlines() if "num_drafts_total" not in ln), "no vllm:"),
    (PROM.replace("600.0", "abc"), "line 3: value 'abc'"),
    ('{"spec_decode_num_drafts": 0, "spec_decode_per_position_acceptance_rates": [0.5]}',
     "positive integer"),
    ('{"completed": 10}', r"no spec_decode_\* keys"),
], ids=["zero-drafts-total", "negative", "infinite", "fractional-drafts", "string-drafts",
        "increasing", "no-drafts", "bad-value", "zero-drafts", "no-rates"])
def test_vllm_counters_malformed(tmp_path, text, match):
    assert_rejects_file(tmp_path / "m.txt", text, import_vllm_counters, match)


def test_export_served_rates_reproduce_served_tau(tmp_path):
    t = import_specdecode_bench(FIXTURE, gamma_max=7)
    for k in (1, 3, 7):
        cfg = vllm_synthetic_config(t, num_speculative_tokens=k)
        rates = cfg["synthetic_acceptance_rates"]
        assert len(rates) == k and all(a >= b for a, b in zip(rates, rates[1:], strict=False))
        # vLLM's sampler draws each step independently: it serves 1 + sum(rates)
        assert 1 + sum(rates) == pytest.approx(t.served_tau(k), abs=1e-5)
        pos = vllm_synthetic_config(t, num_speculative_tokens=k, weighting="positions")
        assert 1 + sum(pos["synthetic_acceptance_rates"]) == pytest.approx(t.tau(k), abs=1e-5)
    with pytest.raises(InputError, match="--num-speculative-tokens"):
        vllm_synthetic_config(t, num_speculative_tokens=8)


def test_cli_import_run_export(tmp_path):
    tr = tmp_path / "sdb.parquet"
    r = runner.invoke(app, ["traces", "import", "--format", "specdecode-bench", str(FIXTURE),
                            "--out", str(tr)])
    assert r.exit_code == 0, r.output
    assert read_trace(tr).num_requests == 6
    r = runner.invoke(app, ["run", "--trace", str(tr), "--policy", "fixed:3", "--num-requests",
                            "20", "--replicas", "1", "--qps", "5", "--quiet",
                            "--out", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["trace"] == str(tr) and s["completed"] == 20
    assert s["num_draft_tokens_verified"] == 3 * s["num_drafts"]
    r = runner.invoke(app, ["run", "--trace", str(tr), "--policy", "confidence",
                            "--num-requests", "20", "--replicas", "1", "--qps", "5", "--quiet"])
    assert r.exit_code == 2 and "no 'conf' column" in r.output and str(tr) in r.output
    out = tmp_path / "spec.json"
    r = runner.invoke(app, ["traces", "export", str(tr), "--num-speculative-tokens", "3",
                            "--method", "eagle3", "--out", str(out)])
    assert r.exit_code == 0, r.output
    cfg = json.loads(out.read_text())
    assert cfg["rejection_sample_method"] == "synthetic" and cfg["method"] == "eagle3"
    assert cfg["num_speculative_tokens"] == 3 and len(cfg["synthetic_acceptance_rates"]) == 3
    # the rates serve the imported trace's tau at 3 (vLLM: 1 + sum of the rates)
    assert 1 + sum(cfg["synthetic_acceptance_rates"]) == pytest.approx(
        read_trace(tr).served_tau(3), abs=1e-5)
    r = runner.invoke(app, ["traces", "import", "--format", "per-position", str(FIXTURE),
                            "--column", "ngram", "--out", str(tmp_path / "x.parquet")])
    assert r.exit_code == 2 and "--column" in r.output
    assert not (tmp_path / "x.parquet").exists()


def test_iid_export_equals_alpha_powers():
    t = synth_iid(0.7, 4, num_requests=64, positions=600, seed=1)
    rates = vllm_synthetic_config(t)["synthetic_acceptance_rates"]
    assert rates == pytest.approx([0.7 ** j for j in range(1, 5)], abs=0.01)


# vLLM 0.32 CPU, n-gram drafter, num_speculative_tokens = 3: drafts at 108 of the
# 512 - 204 - 8 = 300 request-steps (each request's first token comes from prefill)
NGRAM_BENCH = {"completed": 8, "total_output_tokens": 512, "spec_decode_num_drafts": 108,
               "spec_decode_draft_tokens": 320, "spec_decode_accepted_tokens": 204,
               "spec_decode_per_position_acceptance_rates": [0.7407, 0.6204, 0.5278],
               "spec_decode_acceptance_length": 2.889}
NGRAM_PROM = """# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="m"} 512.0
vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e9
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 6.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 2.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 0.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 108.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 204.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 80.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 67.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 57.0
"""


@pytest.mark.parametrize("fmt", ["bench-serve", "prometheus"])
def test_vllm_counters_write_the_draft_fraction(tmp_path, fmt):
    """An n-gram drafter drafts at 36 % of the request-steps: each synthetic position
    drafts K with that probability, else none, and the rates hold where it drafts."""
    src = tmp_path / ("bench.json" if fmt == "bench-serve" else "metrics.txt")
    src.write_text(json.dumps(NGRAM_BENCH) if fmt == "bench-serve" else NGRAM_PROM)
    t = import_vllm_counters(src, requests=64, positions=512, seed=0)
    gen = t.meta.generator
    assert gen["draft_fraction"] == 0.36 and gen["request_steps"] == 300
    assert "= 108 / 300" in gen["draft_fraction_from"]
    # 32,768 positions: one standard error of the drawn fraction is 0.0027
    assert t.draft_fraction == pytest.approx(0.36, abs=0.012)
    assert set(np.unique(t.draft_tokens).tolist()) == {0, 3}
    assert not t.accept_len[t.draft_tokens == 0].any()
    rates = np.array(NGRAM_BENCH["spec_decode_per_position_acceptance_rates"])
    # vLLM's rates are over the steps with drafts: served_survival counts those
    assert t.served_survival(3) == pytest.approx(rates, abs=0.025)
    assert t.served_tau(3) == pytest.approx(1 + 0.36 * rates.sum(), rel=0.02)
    u = read_trace(write_trace(t, tmp_path / "t.parquet"))
    assert np.array_equal(u.draft_tokens, t.draft_tokens)
    # the accepted drafts where it drafts are the draw without the rule: only the
    # positions without drafts lost theirs
    j = tmp_path / f"plain{src.suffix}"
    j.write_text(json.dumps({k: v for k, v in NGRAM_BENCH.items() if k != "completed"})
                 if fmt == "bench-serve" else
                 "\n".join(ln for ln in NGRAM_PROM.splitlines() if "request_success" not in ln))
    p = import_vllm_counters(j, requests=64, positions=512, seed=0)
    assert p.draft_tokens is None
    drafted = t.draft_tokens > 0
    assert np.array_equal(p.accept_len[drafted], t.accept_len[drafted])


def test_vllm_counters_write_no_draft_tokens_when_every_step_drafts(tmp_path):
    """A fraction of ~1 (EAGLE, MTP: a draft every step) or a missing count: no column,
    the trace byte-for-byte the one without the rule, and the generator says why."""
    j = tmp_path / "bench.json"
    full = dict(NGRAM_BENCH, total_output_tokens=108 + 204 + 8)
    j.write_text(json.dumps(full))
    t = import_vllm_counters(j, requests=4, positions=50, seed=1)
    assert t.draft_tokens is None and t.meta.generator["draft_fraction"] == 1.0
    assert "no draft_tokens column" in t.meta.generator["draft_fraction_from"]
    # fewer request-steps than drafts (a scrape between two increments): clamped to 1
    j.write_text(json.dumps(dict(full, total_output_tokens=300)))
    assert import_vllm_counters(j, requests=4, positions=50).meta.generator[
        "draft_fraction"] == 1.0
    j.write_text(json.dumps({k: v for k, v in NGRAM_BENCH.items() if k != "completed"}))
    u = import_vllm_counters(j, requests=4, positions=50, seed=1)
    assert u.draft_tokens is None and u.meta.generator["draft_fraction"] is None
    assert "completed missing" in u.meta.generator["draft_fraction_from"]
    assert np.array_equal(u.accept_len, t.accept_len)
    p = tmp_path / "metrics.txt"
    p.write_text("\n".join(ln for ln in NGRAM_PROM.splitlines()
                           if "request_success" not in ln))
    g = import_vllm_counters(p, requests=4, positions=50).meta.generator
    assert g["draft_fraction"] is None
    assert "vllm:request_success_total missing" in g["draft_fraction_from"]


def test_vllm_counters_a_model_without_speculation_is_not_a_second_model(tmp_path):
    p = tmp_path / "metrics.txt"
    p.write_text(NGRAM_PROM + 'vllm:generation_tokens_total{model_name="other"} 9.0\n')
    assert import_vllm_counters(p, requests=4, positions=50).meta.generator[
        "draft_fraction"] == 0.36


@pytest.mark.parametrize("text,match", [
    (json.dumps(dict(NGRAM_BENCH, total_output_tokens=212)),
     r"total_output_tokens - spec_decode_accepted_tokens - completed is 0: no decode steps"),
    (json.dumps(dict(NGRAM_BENCH, completed="8")), "completed must be a count >= 0, got '8'"),
    (NGRAM_PROM.replace("} 512.0", "} 100.0"), "is -112: no decode steps"),
], ids=["no-steps", "string-completed", "scrape-no-steps"])
def test_vllm_counters_refuse_request_step_counts_of_no_run(tmp_path, text, match):
    assert_rejects_file(tmp_path / "m.txt", text, import_vllm_counters, match)


def test_cli_import_writes_the_draft_tokens_column(tmp_path):
    src = tmp_path / "bench.json"
    src.write_text(json.dumps(NGRAM_BENCH))
    out = tmp_path / "ngram.parquet"
    r = runner.invoke(app, ["traces", "import", "--format", "vllm-counters", str(src),
                            "--out", str(out)])
    assert r.exit_code == 0, r.output
    t = read_trace(out)
    assert t.meta.generator["draft_fraction"] == 0.36
    assert t.draft_fraction == pytest.approx(0.36, abs=0.012)
