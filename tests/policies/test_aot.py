"""The kernels compiled ahead of time (``policies/aot.py``): a process that runs them
imports no numba, every call the golden runs make stays in the compiled module, a call
with other argument types runs numba's dispatcher instead, as it always did, and the
module is built in the background, one build at a time, never imported half-written."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_sim.policies import aot, compiled

pytest.importorskip("numba")

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"


@pytest.fixture(scope="module")
def exports():
    """The compiled module's functions (built here, or by the background build a run
    started, waited for)."""
    got = aot.load(wait=True)
    if got is None:
        pytest.skip("the compiled module cannot be built here: "
                    + next(aot.cache_dir().glob("*.failed"), Path("no reason kept")).name)
    return got


def _fresh(code: str, **env: str) -> dict:
    """``code`` run in a fresh process; its last printed line, as JSON."""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, **env})
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_run_with_the_compiled_module_imports_no_numba(exports):
    got = _fresh(
        "import sys, json\nfrom dspark_sim.sim.api import simulate\n"
        "from dspark_sim.sim.config import preset\nfrom dspark_sim.sim import fast\n"
        "res = simulate(preset('tiny'))\n"
        "print(json.dumps({'completed': res.summary['completed'], "
        "'numba': 'numba' in sys.modules, 'llvmlite': 'llvmlite' in sys.modules, "
        "'bound': type(fast.replay_chain).__name__}))", DSPARK_SIM_KERNELS="numba")
    assert got == {"completed": 200, "numba": False, "llvmlite": False,
                   "bound": type(exports["dspark_sim.sim.fast.replay_chain"]).__name__}


def _golden_runs():
    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    return maker


def test_the_golden_runs_never_leave_the_compiled_module(exports, tmp_path, monkeypatch):
    """Every kernel call of every golden run has the exported argument types: none goes
    to numba's dispatcher (``EXPORTS`` is the engine's own calls, spelled out)."""
    maker = _golden_runs()
    compiled.bind()
    for namespace, name, func, _ in compiled._KERNELS:  # as bound in a fresh process
        if f"{func.__module__}.{name}" in exports:
            monkeypatch.setitem(namespace, name, exports[f"{func.__module__}.{name}"])
    fell_back = []
    module = sys.modules[aot.PREFIX + aot.key()]
    monkeypatch.setattr(module, "_fallback",
                        lambda name, args, kws: fell_back.append(name) or
                        aot.fallback(name, args, kws))
    monkeypatch.setattr(compiled, "NUMBA", True)
    for name in sorted(maker.RUNS):
        maker.run(name, tmp_path / name)
    assert fell_back == []


def test_a_call_of_other_types_runs_numbas_dispatcher(exports):
    """float32 survivals, a strided array where a C-ordered one is exported, a read-only
    array the kernel writes: each as numba's dispatcher takes it (compiled for it, or
    refused as it refuses it), never read as the exported types. (A fresh process: the
    fallback binds every kernel to numba's dispatchers.)"""
    got = _fresh(
        "import json\nimport numpy as np\nfrom dspark_sim.policies import aot\n"
        "import dspark_sim.sim.api\n"
        "k = aot.load()\n"
        "counts_at = k['dspark_sim.policies.compiled.counts_at']\n"
        "positions = k['dspark_sim.sim.fast.trace_positions']\n"
        "surv = np.array([[0.9, 0.5], [0.7, 0.2]])\n"
        "wide = np.array([[0.9, 0.0, 0.5, 0.0], [0.7, 0.0, 0.2, 0.0]])[:, ::2]\n"
        "got = [counts_at(surv, 0.5, 3).tolist(),\n"
        "       counts_at(surv.astype(np.float32), np.float32(0.5), 3).tolist(),\n"
        "       counts_at(wide, 0.5, 3).tolist()]\n"
        "batch = np.zeros((1, 12), np.int64)\n"
        "batch[0, 4], batch[0, 8] = 3, 10\n"  # GENERATED, TRACE_LEN
        "out = np.zeros(1, np.int64)\n"
        "positions(batch, 1, out)\n"
        "got.append(out.tolist())\n"
        "out.flags.writeable = False\n"
        "try:\n    positions(batch, 1, out)\n"
        "except Exception as e:\n    got.append(type(e).__name__)\n"
        "print(json.dumps(got))", DSPARK_SIM_KERNELS="numba")
    assert got == [[2, 1], [2, 1], [2, 1], [2], "TypingError"]


def test_a_build_that_failed_is_not_retried_and_the_dispatchers_run(tmp_path):
    """Where the module cannot be built (here: a failure kept for this key), the kernels
    are numba's dispatchers, and no process tries the build again."""
    cache = tmp_path / "numba-cache"
    env = {"NUMBA_CACHE_DIR": str(cache), "DSPARK_SIM_KERNELS": "numba"}
    path = Path(_fresh("import json\nfrom dspark_sim.policies import aot\n"
                       "print(json.dumps(str(aot.module_path())))", **env))
    path.parent.mkdir(parents=True)
    path.with_suffix(".failed").write_text("no compiler")
    got = _fresh("import sys, json\nimport numpy as np\n"
                 "from dspark_sim.policies import compiled\n"
                 "out = compiled.stretch_sorted(np.array([3.0, 1.0]), 4).tolist()\n"
                 "print(json.dumps([out, 'numba' in sys.modules]))", **env)
    assert got == [[3.0, 3.0, 1.0, 1.0], True]
    assert not path.exists()


def _module_path(env: dict) -> tuple[Path, str]:
    """Where a process with ``env`` looks for the module, and its temporary build
    folders' prefix."""
    path, k = _fresh("import json\nfrom dspark_sim.policies import aot\n"
                     "print(json.dumps([str(aot.module_path()), aot.key()]))", **env)
    return Path(path), f"build-{k}-"


def test_a_run_while_another_process_builds_waits_for_nothing(tmp_path):
    """A build under way elsewhere (its lock held) and a half-written module in its
    folder: a run starts no second build, imports nothing, and takes the numpy path."""
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba-cache"), "DSPARK_SIM_KERNELS": ""}
    path, building = _module_path(env)
    partial = path.parent / f"{building}x"
    partial.mkdir(parents=True)
    (partial / path.name).write_bytes(b"\x7fELF half")
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        got = _fresh("import sys, json\nfrom dspark_sim.policies import aot, compiled\n"
                     "print(json.dumps([aot.start_build(), aot.load(), "
                     "compiled.choose_for_run(1), 'numba' in sys.modules]))", **env)
    assert got == [False, None, False, False]
    assert {p.name for p in path.parent.iterdir()} == {partial.name,
                                                        path.with_suffix(".lock").name}


@pytest.mark.slow
def test_the_first_run_builds_the_module_in_the_background(tmp_path):
    """A fresh cache: ``run --num-requests 1`` returns before the module exists, with its
    build under way (the lock taken, a second start refused); the build, waited for,
    leaves the module in place, a killed build's folder gone, and later processes load
    it without numba."""
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba-cache"), "DSPARK_SIM_KERNELS": ""}
    path, building = _module_path(env)
    stale = path.parent / f"{building}old"
    stale.mkdir(parents=True)
    (stale / path.name).write_bytes(b"\x7fELF half")
    code = ("import sys\nfrom dspark_sim.cli import main\n"
            "sys.argv = ['dspark-sim', 'run', '--num-requests', '1', '--quiet']\nmain()")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, **env}, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert not path.exists()
    with open(path.with_suffix(".lock"), "a") as lock, pytest.raises(BlockingIOError):
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert _fresh("import json\nfrom dspark_sim.policies import aot\n"
                  "print(json.dumps(aot.start_build()))", **env) is False
    got = _fresh("import sys, json\nfrom dspark_sim.policies import aot\n"
                 "print(json.dumps([aot.load(wait=True) is not None, "
                 "'numba' in sys.modules]))", **env)
    assert got == [True, False]
    assert path.is_file() and not stale.exists()
    assert not path.with_suffix(".failed").exists()


def test_a_build_removes_only_its_own_cpus_older_modules(tmp_path):
    """The module is compiled for this machine's CPU (named after ``_`` in its key): a
    build removes the older modules built for this CPU or for none named, never those a
    machine with another CPU keeps in a folder they share."""
    names = ["aaaa_cpu1", "bbbb_cpu1", "cccc_cpu2", "dddd"]
    for name in names:
        (tmp_path / f"{aot.PREFIX}{name}.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    aot._prune(tmp_path, aot.PREFIX + "aaaa_cpu1")
    left = sorted(p.name.split(".")[0][len(aot.PREFIX):] for p in tmp_path.iterdir())
    assert left == ["aaaa_cpu1", "cccc_cpu2"]
    cpu = hashlib.sha256(aot._cpu_text().encode()).hexdigest()[:8]
    assert aot.key().rsplit("_", 1)[1] == cpu
