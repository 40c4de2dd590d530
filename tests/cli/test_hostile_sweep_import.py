"""Hostile input for ``sweep`` and ``traces import``, drawn by Hypothesis (the run-side
suite is tests/cli/test_hostile_properties.py; the settings and strategies they share are
tests/hostile_inputs.py).

* ``sweep``: any value of a grid or headline option is either refused in one line that
  names the option, before any point runs and with nothing written, or the sweep goes
  on to simulate (the ``no_simulation`` fixture turns that moment into a marker
  exception, so no drawn grid is actually simulated).
* ``traces import``: per-position JSONL / CSV rows and SpecDecode-Bench records with
  hostile field values are either refused in one line naming the file (or option) with
  no trace written, or imported into a trace that holds exactly the rows given, with
  ``accept_len`` in ``[0, gamma_max]``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hostile_inputs import ANY_NUMBER, HOSTILE, POLICY, PRINTABLE, invoke_drawn, runner
from hostile_inputs import one_line_refusal as _refusal
from hypothesis import given
from hypothesis import strategies as st

from dspark_sim.cli import app
from dspark_sim.sim import api
from dspark_sim.traces.schema import read_trace


class Simulated(Exception):
    """Raised where the first point would be simulated: every input check passed."""


@pytest.fixture
def reaches_simulation(monkeypatch):
    def mark(*_a, **_k):
        raise Simulated

    monkeypatch.setattr(api, "simulate", mark)


# -- sweep ---------------------------------------------------------------------------------
GRID = st.one_of(
    ANY_NUMBER,
    st.builds(lambda a, b, c: f"{a}:{b}:{c}", ANY_NUMBER, ANY_NUMBER,
              st.one_of(ANY_NUMBER, ANY_NUMBER.map(lambda s: f"x{s}"))),
    st.lists(st.one_of(st.integers(-3, 64).map(str), ANY_NUMBER), min_size=0,
             max_size=4).map(",".join),
)
SWEEP_OPTIONS = {
    "--qps": GRID,
    "--concurrency": GRID,
    "--seeds": GRID,
    "--sla": GRID,
    "--policies": st.lists(POLICY, min_size=0, max_size=3).map(",".join),
    "--candidate": st.one_of(st.sampled_from(["mtp1", "none", "MTP1", "fixed:3"]), POLICY),
    "--baseline": st.one_of(st.sampled_from(["mtp1", "none"]), POLICY),
    "--gpus": st.one_of(st.integers(-3, 8).map(str), ANY_NUMBER),
    "--workers": st.one_of(st.integers(-3, 4).map(str), ANY_NUMBER),
    "--basis": st.one_of(st.sampled_from(["steady", "whole"]), PRINTABLE),
    # not "process": its workers would simulate for real, past the marker
    "--executor": st.one_of(st.just("serial"), PRINTABLE),
    "--target-rse": ANY_NUMBER,
    "--max-doublings": ANY_NUMBER,
}


@HOSTILE
@given(data=st.data())
def test_any_sweep_option_is_refused_up_front_or_reaches_the_simulator(
        tmp_path_factory, reaches_simulation, data):
    out = tmp_path_factory.mktemp("sw") / "out"

    def argv(option: str) -> list[str]:  # a rate grid unless the drawn option is the grid
        rate = [] if option in ("--qps", "--concurrency") else ["--qps", "1"]
        return ["sweep", "--out", str(out), "--policies", "mtp1,none", "--num-requests", "10",
                "--executor", "serial", "--quiet", *rate]

    option, r = invoke_drawn(data, SWEEP_OPTIONS, argv)
    if isinstance(r.exception, Simulated):
        return  # every check passed; the grid would now run
    assert r.exception is None or isinstance(r.exception, SystemExit), \
        f"escaped: {r.exception!r}\n{r.output}"
    _refusal(r, option)
    assert not (out / "results.parquet").exists() and not (out / "points").exists()


# -- traces import ------------------------------------------------------------------------
HOSTILE_VALUE = st.one_of(
    st.integers(-3, 12), st.integers(-2**70, 2**70), st.booleans(), st.none(),
    st.floats(allow_nan=True, allow_infinity=True), PRINTABLE,
    st.lists(st.integers(-2, 5), max_size=3), st.dictionaries(PRINTABLE, st.integers(), max_size=2))


def _pp_rows(n_requests: int, n_positions: int, rng: np.random.Generator) -> list[dict]:
    return [{"request_id": f"r{i}", "position": j, "accept_len": int(rng.integers(0, 5))}
            for i in range(n_requests) for j in range(n_positions)]


@HOSTILE
@given(n_requests=st.integers(1, 3), n_positions=st.integers(1, 4), row=st.integers(0, 11),
       field=st.sampled_from(["request_id", "position", "accept_len", "tokens_per_step",
                              "domain", "prompt_tokens", "output_tokens", "conf", "extra"]),
       value=HOSTILE_VALUE, fmt=st.sampled_from(["jsonl", "csv"]), drop=st.booleans())
def test_per_position_imports_are_refused_in_one_line_or_kept_whole(
        tmp_path_factory, n_requests, n_positions, row, field, value, fmt, drop):
    rows = _pp_rows(n_requests, n_positions, np.random.default_rng(row))
    target = rows[row % len(rows)]
    if drop and field in target:
        del target[field]
    else:
        target[field] = value
    d = tmp_path_factory.mktemp("imp")
    src = d / f"pp.{fmt}"
    if fmt == "jsonl":
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        cols = list(dict.fromkeys(k for r in rows for k in r))
        text = lambda v: "" if v is None else str(v).replace(",", ";").replace("\n", " ")  # noqa: E731
        src.write_text(",".join(cols) + "\n" + "".join(
            ",".join(text(r.get(c)) for c in cols) + "\n" for r in rows))
    out = d / "t.parquet"
    r = runner.invoke(app, ["traces", "import", str(src), "--out", str(out), "--format",
                            "per-position"])
    assert r.exception is None or isinstance(r.exception, SystemExit), \
        f"escaped: {r.exception!r}\n{r.output}"
    if r.exit_code != 0:
        _refusal(r, str(src))
        assert not out.exists()
        return
    t = read_trace(out)
    assert t.num_positions == len(rows)  # every row kept, none invented
    assert t.num_requests == len({str(x.get("request_id")) for x in rows})
    assert int(t.accept_len.min()) >= 0 and int(t.accept_len.max()) <= t.gamma_max
    assert int(t.req_lengths.sum()) == len(rows)


SDB_FIELDS = ["id", "prompt_token_ids", "generated_token_ids", "acc_eagle", "acc_eagle.acc_len",
              "acc_eagle.acc_len[0]"]


@HOSTILE
@given(n=st.integers(1, 3), which=st.integers(0, 2), field=st.sampled_from(SDB_FIELDS),
       value=HOSTILE_VALUE, drop=st.booleans(), gamma=st.one_of(st.none(), ANY_NUMBER))
def test_specdecode_bench_imports_are_refused_in_one_line_or_kept_whole(
        tmp_path_factory, n, which, field, value, drop, gamma):
    recs = [{"id": str(i), "prompt_token_ids": [1, 2, 3], "generated_token_ids": [4, 5, 6],
             "acc_eagle": {"acc_len": [1 + (i + j) % 4 for j in range(3)]}} for i in range(n)]
    rec = recs[which % n]
    if field == "acc_eagle.acc_len":
        rec["acc_eagle"]["acc_len"] = value
    elif field == "acc_eagle.acc_len[0]":
        rec["acc_eagle"]["acc_len"][0] = value
    elif drop:
        rec.pop(field, None)
    else:
        rec[field] = value
    d = tmp_path_factory.mktemp("sdb")
    src = d / "combined_x.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = d / "t.parquet"
    args = ["traces", "import", str(src), "--out", str(out), "--format", "specdecode-bench"]
    if gamma is not None:
        args += ["--gamma-max", gamma]
    r = runner.invoke(app, args)
    assert r.exception is None or isinstance(r.exception, SystemExit), \
        f"escaped: {r.exception!r}\n{r.output}"
    if r.exit_code != 0:
        _refusal(r, "--gamma-max" if gamma is not None and str(src) not in r.output
                          else str(src))
        assert not out.exists()
        return
    t = read_trace(out)
    kept = [x for x in recs if x["acc_eagle"]["acc_len"]]  # empty lists are dropped
    assert t.num_requests == len(kept)
    assert t.num_positions == sum(len(x["acc_eagle"]["acc_len"]) for x in kept)
    g = t.gamma_max
    want = np.concatenate([np.minimum(np.asarray(x["acc_eagle"]["acc_len"]) - 1, g)
                           for x in kept])
    assert np.array_equal(t.accept_len.astype(np.int64), want)
