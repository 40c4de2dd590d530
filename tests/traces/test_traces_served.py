"""Served tau (per verify step, as a run counts it) vs the per-position mean; traces
without confidences run every policy that does not read them."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hand_oracles import served_tau_by_hand as _served_by_hand

from dspark_sim.errors import InputError
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import preset
from dspark_sim.traces.schema import AcceptanceTrace, TraceMeta
from dspark_sim.traces.synth import synth_iid


def _trace(rows: list[list[int]], gamma: int, conf: bool = True) -> AcceptanceTrace:
    m = np.concatenate([np.asarray(r, np.int8) for r in rows])
    lengths = [len(r) for r in rows]
    return AcceptanceTrace(
        meta=TraceMeta(drafter="d", target="t", gamma_max=gamma, domains=("x",)),
        accept_len=m,
        conf=np.full((len(m), gamma), 0.5, np.float32) if conf else None,
        req_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        req_domain=np.full(len(rows), "x"),
        req_ids=np.arange(len(rows), dtype=np.int32),
    )


def test_served_tau_matches_a_step_by_step_chain():
    rng = np.random.default_rng(5)
    rows = [rng.integers(0, 6, size=int(n)).tolist() for n in rng.integers(1, 90, size=25)]
    t = _trace(rows, 5)
    for k in range(6):
        assert t.served_tau(k) == pytest.approx(_served_by_hand(rows, k), rel=1e-12)
    tokens, steps = t.served_tau_per_request(3)
    assert tokens.sum() / steps.sum() == pytest.approx(_served_by_hand(rows, 3), rel=1e-12)


@pytest.mark.parametrize("alpha", [0.6, 0.85])
def test_served_tau_equals_leviathan_for_iid(alpha):
    t = synth_iid(alpha, 7, num_requests=64, positions=600, seed=11)
    for k in (1, 3, 7):
        leviathan = (1 - alpha ** (k + 1)) / (1 - alpha)
        # with independent positions the chain sees the same law as the position mean
        assert t.served_tau(k) == pytest.approx(leviathan, rel=0.015)
        assert t.served_tau(k) == pytest.approx(t.tau(k), rel=0.015)


def test_served_tau_below_position_mean_on_a_bursty_trace():
    # an easy stretch (every draft accepted) then a hard one (none): the chain covers the
    # easy half in 32 steps of 8 tokens and the hard half in 256 steps of 1 token.
    rows = [[7] * 256 + [0] * 256]
    t = _trace(rows, 7)
    assert t.tau(7) == pytest.approx(4.5)  # (8 + 1) / 2 per position
    assert t.served_tau(7) == pytest.approx(512 / (32 + 256))
    assert t.served_tau(7) < t.tau(7)


def test_trace_without_conf_runs_non_confidence_policies_only():
    cfg = replace(preset("tiny"), policy="fixed:3")
    tr = _trace([[2, 0, 3, 1] * 50] * 4, 3, conf=False)
    res = simulate(cfg, trace=tr)
    assert res.summary["completed"] == res.summary["num_requests"] > 0
    assert res.summary["spec_decode_acceptance_length"] > 1.0
    plain = simulate(replace(cfg, policy="none"), trace=tr).summary
    assert plain["completed"] == plain["num_requests"] and plain["num_draft_tokens_verified"] == 0
    for pol in ("confidence", "threshold:0.5"):
        with pytest.raises(InputError, match="no 'conf' column") as exc:
            simulate(replace(cfg, policy=pol), trace=tr)
        assert "\n" not in str(exc.value)


def test_inspect_names_both_taus(tmp_path):
    from typer.testing import CliRunner

    from dspark_sim.cli import app
    from dspark_sim.traces.schema import write_trace

    def row7(path):
        r = CliRunner().invoke(app, ["traces", "inspect", str(path)])
        assert r.exit_code == 0, r.output
        row = next(ln for ln in r.output.splitlines() if ln.startswith("│ 7 "))
        return r.output, [c.strip() for c in row.strip("│ ").split("│")]

    tr = _trace([[7] * 256 + [0] * 256], 7, conf=False)
    out, cells = row7(write_trace(tr, tmp_path / "b.parquet"))
    # served 512 tokens / 288 steps, per request-step; per proposal is the same (the drafter
    # proposes at every step) and left out; per-position 4.5
    assert cells == ["7", "1.78", "4.50"]
    assert "per req-step" in out and "per proposal is not shown" in out
    assert "no confidences" in out and "mean raw confidence" not in out
    # the same acceptance where the second half proposed nothing: per request-step as
    # before, per proposal 256 tokens / 32 steps with a proposal = 8
    drafts = np.r_[np.full(256, 7), np.zeros(256)].astype(np.int8)
    out, cells = row7(write_trace(replace(tr, draft_tokens=drafts), tmp_path / "n.parquet"))
    assert cells == ["7", "8.00", "1.78", "4.50"]
    assert "per proposal" in out and "not shown" not in out
