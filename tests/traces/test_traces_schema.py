"""Trace schema v1: round trip, derived statistics, validation of malformed files."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from dspark_sim.errors import InputError
from dspark_sim.traces.schema import (
    META_KEY,
    TraceMeta,
    load_trace,
    read_trace,
    trace_from_frame,
    write_trace,
)
from dspark_sim.traces.synth import DSPARK_CURVES, synth_drafter, synth_iid


def test_round_trip(tmp_path):
    t = synth_iid(0.75, 5, num_requests=4, positions=50, seed=3)
    p = write_trace(t, tmp_path / "t.parquet")
    u = read_trace(p)
    assert u.meta.gamma_max == 5 and u.meta.source == "synthetic"
    assert np.array_equal(u.accept_len, t.accept_len)
    assert np.array_equal(u.conf, t.conf)
    assert np.array_equal(u.req_offsets, t.req_offsets)
    assert u.meta.generator["alpha"] == 0.75


def test_iid_statistics():
    t = synth_iid(0.8, 6, num_requests=50, positions=400, seed=0)
    assert t.tau(3) == pytest.approx((1 - 0.8**4) / 0.2, rel=0.02)
    assert np.allclose(t.conditional_acceptance(), 0.8, atol=0.02)
    assert np.allclose(t.survival(), 0.8 ** np.arange(1, 7), atol=0.02)


def test_synthetic_drafter_matches_published_domain_tau():
    # a fresh seed and size: the decay is solved on each generated sample's served tau
    t = synth_drafter(DSPARK_CURVES, requests_per_domain=24, positions=256, seed=2)
    table1 = {"math": 5.57, "code": 5.12, "chat": 3.49}  # DSpark Table 1 domain means
    for curve in DSPARK_CURVES:
        sub = t.select_domain(curve.domain)
        assert sub.served_tau(7) == pytest.approx(table1[curve.domain], rel=0.02), curve.domain
        assert sub.served_tau(7) < sub.tau(7)  # bursty text: the chain meets hard stretches
        cond = sub.conditional_acceptance()
        assert cond[0] == pytest.approx(curve.p1, abs=0.02)
        assert cond[-1] < cond[0]  # suffix decay of a parallel drafter
    # raw confidences are informative but over-confident
    conf1 = t.conf[:, 0]
    acc1 = t.accept_len >= 1
    assert conf1[acc1].mean() > conf1[~acc1].mean() + 0.1


def test_builtin_traces_serve_the_published_tau():
    d = load_trace("dspark-synthetic")
    m = load_trace("mtp1-synthetic")
    assert d.gamma_max == 7 and m.gamma_max == 1
    assert set(d.meta.domains) == {"math", "code", "chat"}
    assert d.meta.extra["calibration"] == "dspark-synthetic-sts"
    for dom, tau in {"math": 5.57, "code": 5.12, "chat": 3.49}.items():  # Table 1
        assert d.select_domain(dom).served_tau(7) == pytest.approx(tau, rel=0.02), dom
    # MTP-1 at one speculative token: InferenceX golden AL 1.92 (coding split), and
    # DeepSeek-V3's second-token acceptance of 85-90 % over the whole mix
    assert m.select_domain("code").served_tau(1) == pytest.approx(1.92, rel=0.02)
    assert 0.85 <= m.served_tau(1) - 1 <= 0.90


def _frame(g=3):
    return pl.DataFrame({
        "request_id": [0, 0, 1],
        "domain": ["math"] * 3,
        "position": [0, 1, 0],
        "accept_len": [1, 3, 0],
        "conf": pl.Series([[0.9, 0.8, 0.5]] * 3, dtype=pl.Array(pl.Float32, g)),
    })


META = TraceMeta(drafter="d", target="t", gamma_max=3)


def test_validation_errors(tmp_path):
    ok = trace_from_frame(_frame(), META)  # valid: two requests, rows in file order
    assert ok.accept_len.tolist() == [1, 3, 0] and ok.req_offsets.tolist() == [0, 2, 3]
    assert ok.req_domain.tolist() == ["math", "math"] and ok.conf.shape == (3, 3)
    with pytest.raises(InputError, match="missing column.*accept_len"):
        trace_from_frame(_frame().drop("accept_len"), META, "x.parquet")
    with pytest.raises(InputError, match="accept_len out of"):
        trace_from_frame(_frame().with_columns(pl.lit(9).alias("accept_len")), META, "x")
    with pytest.raises(InputError, match="not contiguous"):
        trace_from_frame(_frame().with_columns(pl.Series("position", [0, 2, 0])), META, "x")
    # the error names the first row out of place (row 1: request 0's second row), not row 0
    with pytest.raises(InputError, match=r"positions of request 0 are not contiguous from 0 \(row 1\)"):
        trace_from_frame(_frame().with_columns(pl.Series("position", [0, 2, 0])), META, "x")
    # one confidence below 0 among valid ones is refused like a NaN
    with pytest.raises(InputError, match="outside"):
        trace_from_frame(_frame().with_columns(pl.Series(
            "conf", [[0.9, 0.8, 0.5], [0.9, -0.1, 0.5], [0.9, 0.8, 0.5]],
            dtype=pl.Array(pl.Float32, 3))), META, "x")
    # ... and one above 1 (1.5: a probability cannot be), while 1.0 itself is one
    with pytest.raises(InputError, match="outside"):
        trace_from_frame(_frame().with_columns(pl.Series(
            "conf", [[0.9, 0.8, 0.5], [0.9, 1.5, 0.5], [0.9, 0.8, 0.5]],
            dtype=pl.Array(pl.Float32, 3))), META, "x")
    assert trace_from_frame(_frame().with_columns(pl.Series(
        "conf", [[1.0, 0.0, 0.5]] * 3, dtype=pl.Array(pl.Float32, 3))), META).conf.max() == 1.0
    # confidences as lists: each row must hold gamma_max values, every row checked
    lists = pl.Series("conf", [[0.9, 0.8, 0.5], [0.9, 0.8], [0.9, 0.8, 0.5]],
                      dtype=pl.List(pl.Float32))
    with pytest.raises(InputError, match="'conf' rows must have gamma_max=3 values"):
        trace_from_frame(_frame().with_columns(lists), META, "x")
    ok_lists = trace_from_frame(_frame().with_columns(
        pl.Series("conf", [[0.9, 0.8, 0.5]] * 3, dtype=pl.List(pl.Float32))), META, "x")
    assert np.allclose(ok_lists.conf, [[0.9, 0.8, 0.5]] * 3)
    # zero-token prompts and outputs are lengths (a request may be empty); negative are not
    zero = trace_from_frame(_frame().with_columns(pl.Series("prompt_tokens", [0, 0, 5]),
                                                  pl.Series("output_tokens", [3, 3, 0])), META)
    assert zero.req_prompt_tokens.tolist() == [0, 5] and zero.req_output_tokens.tolist() == [3, 0]
    with pytest.raises(InputError, match="negative prompt_tokens at row 2"):
        trace_from_frame(_frame().with_columns(pl.Series("prompt_tokens", [0, 0, -1])), META)
    with pytest.raises(InputError, match="outside"):
        bad = _frame().with_columns(
            pl.Series("conf", [[0.9, float("nan"), 0.5]] * 3, dtype=pl.Array(pl.Float32, 3)))
        trace_from_frame(bad, META, "x")
    with pytest.raises(InputError, match="no rows"):
        trace_from_frame(_frame().clear(), META, "x")
    with pytest.raises(InputError, match="gamma_max"):
        trace_from_frame(_frame(), replace(META, gamma_max=4), "x")


def test_read_errors_name_the_file(tmp_path):
    p = tmp_path / "plain.parquet"
    _frame().write_parquet(p)  # a parquet file without trace metadata
    with pytest.raises(InputError, match=str(p)):
        read_trace(p)
    table = _frame().to_arrow()
    table = table.replace_schema_metadata({META_KEY: b'{"schema_version": 7}'})
    q = tmp_path / "v7.parquet"
    pq.write_table(table, q)
    with pytest.raises(InputError, match="schema_version"):
        read_trace(q)
    with pytest.raises(InputError, match="not found"):
        read_trace(tmp_path / "missing.parquet")
    with pytest.raises(InputError, match="unknown trace"):
        load_trace("no-such-trace")


def test_write_is_atomic(tmp_path, monkeypatch):
    t = synth_iid(0.5, 2, num_requests=2, positions=10)
    p = write_trace(t, tmp_path / "t.parquet")
    before = p.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", boom)
    with pytest.raises(OSError, match="disk full"):
        write_trace(synth_iid(0.9, 2, num_requests=2, positions=10), p)
    assert p.read_bytes() == before
    assert [x.name for x in tmp_path.iterdir()] == ["t.parquet"]


def test_trace_without_confidences_round_trips(tmp_path):
    t = trace_from_frame(_frame().drop("conf"), META, "x")
    assert t.conf is None and not t.has_conf
    u = read_trace(write_trace(t, tmp_path / "noconf.parquet"))
    assert u.conf is None and np.array_equal(u.accept_len, [1, 3, 0])
    assert u.select_domain("math").conf is None


def test_string_ids_and_request_lengths_kept_in_file_order(tmp_path):
    df = pl.DataFrame({
        "request_id": ["q-b", "q-a", "q-b", "q-a", "q-a"],  # interleaved, not sorted
        "domain": ["chat", "math", "chat", "math", "math"],
        "position": [1, 0, 0, 2, 1],
        "accept_len": [2, 0, 1, 3, 1],
        "prompt_tokens": [40, 7, 40, 7, 7],
        "output_tokens": [2, 3, 2, 3, 3],
    })
    t = trace_from_frame(df, META, "s")
    # first appearance order: q-b, then q-a; positions sorted within each
    assert t.req_ids.tolist() == ["q-b", "q-a"]
    assert t.accept_len.tolist() == [1, 2, 0, 1, 3]
    assert t.req_prompt_tokens.tolist() == [40, 7] and t.req_output_tokens.tolist() == [2, 3]
    u = read_trace(write_trace(t, tmp_path / "s.parquet"))
    assert u.req_ids.tolist() == ["q-b", "q-a"]
    assert u.req_prompt_tokens.tolist() == [40, 7] and u.has_lengths
    sub = u.select_domain("math")
    assert sub.req_ids.tolist() == ["q-a"] and sub.req_output_tokens.tolist() == [3]
    with pytest.raises(InputError, match="prompt_tokens differs between rows of request q-a"):
        trace_from_frame(df.with_columns(pl.Series("prompt_tokens", [40, 7, 40, 8, 7])), META, "s")


def test_float_accept_len_is_refused_not_truncated():
    bad = _frame().with_columns(pl.Series("accept_len", [1.0, 2.5, 0.0]))
    with pytest.raises(InputError, match="accept_len.*integers"):
        trace_from_frame(bad, META, "f.parquet")
    with pytest.raises(InputError, match="accept_len out of"):
        trace_from_frame(_frame().with_columns(pl.Series("accept_len", [1, -1, 0])), META, "x")


@pytest.mark.parametrize("key,value", [
    ("gamma_max", "abc"), ("gamma_max", 2.5), ("gamma_max", True), ("gamma_max", 0),
    ("temperature", "hot"), ("temperature", -1), ("drafter", 3), ("domains", "math"),
    pytest.param("temperature", 10**400, id="temperature-past-float64"),  # np.isfinite raised
    ("generator", [1]), ("calibration", 5), ("source", "made-up"),
    # true == 1 and 1.0 == 1: `in (1, 2)` took them for schema v1
    ("schema_version", True), ("schema_version", 1.0), ("schema_version", "1"),
])
def test_wrong_typed_metadata_is_one_line_error(tmp_path, key, value):
    import json

    meta = json.loads(META.to_json())
    meta[key] = value
    table = _frame().to_arrow().replace_schema_metadata({META_KEY: json.dumps(meta).encode()})
    p = tmp_path / "m.parquet"
    pq.write_table(table, p)
    with pytest.raises(InputError, match=key) as exc:
        read_trace(p)
    assert str(p) in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("domain,match", [
    (pl.Series("domain", [None, "math", "math"], dtype=pl.Utf8), "'domain' has a missing value at row 0"),
    (pl.Series("domain", [3, 3, 3]), "'domain' must hold strings, got Int64"),
])
def test_a_domain_column_that_is_not_strings_is_refused(domain, match):
    """Read as strings, a null domain would become the domain "None" (and a number "3"),
    and a run of ``--domain math`` would silently drop that request."""
    with pytest.raises(InputError, match=match):
        trace_from_frame(_frame().with_columns(domain), META, "d.parquet")
    cat = trace_from_frame(_frame().with_columns(pl.col("domain").cast(pl.Categorical)), META)
    assert cat.req_domain.tolist() == ["math", "math"]


def test_integer_ids_past_int32_keep_their_digits(tmp_path):
    """Ids were cast to int32, so 2**32 wrapped round to request 0's id: two requests,
    one id. Past int32 they are kept as their digits (as the importers keep them), in
    numeric order, and read back the same."""
    df = _frame().with_columns(pl.Series("request_id", [2**32, 2**32, 0], dtype=pl.Int64))
    t = trace_from_frame(df, META, "x")
    assert t.req_ids.tolist() == ["0", str(2**32)]
    assert t.accept_len.tolist() == [0, 1, 3]  # request 0's row first, numeric order
    u = read_trace(write_trace(t, tmp_path / "ids.parquet"))
    assert u.req_ids.tolist() == ["0", str(2**32)] and u.accept_len.tolist() == [0, 1, 3]
    big = _frame().with_columns(pl.Series("request_id", [2**64 - 1] * 2 + [1], dtype=pl.UInt64))
    assert trace_from_frame(big, META).req_ids.tolist() == ["1", str(2**64 - 1)]
    small = trace_from_frame(_frame().with_columns(pl.col("request_id").cast(pl.UInt8)), META)
    assert small.req_ids.dtype == np.int32 and small.req_ids.tolist() == [0, 1]


@pytest.mark.parametrize("name", ["no-such-map", "../../etc/passwd"])
def test_a_calibration_map_the_metadata_names_must_be_built_in(name):
    """The metadata names a built-in map; any other value (a path read relative to the
    working folder, a name not shipped) is refused naming the trace, not the name."""
    from dspark_sim.sim.api import resolve_calibration
    from dspark_sim.sim.config import preset

    t = trace_from_frame(_frame(), replace(META, extra={"calibration": name}), "m.parquet")
    with pytest.raises(InputError, match=r"^m.parquet: trace metadata 'calibration' names"):
        resolve_calibration(preset("tiny"), t)
    ok = replace(t, meta=replace(META, extra={"calibration": "dspark-synthetic-sts"}))
    assert resolve_calibration(preset("tiny"), ok).source == "builtin:dspark-synthetic-sts"
    # --calibration wins: the trace's name is not looked at
    given = replace(preset("tiny"), calibration="identity")
    assert resolve_calibration(given, t).is_identity


def test_metadata_without_a_temperature_is_greedy(tmp_path):
    """temperature is optional in the metadata; absent, the trace was decoded greedily
    (0.0), so even a captured trace replays exactly."""
    import json

    table = _frame().to_arrow()
    meta = {"schema_version": 1, "drafter": "d", "target": "t", "gamma_max": 3,
            "source": "captured"}
    pq.write_table(table.replace_schema_metadata({META_KEY: json.dumps(meta).encode()}),
                   tmp_path / "t.parquet")
    t = read_trace(tmp_path / "t.parquet")
    assert t.meta.temperature == 0.0 and t.meta.replay_exact


def test_traces_of_different_gamma_max_are_not_concatenated():
    from dspark_sim.traces.schema import concat_traces

    a = trace_from_frame(_frame(), META)
    b = trace_from_frame(_frame().with_columns(
        pl.Series("conf", [[0.9, 0.8, 0.5, 0.1]] * 3, dtype=pl.Array(pl.Float32, 4))),
        replace(META, gamma_max=4))
    assert concat_traces([a, a]).num_requests == 4
    with pytest.raises(InputError, match="different gamma_max"):
        concat_traces([a, a, b])  # one differs: refused (not only when all do)


def _with_draft_tokens(d):
    return _frame().with_columns(pl.Series("draft_tokens", d))


def test_draft_tokens_round_trip_select_and_concat(tmp_path):
    """The optional draft_tokens column (an n-gram drafter that proposes nothing without
    a match) reads, writes, follows row selection and concatenation; a trace without it
    is byte-identical to one written before it existed."""
    from dspark_sim.traces.schema import concat_traces

    t = trace_from_frame(_with_draft_tokens([1, 3, 0]), META, "x")
    assert t.draft_tokens.dtype == np.int8 and t.draft_tokens.tolist() == [1, 3, 0]
    assert t.draft_fraction == pytest.approx(2 / 3)
    u = read_trace(write_trace(t, tmp_path / "d.parquet"))
    assert u.draft_tokens.tolist() == [1, 3, 0] and u.schema_version == 1
    assert pq.read_schema(tmp_path / "d.parquet").field("draft_tokens").type == "int8"
    two = concat_traces([t, replace(t, meta=replace(t.meta, domains=("code",)),
                                    req_domain=np.array(["code", "code"]))])
    assert two.select_domain("code").draft_tokens.tolist() == [1, 3, 0]
    # a trace without the column drafted gamma_max everywhere: filled so
    plain = trace_from_frame(_frame(), META)
    assert plain.draft_tokens is None and plain.draft_fraction == 1.0
    assert concat_traces([plain, t]).draft_tokens.tolist() == [3, 3, 3, 1, 3, 0]
    assert concat_traces([plain, plain]).draft_tokens is None
    a, b = write_trace(plain, tmp_path / "a.parquet"), write_trace(plain, tmp_path / "b.parquet")
    assert "draft_tokens" not in pq.read_schema(a).names
    assert a.read_bytes() == b.read_bytes() == write_trace(
        read_trace(a), tmp_path / "c.parquet").read_bytes()


@pytest.mark.parametrize("d,match", [
    ([1, 4, 0], r"draft_tokens out of \[0, 3\] at row 1 \(value 4\)"),
    ([1, 3, -1], r"draft_tokens out of \[0, 3\] at row 2"),
    ([0, 3, 0], "accept_len 1 exceeds draft_tokens 0 at row 0"),
    ([1.0, 3.0, 0.0], "column 'draft_tokens' must hold integers"),
    ([1, None, 0], "column 'draft_tokens' has a missing value at row 1"),
])
def test_draft_tokens_validation(d, match):
    with pytest.raises(InputError, match=f"^x: {match}"):
        trace_from_frame(_with_draft_tokens(d), META, "x")


def test_served_statistics_with_no_draft_positions():
    """A step at a position without drafts emits one token (served tau counts it, as a
    run does); the served survival counts only the steps with drafts, as vLLM does."""
    from hand_oracles import served_tau_by_hand

    t = synth_iid(0.7, 3, num_requests=64, positions=400, seed=2)
    rng = np.random.default_rng(0)
    d = np.where(rng.random(t.num_positions) < 0.4, 3, 0).astype(np.int8)
    t = replace(t, accept_len=np.where(d > 0, t.accept_len, 0).astype(np.int8), draft_tokens=d)
    # by hand: a step at t accepts min(k, m_t, draft_tokens_t), then the bonus token
    o = t.req_offsets
    rows = [np.minimum(t.accept_len, d)[o[r]:o[r + 1]].tolist() for r in range(t.num_requests)]
    assert t.served_tau(3) == pytest.approx(served_tau_by_hand(rows, 3))
    surv = t.served_survival(3)
    assert surv == pytest.approx(0.7 ** np.arange(1, 4), abs=0.02)
    # i.i.d.: the chain's steps draft at the trace's fraction
    assert t.served_tau(3) == pytest.approx(1 + t.draft_fraction * surv.sum(), rel=0.01)
