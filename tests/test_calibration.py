"""Confidence calibration: STS / isotonic fitting, metrics, maps, reliability HTML."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

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


def test_maps_round_trip(tmp_path, overconfident):
    conf = overconfident.conf[:500]
    for method in ("temperature", "isotonic"):
        cmap, _ = calibrate_confidence(overconfident, method, holdout=0.3)
        path = cmap.save(tmp_path / f"{method}.toml")
        back = load_calibration(path)
        assert back.method == method
        np.testing.assert_allclose(back.apply(conf), cmap.apply(conf), rtol=1e-12, atol=1e-12)
        s = back.survival(conf)
        assert np.all(np.diff(s, axis=1) <= 1e-12) and np.all((s >= 0) & (s <= 1))


def test_temperature_preserves_per_position_order(overconfident):
    temps = fit_sequential_temperature(overconfident.conf, overconfident.accept_len)
    cal = temperature_map(temps).apply(overconfident.conf)
    for k in range(overconfident.gamma_max):
        order = np.argsort(overconfident.conf[:, k], kind="stable")
        assert np.all(np.diff(cal[order, k]) >= -1e-12)


def test_isotonic_knots_are_monotone(overconfident):
    xs, ys = fit_isotonic(overconfident.conf, overconfident.accept_len)
    for x, y in zip(xs, ys, strict=True):
        assert x[0] == 0.0 and x[-1] == 1.0
        assert np.all(np.diff(x) > 0) and np.all(np.diff(y) >= 0)
        assert y.min() > 0 and y.max() < 1
    isotonic_map(xs, ys)  # validates


def test_metrics_identity_vs_map(overconfident):
    base = calibration_metrics(overconfident.conf, overconfident.accept_len, IDENTITY)
    assert len(base) == overconfident.gamma_max
    assert base[0]["observed"] == pytest.approx(float((overconfident.accept_len >= 1).mean()))


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
    with pytest.raises(InputError):
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
    with pytest.raises(InputError):
        temperature_map([1.0, -2.0])
    with pytest.raises(InputError):
        isotonic_map([[0.0, 1.0]], [[0.5, 0.2]])


def test_load_calibration_rejects_bad_files(tmp_path):
    p = tmp_path / "bad_cal.toml"
    p.write_text('[calibration]\nmethod = "temperature"\ntemperatures = [1.0, nan]\n')
    with pytest.raises(InputError, match="bad_cal.toml"):
        load_calibration(p)
    p.write_text('[calibration]\nmethod = "magic"\n')
    with pytest.raises(InputError, match="bad_cal.toml"):
        load_calibration(p)


# -- reliability diagram ---------------------------------------------------------------------


def test_reliability_html_self_contained(tmp_path, overconfident):
    cmap, rep = calibrate_confidence(overconfident, "temperature", holdout=0.3)
    out = write_reliability_html(tmp_path / "rel.html", overconfident, cmap, report=rep)
    text = out.read_text()
    assert "<script src=" not in text  # plotly.js is inlined, no CDN
    assert "Position 1" in text and "Position 7" in text
    assert "after calibration" in text and len(text) > 1_000_000
    assert isinstance(cmap, CalibrationMap)
