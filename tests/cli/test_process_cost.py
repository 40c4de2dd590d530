"""What a process imports: a command loads the heavy libraries only where it uses them
(the cost itself is measured by benchmarks/bench_peer.py, not asserted here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dspark_sim.policies import compiled
from dspark_sim.traces.schema import write_trace
from dspark_sim.traces.synth import synth_iid

HEAVY = ("polars", "pyarrow", "numba", "plotly", "torch")


def _loaded_after(code: str, env: dict | None = None) -> dict:
    """Which of HEAVY a fresh process has imported after ``code`` (``env``: its whole
    environment)."""
    probe = (f"import sys, json\n{code}\n"
             f"print(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_cli_loads_none_of_them():
    assert not any(_loaded_after("import dspark_sim.cli").values())


def test_a_short_run_of_a_cached_trace_loads_none_of_them(tmp_path):
    trace = write_trace(synth_iid(0.8, 3, num_requests=20, positions=300, seed=0),
                        tmp_path / "t.parquet")
    run = ("from dspark_sim.cli import main\n"
           "sys.argv = ['dspark-sim', 'run', '--replicas', '1', '--qps', '20', "
           "'--num-requests', '3', '--lengths', 'fixed:64:32', '--quiet', '--policy', "
           f"'fixed:3', '--trace', {str(trace)!r}, '--gamma-max', '3']\n"
           "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code")
    env = {k: v for k, v in os.environ.items() if k != "DSPARK_SIM_KERNELS"}
    env["DSPARK_SIM_CACHE_DIR"] = str(tmp_path / "cache")
    first = _loaded_after(run, env)
    assert first["polars"] and first["pyarrow"]  # the first read parses the file
    assert not any(_loaded_after(run, env).values())


@pytest.mark.parametrize(("requests", "env", "aot", "numba"), [
    (1, "", "building", False),
    (compiled.NUMPY_WHILE_BUILDING - 1, "", "building", False),
    (compiled.NUMPY_WHILE_BUILDING, "", "building", True), (None, "", "building", True),
    (1, "", "failed", False), (compiled.NUMPY_BELOW_REQUESTS - 1, "", "failed", False),
    (compiled.NUMPY_BELOW_REQUESTS, "", "failed", True), (None, "", "failed", True),
    (1, "numba", "building", True), (10**6, "numpy", "building", False),
    (1, "jit", "building", True), (1, "aot", "building", True),
    (1, "", "built", True), (10**6, "numpy", "built", False)])
def test_a_run_too_short_to_win_back_numba_takes_the_numpy_path(monkeypatch, requests, env,
                                                                  aot, numba):
    """Short runs take the numpy path while loading the kernels costs numba's import
    (and, while the module compiled ahead of time is being built, its compile too); with
    the module built they cost nothing to load."""
    monkeypatch.setenv("DSPARK_SIM_KERNELS", env)
    monkeypatch.setattr(compiled, "NUMBA", env != "numpy")
    monkeypatch.setattr(compiled, "_aot_state", lambda: aot)
    assert compiled.choose_for_run(requests) is numba and compiled.NUMBA is numba


def _blas_threads(env: dict) -> dict:
    """What a fresh process's environment holds for OpenBLAS after the console entry's
    first step, and what a vLLM process it starts would get."""
    probe = ("import os, json\n"
             "from dspark_sim.cli import single_threaded_blas\n"
             "single_threaded_blas()\n"
             "from dspark_sim.validation.vllm_live import foreign_env\n"
             "print(json.dumps([os.environ.get('OPENBLAS_NUM_THREADS'), "
             "foreign_env().get('OPENBLAS_NUM_THREADS')]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_command_runs_one_blas_thread_unless_told_and_its_children_get_theirs():
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_NUM_THREADS", "DSPARK_SIM_BLAS_DEFAULTED")}
    # chosen by the command: one thread; a vLLM process it starts has no setting
    assert _blas_threads(env) == ["1", None]
    # the user's own choice stands, for the command and for what it starts
    assert _blas_threads({**env, "OPENBLAS_NUM_THREADS": "4"}) == ["4", "4"]
