"""The compiled step (``policies/compiled.py``, ``sim/fast.py``) against the numpy
reference it replaces: the same bits, on the golden runs and on random batches.

Both paths run in one process: the dispatchers read ``compiled.NUMBA`` on every call, so
flipping it selects the path. Without numba the compiled half skips; the numpy path is
then the only one and ``test_golden.py`` holds it to the stored bytes.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dspark_sim.policies import compiled, scheduler
from dspark_sim.policies.base import StepCost, readonly

numba = pytest.importorskip("numba")

GOLDEN = Path(__file__).resolve().parent / "data" / "golden"
_spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
MAKER = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(MAKER)


def _run_golden(name, out, monkeypatch, use_numba: bool) -> bytes:
    monkeypatch.setattr(compiled, "NUMBA", use_numba)
    MAKER.run(name, out)
    return (out / "summary.json").read_bytes()


@pytest.mark.parametrize("name", sorted(MAKER.RUNS))
def test_both_paths_give_the_same_bytes_on_the_golden_runs(tmp_path, monkeypatch, name):
    """Summaries (which carry the requests parquet's hash) byte for byte; the stored
    bytes themselves are test_golden.py's (whichever path is the default)."""
    ref = _run_golden(name, tmp_path / "numpy", monkeypatch, False)
    fast = _run_golden(name, tmp_path / "numba", monkeypatch, True)
    assert json.loads(ref)["engine_steps"] > 0
    assert fast == ref


def test_both_paths_agree_with_chunked_prefill_and_preemption(tmp_path, monkeypatch):
    """The confidence scheduler over chunked prefill, KV preemption and a finite token
    budget (the golden confidence run is disaggregated): every summary field equal."""
    from typer.testing import CliRunner

    from dspark_sim.cli import app

    args = ["run", "--policy", "confidence", "--qps", "30", "--num-requests", "250",
            "--seed", "5", "--replicas", "1", "--profile", "qwen3-8b-h100",
            "--max-num-seqs", "64", "--max-num-batched-tokens", "512",
            "--kv-capacity-tokens", "60000"]
    got = {}
    for use in (False, True):
        monkeypatch.setattr(compiled, "NUMBA", use)
        out = tmp_path / str(use)
        res = CliRunner().invoke(app, [*args, "--out", str(out)])
        assert res.exit_code == 0, res.output
        got[use] = json.loads((out / "summary.json").read_text())
    assert got[False]["preemptions"] > 0  # the run reaches the paths it is here for
    assert got[True] == got[False]


def _survival(draw_values, n, g):
    # a non-increasing prefix per row, values from a small set so ties are common
    a = np.array(draw_values[: n * g], dtype=np.float64).reshape(n, g)
    return np.minimum.accumulate(a, axis=1)


@given(n=st.integers(0, 40), g=st.integers(1, 8),
       values=st.lists(st.sampled_from([0.0, 0.125, 0.25, 0.5, 0.75, 0.9, 1.0]),
                       min_size=320, max_size=320),
       k=st.integers(-3, 330), lag_rows=st.integers(0, 80), pending=st.integers(0, 3000),
       budget=st.integers(1, 600), slope=st.floats(0.0, 1e-4), displacement=st.booleans())
def test_scheduler_kernels_equal_the_numpy_reference(n, g, values, k, lag_rows, pending,
                                                      budget, slope, displacement):
    survival = _survival(values, n, g)
    rng = np.random.default_rng(n * 1000 + g)
    lagged = np.minimum.accumulate(rng.choice([0.1, 0.5, 0.8, 1.0], (lag_rows, g)), axis=1)
    table = readonly(0.01 + 2e-5 * np.arange(budget + 1) + rng.random(budget + 1) * 1e-4)
    extra = readonly(1e-3 + 3e-6 * np.arange(n * g + 1))
    cost = StepCost(table, extra, pending, slope)

    def both(f):
        out, was = [], compiled.NUMBA
        try:
            for use in (False, True):
                compiled.NUMBA = use
                out.append(f())
        finally:
            compiled.NUMBA = was
        return out

    for ref, fast in (
        both(lambda: scheduler.schedule_topk(survival, k)),
        both(lambda: scheduler.stretch_sorted(scheduler.sorted_desc(lagged), n * g)),
    ):
        assert ref.dtype == fast.dtype and ref.tobytes() == fast.tobytes()
    estimate = scheduler.stretch_sorted(scheduler.sorted_desc(lagged), n * g)
    ref, fast = both(lambda: scheduler.budget_displacement(survival, cost, n, estimate,
                                                           displacement=displacement))
    assert ref == fast
    ref, fast = both(lambda: scheduler.budget_displacement(survival, cost))
    assert ref == fast


def test_the_switch_names_a_bad_backend(monkeypatch):
    monkeypatch.setenv("DSPARK_SIM_KERNELS", "fortran")
    with pytest.raises(SystemExit, match="DSPARK_SIM_KERNELS: 'fortran'"):
        compiled._choose()
    monkeypatch.setenv("DSPARK_SIM_KERNELS", "numpy")
    assert compiled._choose() is False
    monkeypatch.setenv("DSPARK_SIM_KERNELS", "numba")
    assert compiled._choose() is True
