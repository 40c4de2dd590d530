"""Hostile input, generated: malformed option values, traces,
profiles, workloads and configs, drawn by Hypothesis and given to ``dspark-sim run``.

One property for all of them: the command either

* refuses the input: exit code 2, exactly one line ``error: ...`` naming the option or
  the file, no traceback (nothing but ``SystemExit`` escapes); or
* runs it cleanly: exit code 0, and the run's outputs conserve requests and tokens
  (every request finished, unfinished or rejected with a reason; per-request counters
  add up to the summary's totals; accepted <= verified per request; a finished request
  generated exactly its output length).

Inputs that are certainly malformed (a negative count, NaN, a binary file, a missing
column) must take the first branch. Each input is drawn small (<= 40 requests, one
replica) so a clean run costs well under a second.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import polars as pl
import pytest
from hostile_inputs import (
    ANY_NUMBER,
    HOSTILE,
    POLICY,
    PRINTABLE,
    invoke_drawn,
    no_escape,
    num_text,
    one_line_refusal,
    runner,
)
from hypothesis import assume, given
from hypothesis import strategies as st

from dspark_sim.cli import app
from dspark_sim.sim.outputs import read_run
from dspark_sim.traces.schema import write_trace
from dspark_sim.traces.synth import synth_iid

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--num-requests", "30", "--replicas", "1", "--quiet"]


# -- the property ---------------------------------------------------------------------------
def refused_or_conserved(r, where: str, out: Path, *, must_refuse: bool = False) -> str:
    """The one property (module docstring); returns "refused" or "ran"."""
    no_escape(r)
    if r.exit_code != 0 or must_refuse:
        one_line_refusal(r, where)
        assert not (out / "summary.json").exists()  # nothing written for refused input
        return "refused"
    assert_conserved(out)
    return "ran"


def assert_conserved(out: Path) -> None:
    s, req = read_run(out)
    n = s["num_requests"]
    assert req.height == n >= 1
    assert s["completed"] + s["unfinished"] + s["rejected"] == n
    fin = req.filter(pl.col("finished"))
    rej = req.filter(pl.col("rejected_reason").is_not_null())
    assert fin.height == s["completed"] and rej.height == s["rejected"]
    assert sum(s["rejected_reasons"].values()) == s["rejected"]
    assert fin.filter(pl.col("rejected_reason").is_not_null()).height == 0
    # a finished request generated its output length; nobody generated more
    assert (fin["generated_tokens"] == fin["output_tokens"]).all()
    assert (req["generated_tokens"] <= req["output_tokens"]).all()
    assert (rej["generated_tokens"] == 0).all()
    # per-request counters add up to the run's totals
    assert int(req["generated_tokens"].sum()) == s["total_generated_tokens"]
    assert int(fin["generated_tokens"].sum()) == s["total_output_tokens"]
    assert int(req["steps"].sum()) == s["num_drafts"]
    assert int(req["draft_tokens_verified"].sum()) == s["num_draft_tokens_verified"]
    assert int(req["accepted_tokens"].sum()) == s["num_accepted_tokens"]
    assert (req["accepted_tokens"] <= req["draft_tokens_verified"]).all()


def run_cli(args: list[str], out: Path):
    return runner.invoke(app, ["run", *args, "--out", str(out)])


def fresh(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("h") / "out"


# -- option values -----------------------------------------------------------------------------
BAD_COUNT = st.one_of(st.integers(max_value=0), st.sampled_from(["nan", "abc", "", "1.5"]),
                      st.integers(min_value=10**12)).map(str)
BAD_REAL = st.one_of(st.floats(max_value=0.0), st.sampled_from(["nan", "inf", "-inf", "x"])
                     ).map(num_text)
LENGTHS = st.one_of(
    st.sampled_from(["azure-conv", "azure-code", "trace", "bogus", ""]),
    st.builds(lambda kind, a, b: f"{kind}:{a}:{b}",
              st.sampled_from(["fixed", "lognormal", "uniform", "x"]),
              st.one_of(st.integers(-5, 3000), ANY_NUMBER),
              st.one_of(st.integers(-5, 3000), ANY_NUMBER)),
    st.builds(lambda a, b, c: f"lognormal:{a}:{b}:{c}", st.integers(1, 3000),
              st.integers(1, 3000), st.one_of(st.floats(-1, 50), ANY_NUMBER)),
    PRINTABLE)

# option -> values: everything a user could type. Valid values must stay cheap (the
# request count is bounded by SMALL; counts that size the engine are drawn small).
OPTIONS = {
    "--qps": ANY_NUMBER,
    "--burstiness": ANY_NUMBER,
    "--num-requests": st.one_of(st.integers(-5, 40).map(str), BAD_COUNT),
    "--duration-s": st.one_of(st.floats(-1, 2).map(num_text), BAD_REAL),
    "--seed": ANY_NUMBER,
    "--replicas": st.one_of(st.integers(-2, 8).map(str), BAD_COUNT),
    "--max-num-seqs": st.one_of(st.integers(-2, 300).map(str), BAD_COUNT),
    "--max-num-batched-tokens": st.one_of(st.integers(-2, 9000).map(str), BAD_COUNT),
    "--kv-capacity-tokens": ANY_NUMBER,
    "--max-model-len": ANY_NUMBER,
    "--gamma-max": ANY_NUMBER,
    "--policy": POLICY,
    "--lengths": LENGTHS,
    "--slo": st.one_of(PRINTABLE, st.builds(lambda a, b: f"ttft:{a},tpot:{b}", ANY_NUMBER,
                                            ANY_NUMBER)),
    "--router": st.one_of(st.sampled_from(["round-robin", "least-outstanding"]), PRINTABLE),
    "--kv-mode": st.one_of(st.sampled_from(["preempt", "reserve"]), PRINTABLE),
    "--prefill": st.one_of(st.sampled_from(["chunked", "disaggregated"]), PRINTABLE),
    "--preset": st.one_of(st.sampled_from(["default", "tiny", "single-replica"]), PRINTABLE),
    "--domain": st.one_of(st.sampled_from(["math", "code", "chat"]), PRINTABLE),
    "--profile": st.one_of(st.sampled_from(["v4flash-h200", "qwen3-8b-h100"]), PRINTABLE),
}
# values that are malformed whatever else is given
CERTAINLY_BAD = {
    "--num-requests": BAD_COUNT, "--replicas": BAD_COUNT, "--max-num-seqs": BAD_COUNT,
    "--max-num-batched-tokens": BAD_COUNT, "--qps": BAD_REAL, "--burstiness": BAD_REAL,
    "--duration-s": BAD_REAL, "--kv-capacity-tokens": BAD_COUNT,
    "--seed": st.one_of(st.integers(max_value=-1), st.integers(min_value=2**64)).map(str),
}


def run_drawn_option(tmp_path_factory, data, table: dict, *, must_refuse: bool) -> None:
    """Run the small config with one option of ``table`` set to a value drawn from its
    strategy: refused in one line naming it, or run cleanly (``must_refuse``: refused)."""
    out = fresh(tmp_path_factory)
    option, r = invoke_drawn(data, table, ["run", *SMALL, "--out", str(out)])
    refused_or_conserved(r, option, out, must_refuse=must_refuse)


@HOSTILE
@given(data=st.data())
def test_any_option_value_is_refused_in_one_line_or_run_cleanly(tmp_path_factory, data):
    run_drawn_option(tmp_path_factory, data, OPTIONS, must_refuse=False)


@HOSTILE
@given(data=st.data())
def test_certainly_bad_option_values_are_refused(tmp_path_factory, data):
    run_drawn_option(tmp_path_factory, data, CERTAINLY_BAD, must_refuse=True)


@HOSTILE
@given(qps=st.floats(1.0, 500.0), seed=st.integers(0, 2**32),
       policy=st.sampled_from(["none", "mtp1", "fixed:3", "confidence", "confidence-async"]),
       lengths=st.sampled_from(["azure-conv", "fixed:64:40", "lognormal:400:80:1.5"]),
       kv=st.sampled_from([None, 3000, 20000]), closed=st.booleans())
def test_valid_options_run_cleanly_and_conserve(tmp_path_factory, qps, seed, policy, lengths,
                                                kv, closed):
    args = [*SMALL, "--policy", policy, "--seed", str(seed), "--lengths", lengths,
            "--prefill", "chunked"]
    args += ["--max-concurrency", "8"] if closed else ["--qps", repr(qps)]
    if kv is not None:
        args += ["--kv-capacity-tokens", str(kv)]
    out = fresh(tmp_path_factory)
    r = run_cli(args, out)
    assert r.exit_code == 0, r.output
    assert refused_or_conserved(r, "", out) == "ran"


# -- traces ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "good.parquet"
    write_trace(synth_iid(0.7, 7, num_requests=8, positions=64), path)
    return path


def _corrupt_frame(df: pl.DataFrame, how: str, col: str, value) -> pl.DataFrame:
    if how == "drop":
        return df.drop(col)
    if how == "string":
        return df.with_columns(pl.col(col).cast(pl.String))
    if how == "float":
        return df.with_columns(pl.col(col).cast(pl.Float64) + 0.5)
    if how == "null":
        return df.with_columns(pl.when(pl.int_range(pl.len()) == 3).then(None)
                               .otherwise(pl.col(col)).alias(col))
    # "value": one cell set to a hostile number
    return df.with_columns(pl.when(pl.int_range(pl.len()) == 5).then(pl.lit(value))
                           .otherwise(pl.col(col).cast(pl.Float64)).alias(col))


@HOSTILE
@given(how=st.sampled_from(["drop", "string", "float", "null", "value", "bytes", "truncate"]),
       col=st.sampled_from(["request_id", "position", "accept_len", "domain"]),
       value=st.sampled_from([-1.0, 8.0, 1e30, math.nan, math.inf, -2.0**63]),
       cut=st.floats(0.0, 0.95), junk=st.binary(min_size=0, max_size=256),
       policy=st.sampled_from(["fixed:3", "confidence", "mtp1"]))
def test_malformed_traces(good_trace, tmp_path_factory, how, col, value, cut, junk, policy):
    bad = tmp_path_factory.mktemp("t") / "bad.parquet"
    assume(not (col == "domain" and how in ("float", "value")))  # not a number to corrupt
    raw = Path(good_trace).read_bytes()
    if how == "bytes":
        bad.write_bytes(junk)
    elif how == "truncate":
        bad.write_bytes(raw[: int(len(raw) * cut)])
    else:
        import pyarrow.parquet as pq

        table = pq.read_table(good_trace)
        df = _corrupt_frame(pl.from_arrow(table), how, col, value)
        # keep the trace's own metadata (gamma_max, source): only the data is hostile
        pq.write_table(df.to_arrow().replace_schema_metadata(table.schema.metadata), bad)
    out = fresh(tmp_path_factory)
    # mtp1 replays its own trace: the hostile file is its --mtp-trace
    opt = "--mtp-trace" if policy == "mtp1" else "--trace"
    # every corruption breaks the schema, except a domain column re-cast to the string it
    # is, or missing a value, and string request ids (the schema allows them)
    must = not ((col == "domain" and how in ("string", "null"))
                or (col == "request_id" and how == "string"))
    refused_or_conserved(run_cli([*SMALL, "--policy", policy, opt, str(bad)], out), str(bad),
                         out, must_refuse=must)


# -- profiles ----------------------------------------------------------------------------------
PROFILE_TOML = (ROOT / "calibration" / "data" / "qwen3-8b-h100.toml").read_text()
_ASSIGN = [i for i, ln in enumerate(PROFILE_TOML.splitlines())
           if re.match(r"^\s*[A-Za-z_][\w.]*\s*=", ln)]
HOSTILE_TOML_VALUES = st.one_of(
    st.sampled_from(["nan", "inf", "-inf", "-1", "0", "1e30", "-1e30", "true", '"abc"', "[]",
                     "[1, 2]", '["a"]', "{a = 1}", "1979-05-27", "9223372036854775807"]),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.integers(-2**63, 2**63 - 1).map(str))


@HOSTILE
@given(data=st.data())
def test_malformed_profiles(tmp_path_factory, data):
    lines = PROFILE_TOML.splitlines()
    kind = data.draw(st.sampled_from(["value", "value", "delete", "binary", "text"]))
    if kind == "binary":
        text = None
        blob = data.draw(st.binary(min_size=1, max_size=300))
    elif kind == "text":
        text = data.draw(st.text(max_size=200))
    else:
        i = data.draw(st.sampled_from(_ASSIGN), label="line")
        if kind == "delete":
            lines = lines[:i] + lines[i + 1:]
        else:
            key = lines[i].split("=", 1)[0]
            lines[i] = f"{key}= {data.draw(HOSTILE_TOML_VALUES, label='value')}"
        text = "\n".join(lines) + "\n"
    path = tmp_path_factory.mktemp("p") / "bad.toml"
    if text is None:
        path.write_bytes(blob)
    else:
        path.write_text(text)
    out = fresh(tmp_path_factory)
    # the profile's own limits would admit 256 seats and 8k tokens: keep the run small
    r = run_cli([*SMALL, "--profile", str(path), "--policy", "fixed:3",
                 "--lengths", "fixed:200:40"], out)
    refused_or_conserved(r, str(path), out, must_refuse=kind == "binary" and b"=" not in blob)


# -- workloads ---------------------------------------------------------------------------------
FIELD_VALUE = st.one_of(st.integers(-5, 3000), st.integers(-2**70, 2**70),
                        st.floats(allow_nan=True, allow_infinity=True),
                        st.sampled_from(["abc", "", None, [], {}, True]))


@HOSTILE
@given(rows=st.lists(st.fixed_dictionaries(
    {}, optional={"timestamp": FIELD_VALUE, "input_length": FIELD_VALUE,
                  "output_length": FIELD_VALUE}), min_size=0, max_size=8),
       junk_line=st.one_of(st.none(), PRINTABLE), fmt=st.sampled_from(["jsonl", "csv"]))
def test_malformed_workloads(tmp_path_factory, rows, junk_line, fmt):
    folder = tmp_path_factory.mktemp("w")
    if fmt == "jsonl":
        path = folder / "bad.jsonl"
        text = "".join(json.dumps(r) + "\n" for r in rows)
    else:
        path = folder / "bad.csv"
        names = {"timestamp": "TIMESTAMP", "input_length": "ContextTokens",
                 "output_length": "GeneratedTokens"}
        text = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
            ",".join("" if r.get(k) is None else
                     (f"2023-11-16 18:{int(r[k]) % 60:02d}:00.0000000"
                      if k == "timestamp" and isinstance(r[k], int) else str(r[k]))
                     for k in names) + "\n" for r in rows)
    if junk_line is not None:
        text += junk_line + "\n"
    path.write_text(text)
    well_formed = rows and junk_line is None and all(
        len(r) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in r.values())
        and 0 <= r["input_length"] <= 3000 and 1 <= r["output_length"] <= 3000
        and abs(r["timestamp"]) < 10**12 for r in rows)
    out = fresh(tmp_path_factory)
    outcome = refused_or_conserved(run_cli(["--replicas", "1", "--quiet", "--workload",
                                            str(path)], out), str(path), out,
                                   must_refuse=not rows)
    if well_formed:
        assert outcome == "ran"


# -- configs -----------------------------------------------------------------------------------
CONFIG_KEYS = {
    "run": ["policy", "seed", "preset", "profile", "trace", "bogus_key"],
    "workload": ["qps", "num_requests", "lengths", "arrival", "max_concurrency", "burstiness",
                 "duration_s", "nope"],
    "engine": ["max_num_seqs", "max_num_batched_tokens", "kv_capacity_tokens", "kv_mode",
               "max_model_len", "prefill", "max_num_seqz"],
    "deployment": ["replicas", "router", "profile"],
    "bogus_table": ["x"],
}


@HOSTILE
@given(data=st.data())
def test_malformed_configs(tmp_path_factory, data):
    table = data.draw(st.sampled_from(sorted(CONFIG_KEYS)), label="table")
    key = data.draw(st.sampled_from(CONFIG_KEYS[table]), label="key")
    value = data.draw(HOSTILE_TOML_VALUES, label="value")
    path = tmp_path_factory.mktemp("c") / "bad.toml"
    path.write_text(f"[{table}]\n{key} = {value}\n")
    out = fresh(tmp_path_factory)
    # the flags keep a valid run small; they do not override what the file sets wrongly
    r = run_cli(["--quiet", "--config", str(path), "--num-requests", "30"], out)
    refused_or_conserved(r, str(path), out,
                         must_refuse=table == "bogus_table" or key in (
                             "bogus_key", "nope", "max_num_seqz"))
