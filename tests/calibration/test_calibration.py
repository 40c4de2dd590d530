"""Confidence calibration: STS / isotonic fitting, metrics, maps, reliability HTML."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from input_checks import assert_rejects_file

from dspark_sim.calibration.confmap import (
    IDENTITY,
    CalibrationMap,
    isotonic_map,
    load_calibration,
    temperature_map,
)
from dspark_sim.calibration.fit import (
    ECE_BINS,
    auc,
    calibrate_confidence,
    calibration_metrics,
    ece,
    fit_isotonic,
    fit_sequential_temperature,
    format_report,
    write_reliability_html,
)
from dspark_sim.errors import InputError
from dspark_sim.traces.schema import AcceptanceTrace, TraceMeta, trace_from_frame


def synth_trace(n_req: int = 240, length: int = 50, gamma: int = 7, sharp: float = 2.0,
                seed: int = 0, source: str = "<synthetic>") -> AcceptanceTrace:
    """Known true conditional acceptance q; conf = sigmoid(sharp * logit(q)) (sharp > 1:
    over-confident); accept_len = leading Bernoulli(q) successes."""
    rng = np.random.default_rng(seed)
    n = n_req * length
    z = rng.normal(1.2, 1.3, size=(n, gamma)) - 0.15 * np.arange(gamma)
    q = 1.0 / (1.0 + np.exp(-z))
    conf = 1.0 / (1.0 + np.exp(-sharp * z))
    acc = rng.random((n, gamma)) < q
    m = np.argmin(np.concatenate([acc, np.zeros((n, 1), bool)], axis=1), axis=1)
    df = pl.DataFrame({
        "request_id": np.repeat(np.arange(n_req), length).astype(np.int32),
        "domain": ["chat"] * n,
        "position": np.tile(np.arange(length), n_req).astype(np.int32),
        "accept_len": m.astype(np.int8),
        "conf": pl.Series(conf.astype(np.float32), dtype=pl.Array(pl.Float32, gamma)),
    })
    return trace_from_frame(df, TraceMeta(drafter="synthetic", target="toy", gamma_max=gamma),
                            source)


@pytest.fixture(scope="module")
def overconfident() -> AcceptanceTrace:
    return synth_trace()


# -- metrics ---------------------------------------------------------------------------------


def test_ece_definition():
    # Two bins: preds 0.1 (observed 0.0) and 0.9 (observed 1.0) -> |0.1| and |0.1| -> 0.1.
    p = np.array([0.1, 0.1, 0.9, 0.9])
    y = np.array([0, 0, 1, 1])
    assert ece(p, y) == pytest.approx(0.1)
    # Perfectly calibrated in expectation.
    rng = np.random.default_rng(1)
    p = rng.random(200_000)
    assert ece(p, rng.random(p.size) < p) < 0.01
    assert ECE_BINS == 15


def test_auc_rank_based():
    assert auc([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]) == 1.0
    assert auc([0.9, 0.8, 0.2, 0.1], [0, 0, 1, 1]) == 0.0
    assert auc([0.5, 0.5, 0.5, 0.5], [0, 1, 0, 1]) == 0.5  # ties get average ranks
    assert np.isnan(auc([0.1, 0.2], [1, 1]))
    rng = np.random.default_rng(2)
    s = rng.random(5000)
    y = rng.random(5000) < s
    # Mann-Whitney equals the pairwise definition.
    pos, neg = s[y], s[~y]
    pairwise = (pos[:, None] > neg[None, :]).mean()
    assert auc(s, y) == pytest.approx(pairwise, abs=1e-9)


# -- fitting ---------------------------------------------------------------------------------


def test_sts_fixes_overconfidence(overconfident):
    cmap, rep = calibrate_confidence(overconfident, "temperature", holdout=0.3, seed=0)
    print(format_report(rep))
    assert cmap.method == "temperature" and cmap.drafter == "synthetic"
    assert rep["ece_bins"] == 15 and rep["split"]["by"] == "request"
    assert rep["ece_before_mean"] > 0.05
    assert rep["ece_after_mean"] < 0.02
    assert len(rep["positions"]) == overconfident.gamma_max  # the loop below checks each
    for p in rep["positions"]:
        assert p["ece_after"] < p["ece_before"]
        assert p["auc_after"] > p["auc_before"] - 0.01
    # conf = sigmoid(2 * logit(q)): the true temperature is 2 at every position.
    t = np.asarray(rep["params"]["temperatures"])
    assert np.all((t > 1.5) & (t < 2.8)), t


def test_isotonic_fixes_overconfidence(overconfident):
    cmap, rep = calibrate_confidence(overconfident, "isotonic", holdout=0.3, seed=0)
    print(format_report(rep))
    assert cmap.method == "isotonic" and len(cmap.iso_x) == overconfident.gamma_max
    assert rep["ece_before_mean"] > 0.05
    assert rep["ece_after_mean"] < 0.025
    assert rep["auc_after_mean"] > rep["auc_before_mean"] - 0.01


def test_sts_leaves_calibrated_confidences_alone():
    tr = synth_trace(n_req=160, sharp=1.0, seed=3)
    cmap, rep = calibrate_confidence(tr, "temperature", holdout=0.3, seed=1)
    assert rep["ece_before_mean"] < 0.03
    assert rep["ece_after_mean"] < 0.03
    t = cmap.temperatures
    # Early positions (many events) sit at ~1; deep ones are noisier.
    assert np.all((t[:4] > 0.7) & (t[:4] < 1.4)), t
    assert np.all((t > 0.5) & (t < 2.0)), t


def test_split_is_by_request_and_seeded(overconfident):
    _, a = calibrate_confidence(overconfident, holdout=0.25, seed=5)
    _, b = calibrate_confidence(overconfident, holdout=0.25, seed=5)
    _, c = calibrate_confidence(overconfident, holdout=0.25, seed=6)
    assert a["split"]["test_request_ids"] == b["split"]["test_request_ids"]
    assert a["split"]["test_request_ids"] != c["split"]["test_request_ids"]
    n_test = len(a["split"]["test_request_ids"])
    assert n_test == round(0.25 * overconfident.num_requests)
    assert a["split"]["test_rows"] == n_test * 50  # whole requests only


def test_temperature_map_by_hand():
    """c' = sigmoid(logit(c) / T): logit(0.8) = ln 4, so T = 2 gives sigmoid(ln 2) = 2/3;
    logit(0.9) = ln 9 -> sigmoid(ln 3) = 3/4; logit(0.2) = -ln 4 -> 1/3; 0.5 stays 0.5.
    Positions past the fitted block reuse the last temperature."""
    cmap = temperature_map([2.0, 1.0])
    conf = np.array([[0.8, 0.8, 0.9], [0.2, 0.5, 0.5], [0.5, 0.9, 0.2]])
    expected = np.array([[2 / 3, 0.8, 0.9], [1 / 3, 0.5, 0.5], [0.5, 0.9, 0.2]])
    np.testing.assert_allclose(cmap.apply(conf), expected, rtol=1e-12)
    np.testing.assert_allclose(cmap.survival(conf), np.cumprod(expected, axis=1), rtol=1e-12)
    # T = 1/2 sharpens: logit(0.8) * 2 = ln 16 -> 16/17
    np.testing.assert_allclose(temperature_map([0.5]).apply(np.array([[0.8]])), [[16 / 17]])
    np.testing.assert_array_equal(IDENTITY.apply(conf), conf)


def test_isotonic_map_by_hand():
    cmap = isotonic_map([[0.0, 0.5, 1.0], [0.0, 1.0]], [[0.1, 0.3, 0.9], [0.2, 0.4]])
    conf = np.array([[0.25, 0.5, 1.0], [0.75, 0.0, 0.25]])
    # position 1: 0.25 -> 0.2, 0.75 -> 0.6; position 2: 0.2 + 0.2 c; position 3 reuses 2
    expected = np.array([[0.2, 0.3, 0.4], [0.6, 0.2, 0.25]])
    np.testing.assert_allclose(cmap.apply(conf), expected, rtol=1e-12)


def test_maps_round_trip(tmp_path, overconfident):
    conf = overconfident.conf[:500]
    for method in ("temperature", "isotonic"):
        cmap, _ = calibrate_confidence(overconfident, method, holdout=0.3)
        path = cmap.save(tmp_path / f"{method}.toml")
        back = load_calibration(path)
        assert back.method == method and back.drafter == "synthetic"
        if method == "temperature":
            np.testing.assert_array_equal(back.temperatures, cmap.temperatures)
        else:
            for a, b in zip(back.iso_x + back.iso_y, cmap.iso_x + cmap.iso_y, strict=True):
                np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(back.apply(conf), cmap.apply(conf), rtol=1e-12, atol=1e-12)
        # the map changes the confidences (an identity would pass every check above)
        assert np.abs(back.apply(conf) - conf).max() > 0.05
        s = back.survival(conf)
        assert np.all(np.diff(s, axis=1) <= 1e-12) and np.all((s >= 0) & (s <= 1))


def test_temperature_pulls_overconfidence_towards_one_half(overconfident):
    """STS on over-confident confidences fits T > 1 at every position, and T > 1 moves every
    confidence towards 1/2 (without crossing it) while keeping each position's order."""
    temps = fit_sequential_temperature(overconfident.conf, overconfident.accept_len)
    assert np.all(temps > 1.2), temps
    raw = overconfident.conf.astype(np.float64)
    cal = temperature_map(temps).apply(raw)
    hi, lo = raw > 0.5 + 1e-6, raw < 0.5 - 1e-6
    assert np.all(cal[hi] < raw[hi]) and np.all(cal[hi] > 0.5)
    assert np.all(cal[lo] > raw[lo]) and np.all(cal[lo] < 0.5)
    for k in range(overconfident.gamma_max):
        order = np.argsort(raw[:, k], kind="stable")
        assert np.all(np.diff(cal[order, k]) >= -1e-12)


def test_isotonic_knots_are_monotone(overconfident):
    xs, ys = fit_isotonic(overconfident.conf, overconfident.accept_len)
    for x, y in zip(xs, ys, strict=True):
        assert x[0] == 0.0 and x[-1] == 1.0
        assert np.all(np.diff(x) > 0) and np.all(np.diff(y) >= 0)
        assert y.min() > 0 and y.max() < 1
    isotonic_map(xs, ys)  # validates


def test_pav_by_hand():
    """Pool adjacent violators on 4 points (x 0.1..0.4, outcomes 1, 0, 1, 1): the first two
    violate and pool to 0.5 at x 0.15, the equal last two pool to 1 at x 0.35 (blocks
    strictly increase); knots are the block centres, ends added at 0 and 1, values clipped
    to [0.001, 0.999]."""
    conf = np.array([[0.1], [0.2], [0.3], [0.4]])
    accept = np.array([1, 0, 1, 1])
    xs, ys = fit_isotonic(conf, accept, clip=1e-3)
    np.testing.assert_allclose(xs[0], [0.0, 0.15, 0.35, 1.0])
    np.testing.assert_allclose(ys[0], [0.5, 0.5, 0.999, 0.999])


def test_metrics_identity_vs_map(overconfident):
    """Per-position metrics of the raw confidences and of a temperature map, by hand."""
    c = overconfident.conf.astype(np.float64)
    m = overconfident.accept_len.astype(np.int64)
    base = calibration_metrics(c, m, IDENTITY)
    cmap = temperature_map([2.0] * overconfident.gamma_max)
    mapped = calibration_metrics(c, m, cmap)
    assert len(base) == len(mapped) == overconfident.gamma_max
    surv_raw = np.cumprod(c, axis=1)
    cc = np.clip(c, 1e-6, 1 - 1e-6)  # the map's logit is clipped so 0 and 1 stay finite
    surv_map = np.cumprod(1 / (1 + np.exp(-np.log(cc / (1 - cc)) / 2.0)), axis=1)
    for k in range(overconfident.gamma_max):
        ev = m >= k + 1
        for row, surv in ((base[k], surv_raw), (mapped[k], surv_map)):
            assert row["k"] == k + 1 and row["n"] == len(m)
            assert row["observed"] == pytest.approx(ev.mean())
            assert row["predicted"] == pytest.approx(surv[:, k].mean(), rel=1e-9)
            assert row["ece"] == pytest.approx(ece(surv[:, k], ev), rel=1e-9)
            assert row["auc"] == pytest.approx(auc(surv[:, k], ev), rel=1e-9)
            assert row["n_reached"] == int((m >= k).sum())
    # the true temperature is 2: the map fixes most of the over-confidence
    assert np.mean([r["ece"] for r in mapped]) < 0.5 * np.mean([r["ece"] for r in base])


def test_fit_never_sees_the_held_out_requests(overconfident):
    """The split depends on the request count, lengths and seed only. Rewriting every
    held-out request's acceptance leaves the fitted map bit-identical (the fit never read
    those rows) and changes only the held-out metrics; the held-out and fit request sets
    are disjoint and cover the trace, whole requests each."""
    from dataclasses import replace

    cmap, rep = calibrate_confidence(overconfident, "temperature", holdout=0.3, seed=4)
    test_ids = set(rep["split"]["test_request_ids"])
    req_of_row = np.repeat(overconfident.req_ids, overconfident.req_lengths)
    test_rows = np.isin(req_of_row, sorted(test_ids))
    assert 0 < len(test_ids) < overconfident.num_requests
    assert rep["split"]["test_rows"] == int(test_rows.sum())
    assert rep["split"]["fit_rows"] == int((~test_rows).sum())
    # fitted on exactly the other requests' rows
    own = fit_sequential_temperature(overconfident.conf[~test_rows],
                                     overconfident.accept_len[~test_rows])
    np.testing.assert_array_equal(cmap.temperatures, own)
    everything = fit_sequential_temperature(overconfident.conf, overconfident.accept_len)
    assert not np.array_equal(own, everything)  # leaking test rows would be visible
    poisoned = overconfident.accept_len.copy()
    poisoned[test_rows] = 0
    tr2 = replace(overconfident, accept_len=poisoned)
    cmap2, rep2 = calibrate_confidence(tr2, "temperature", holdout=0.3, seed=4)
    assert rep2["split"]["test_request_ids"] == rep["split"]["test_request_ids"]
    np.testing.assert_array_equal(cmap2.temperatures, cmap.temperatures)
    assert rep2["positions"][0]["observed"] == 0.0 != rep["positions"][0]["observed"]
    # isotonic too
    iso, _ = calibrate_confidence(overconfident, "isotonic", holdout=0.3, seed=4)
    iso2, _ = calibrate_confidence(tr2, "isotonic", holdout=0.3, seed=4)
    for a, b in zip(iso.iso_y, iso2.iso_y, strict=True):
        np.testing.assert_array_equal(a, b)


# -- bad input -------------------------------------------------------------------------------


def test_bad_inputs_raise_input_error(overconfident):
    c, m = overconfident.conf, overconfident.accept_len
    with pytest.raises(InputError, match="accept_len"):
        fit_sequential_temperature(c, m[:-1])
    with pytest.raises(InputError, match="non-empty"):
        fit_sequential_temperature(np.zeros((0, 7)), np.zeros(0, int))
    bad = c.astype(np.float64).copy()
    bad[3, 2] = np.nan
    with pytest.raises(InputError, match="NaN"):
        fit_isotonic(bad, m)
    with pytest.raises(InputError, match="NaN"):
        calibration_metrics(bad, m)
    with pytest.raises(InputError, match="outside"):
        fit_sequential_temperature(c, np.full(len(m), 9))
    with pytest.raises(InputError, match="^grid: temperature grid must be positive"):
        fit_sequential_temperature(c, m, grid=[0.0, 1.0])
    with pytest.raises(InputError, match="method"):
        calibrate_confidence(overconfident, "platt")
    with pytest.raises(InputError, match="holdout"):
        calibrate_confidence(overconfident, holdout=1.0)
    one = synth_trace(n_req=1, length=30, source="one.parquet")
    with pytest.raises(InputError, match="one.parquet"):
        calibrate_confidence(one, holdout=0.3)
    with pytest.raises(InputError, match="trace"):
        calibrate_confidence(np.zeros((3, 7)))
    with pytest.raises(InputError, match="temperatures must be a non-empty list of positive"):
        temperature_map([1.0, -2.0])
    with pytest.raises(InputError, match="isotonic row 0: x and y must be non-decreasing"):
        isotonic_map([[0.0, 1.0]], [[0.5, 0.2]])


@pytest.mark.parametrize("text, match", [
    ('[calibration]\nmethod = "temperature"\ntemperatures = [1.0, nan]\n', "positive"),
    ('[calibration]\nmethod = "magic"\n', "method"),
    # a misspelt key was ignored: "methd" gave the identity map; gamma was never read
    ('[calibration]\nmethd = "temperature"\ntemperatures = [1.5]\n', r"unknown key\(s\) methd"),
    ('[calibration]\nmethod = "temperature"\ngamma = "2"\ntemperatures = [1.5, 1.2]\n',
     "gamma must be a positive integer"),
    ('[calibration]\nmethod = "temperature"\ngamma = 7\ntemperatures = [1.5, 1.2]\n',
     "gamma = 7 but 2 temperatures"),
], ids=["nan-temperature", "unknown-method", "misspelt-key", "gamma-string", "gamma-count"])
def test_load_calibration_rejects_bad_files(tmp_path, text, match):
    assert_rejects_file(tmp_path / "bad_cal.toml", text, load_calibration, match)


def test_a_tiny_temperature_is_the_step_function_without_overflow_warnings(recwarn):
    """T -> 0 sharpens every confidence to 0 or 1; at T = 1e-300 logit/T and exp
    overflow to inf, which numpy reported on stderr beside the command's output."""
    cal = temperature_map([1e-300, 1.0])
    out = cal.apply(np.array([[0.2, 0.2], [0.7, 0.7]]))
    assert out[:, 0].tolist() == [0.0, 1.0] and np.allclose(out[:, 1], [0.2, 0.7])
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


# -- reliability diagram ---------------------------------------------------------------------


def test_reliability_html_self_contained(tmp_path, overconfident):
    cmap, rep = calibrate_confidence(overconfident, "temperature", holdout=0.3)
    out = write_reliability_html(tmp_path / "rel.html", overconfident, cmap, report=rep)
    text = out.read_text()
    assert "<script src=" not in text  # plotly.js is inlined, no CDN
    assert "Position 1" in text and "Position 7" in text
    assert "after calibration" in text and len(text) > 1_000_000
    assert isinstance(cmap, CalibrationMap)


# -- monotone survival (Hypothesis) ------------------------------------------------------------

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra.numpy import arrays  # noqa: E402

CONFS = arrays(np.float64, st.tuples(st.integers(1, 6), st.integers(1, 5)),
               elements=st.floats(0.0, 1.0))


@st.composite
def maps(draw, gamma: int):
    kind = draw(st.sampled_from(["identity", "temperature", "isotonic"]))
    if kind == "identity":
        return IDENTITY
    if kind == "temperature":
        return temperature_map(draw(st.lists(st.floats(0.05, 20.0), min_size=1,
                                             max_size=gamma)))
    xs, ys = [], []
    for _ in range(draw(st.integers(1, gamma))):
        k = draw(st.integers(2, 5))
        x = np.sort(np.array(draw(st.lists(st.floats(0, 1), min_size=k, max_size=k))))
        y = np.sort(np.array(draw(st.lists(st.floats(0, 1), min_size=k, max_size=k))))
        x[0], x[-1] = 0.0, 1.0
        xs.append(x)
        ys.append(y)
    return isotonic_map(xs, ys)


@given(st.data(), CONFS)
def test_survival_is_monotone_for_any_map(data, conf):
    """a_k = prod_{i<=k} c'_i with every c'_i in [0, 1]: non-increasing along the block,
    in [0, 1], and every calibrated confidence stays in [0, 1], for any valid map."""
    cmap = data.draw(maps(conf.shape[1]))
    cal = cmap.apply(conf)
    assert cal.shape == conf.shape and np.all((cal >= 0) & (cal <= 1))
    s = cmap.survival(conf)
    assert np.all(np.diff(s, axis=1) <= 0) and np.all((s >= 0) & (s <= 1))
    np.testing.assert_allclose(s[:, 0], cal[:, 0])


@given(st.data(), arrays(np.float32, st.tuples(st.integers(1, 9), st.integers(1, 5)),
                         elements=st.floats(0.0, 1.0, width=32)))
def test_survival_in_blocks_of_rows_is_the_whole_array_at_once(data, conf):
    """A trace's survivals are made a block of rows at a time (float32 confidences, as
    a trace stores them): the bits of the products over the whole array at once, for
    any map and any block size."""
    import dspark_sim.calibration.confmap as confmap

    cmap = data.draw(maps(conf.shape[1]))
    whole = np.cumprod(cmap.apply(conf), axis=-1)
    rows = data.draw(st.integers(1, 4))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(confmap, "SURVIVAL_ROWS", rows)
        got = cmap.survival(conf)
    assert got.dtype == np.float64 and got.tobytes() == whole.tobytes()


@given(arrays(np.int8, st.integers(1, 60), elements=st.integers(0, 4)), st.integers(1, 4))
def test_trace_survival_curves_are_monotone(m, k):
    """P(m >= j) per position and per served step: non-increasing in j, and the served
    curve sums to the served tau minus the bonus."""
    n = len(m)
    tr = AcceptanceTrace(meta=TraceMeta(drafter="x", target="y", gamma_max=4), accept_len=m,
                         conf=np.full((n, 4), 0.5, np.float32),
                         req_offsets=np.array([0, n // 2, n]), req_domain=np.array(["a", "a"]),
                         req_ids=np.arange(2, dtype=np.int32))
    per_pos = tr.survival()
    assert np.all(np.diff(per_pos) <= 0)
    np.testing.assert_allclose(per_pos, [(m >= j).mean() for j in range(1, 5)])
    served = tr.served_survival(k)
    assert np.all(np.diff(served) <= 0) and np.all((served >= 0) & (served <= 1))
    assert 1 + served.sum() == pytest.approx(tr.served_tau(k))
