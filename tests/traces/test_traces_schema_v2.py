"""Schema-v2 columns: frame round trip, validation, derived replay quantities by hand;
the GSM8K answer key and exact-match scoring."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from dspark_sim.errors import InputError
from dspark_sim.traces import answers, schema_v2
from dspark_sim.traces.schema_v2 import V2Fields

G, K = 3, schema_v2.TOPK


def _fields(n=5, reqs=(2, 3), seed=0):
    rng = np.random.default_rng(seed)
    alt = np.sort(rng.dirichlet(np.ones(8), size=(n, G))[..., :K], axis=2)[..., ::-1]
    rank = np.array([[0, 0, 2], [1, -1, -1], [0, 5, 0], [0, 0, 0], [3, 0, 0]], np.int8)[:n]
    return V2Fields(
        alt_prob=alt.astype(np.float16), true_rank=rank,
        true_prob=alt[..., 0].astype(np.float16), draft_prob=alt[..., 0].astype(np.float16),
        draft_entropy=rng.uniform(0, 3, (n, G)).astype(np.float16),
        target_entropy=rng.uniform(0, 3, n).astype(np.float16),
        tgt_token=np.arange(n, dtype=np.int32),
        tgt_top1_logit=np.full((n, G), 10.0, np.float16),
        draft_tgt_logit=np.array([[10, 10, 7.5]] * n, np.float16),
        req_correct=np.array([1, -1][: len(reqs)], np.int8),
    )


def test_roundtrip_through_parquet(tmp_path):
    v = _fields()
    lengths = np.array([2, 3])
    cols = schema_v2.to_columns(v, lengths, G)
    assert cols["alt_prob"].dtype == pl.Array(pl.Float16, (G, K))
    assert cols["true_rank"].dtype == pl.Array(pl.Int8, G)
    df = pl.DataFrame(cols)
    df.write_parquet(tmp_path / "x.parquet")
    back = schema_v2.from_frame(pl.read_parquet(tmp_path / "x.parquet"), G, np.array([0, 2]), "x")
    assert back.present() == v.present() and len(v.present()) == 10  # every field _fields sets
    for name in v.present():
        assert np.array_equal(getattr(back, name), getattr(v, name)), name


def test_derived_quantities_by_hand():
    v = _fields()
    # run after a correct token at depth j = leading zeros of true_rank after j
    assert v.run_after().tolist() == [[1, 0, 0], [0, 0, 0], [0, 1, 0], [2, 1, 0], [2, 1, 0]]
    # width-1 tree = chain: leading zeros; width 3 also takes ranks 1, 2
    assert v.tree_accept_len(1).tolist() == [2, 0, 1, 3, 0]
    assert v.tree_accept_len(3).tolist() == [3, 1, 1, 3, 0]
    acc = v.alt_accepted()
    assert acc[1, 0].tolist() == [False, True, False, False] and not acc[1, 1].any()
    assert np.allclose(v.regret()[0], [0, 0, 2.5])
    sub = v.take(np.array([2, 3, 4]), np.array([1]))
    assert sub.req_correct.tolist() == [-1] and sub.true_rank.shape == (3, G)
    both = schema_v2.concat([v, V2Fields(true_rank=v.true_rank)])
    assert both.present() == ["true_rank"] and both.true_rank.shape == (10, G)


@pytest.mark.parametrize("column, value, message", [
    ("true_prob", 1.5, "outside"),
    ("true_rank", -3, "true_rank"),
    ("draft_entropy", -0.5, "negative"),
    ("tgt_top1_logit", np.inf, "infinite"),
])
def test_bad_values_are_refused(column, value, message):
    v = _fields()
    arr = getattr(v, column).copy()
    arr.flat[0] = value
    df = pl.DataFrame(schema_v2.to_columns(v, np.array([2, 3]), G)).with_columns(
        schema_v2.to_columns(V2Fields(**{column: arr}), np.array([2, 3]), G)[column])
    with pytest.raises(InputError, match=message):
        schema_v2.from_frame(df, G, np.array([0, 2]), "bad.parquet")


@pytest.mark.parametrize("where", ["entry", "row"])
def test_a_missing_integer_is_refused_as_missing_not_cast(where, recwarn):
    """A null in an integer array column (one entry, or a whole row) would read as NaN and
    cast to a garbage integer (with a numpy warning on stderr, and a range error that
    names the wrong fault): it is refused as missing."""
    cols = schema_v2.to_columns(_fields(), np.array([2, 3]), G)
    rank = cols["true_rank"].to_list()
    if where == "entry":
        rank[1][2] = None
    else:
        rank[1] = None
    df = pl.DataFrame(cols).with_columns(pl.Series("true_rank", rank, dtype=pl.Array(pl.Int8, G)))
    with pytest.raises(InputError, match="'true_rank' has missing"):
        schema_v2.from_frame(df, G, np.array([0, 2]), "bad.parquet")
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("column, dtype, value, message", [
    ("req_correct", pl.Int8, None, "'req_correct' has missing"),
    ("tgt_token", pl.Int32, None, "'tgt_token' has missing"),
    ("tgt_token", pl.Int64, 2**40, r"range of int32 \(\[-2147483648, 2147483647\]\)"),
    ("target_entropy", pl.Float64, 1e6, r"range of float16 \(\[-65504, 65504\]\)"),
    # a fraction was truncated (tgt_token 1.5 -> 1), a boolean read as 0 / 1
    ("tgt_token", pl.Float64, 1.5, "'tgt_token' must hold integers, got Float64"),
    ("req_correct", pl.Boolean, True, "'req_correct' must hold integers, got Boolean"),
    ("true_rank", pl.Array(pl.Float32, G), [0.5] * G,
     r"'true_rank' must hold integers, got Array\(Float32"),
    ("true_rank", pl.List(pl.Float64), [0.5] * G, "'true_rank' must hold integers"),
])
def test_per_row_values_that_would_not_survive_the_stored_type_are_refused(
        column, dtype, value, message, recwarn):
    """Stored as int8/int32/float16: a null or a value past the type's range would be cast
    to garbage (an integer wraps, a float16 becomes infinite), so it is refused."""
    fill = [1] * G if isinstance(dtype, pl.Array | pl.List) else (dtype == pl.Boolean or 1)
    df = pl.DataFrame({column: pl.Series([fill, fill, value, fill, fill], dtype=dtype)})
    with pytest.raises(InputError, match=message):
        schema_v2.from_frame(df, G, np.array([0, 2]), "bad.parquet")
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_correct_label_must_be_constant_per_request():
    df = pl.DataFrame({"req_correct": pl.Series([1, 1, 0, 0, 1], dtype=pl.Int8)})
    with pytest.raises(InputError, match="constant"):
        schema_v2.from_frame(df, G, np.array([0, 2]), "bad.parquet")
    df = pl.DataFrame({"alt_prob": schema_v2.to_columns(_fields(), np.array([2, 3]), G)["alt_prob"]
                       .to_numpy()[:, :, ::-1].copy()})
    df = df.with_columns(pl.col("alt_prob").cast(pl.Array(pl.Float16, (G, K))))
    with pytest.raises(InputError, match="descending"):
        schema_v2.from_frame(df, G, np.array([0, 2]), "bad.parquet")


def test_wrong_gamma_is_refused():
    df = pl.DataFrame(schema_v2.to_columns(_fields(), np.array([2, 3]), G))
    with pytest.raises(InputError, match="gamma_max=4"):
        schema_v2.from_frame(df, 4, np.array([0, 2]), "bad.parquet")


@pytest.mark.parametrize("text, want", [
    ("so she makes 9 * 2 = $18.\n\\boxed{18}", 18.0),
    ("The answer is \\boxed{\\frac{1}{2}} or \\boxed{1,200}", 1200.0),
    ("she has 3 apples then 70,000 dollars", 70000.0),
    ("no number here", None),
    ("cut off \\boxed{12", 12.0),  # unclosed box: falls back to the last number
])
def test_extract_answer(text, want):
    assert answers.extract_answer(text) == want


def test_gsm8k_key_lines_up_with_the_prompts():
    key = answers.answer_key("gsm8k")
    assert key is not None and len(key) == 1319
    assert key[:3] == ("18", "3", "70000")  # GSM8K test problems 1-3 (ducks, robe, house)
    assert answers.correctness("gsm8k", 0, "... makes \\boxed{18} dollars") == 1
    assert answers.correctness("gsm8k", 0, "... \\boxed{16}") == 0
    assert answers.correctness("math500", 0, "\\boxed{18}") == -1
    # traces.targets imports torch; the mutation runner (tools/mutation.py) runs
    # this file with torch blocked: the prompt-file half is skipped there
    PROMPT_DIR = pytest.importorskip("dspark_sim.traces.targets").PROMPT_DIR

    f = PROMPT_DIR / "gsm8k.jsonl"
    if not f.is_file():
        pytest.skip("shared prompts not present")
    import hashlib
    import json

    meta = json.loads((answers.ANSWER_DIR / "gsm8k.json").read_text())
    lines = [json.loads(x)["turns"][0] for x in f.read_text().splitlines() if x.strip()]
    for i in (0, 1, 500, 1318):  # each prompt starts with the question whose hash is stored
        q = lines[i].split("\nPlease reason step by step")[0].strip()
        assert hashlib.sha256(q.encode()).hexdigest()[:8] == meta["question_sha256_prefixes"][i]
