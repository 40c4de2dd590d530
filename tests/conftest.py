"""Shared fixtures. Triton runs in interpreter mode when no NVIDIA driver is present."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

if shutil.which("nvidia-smi") is None:
    # Must be set before the first `import triton` anywhere in the session.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Hypothesis: no deadline (2 shared cores make timings noisy; speed lives in benchmarks/),
# derandomized in CI so a run is reproducible, and no example database when the mutation
# runner (benchmarks/mutation.py) replays the suite against thousands of mutants.
try:
    from hypothesis import HealthCheck, settings
except ImportError:  # the dev extra is not installed: the property tests fail to import
    pass
else:
    settings.register_profile("dev", deadline=None, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("ci", parent=settings.get_profile("dev"), derandomize=True)
    settings.register_profile("mutation", parent=settings.get_profile("ci"), database=None)
    settings.load_profile(os.environ.get("DSPARK_HYPOTHESIS_PROFILE",
                                         "ci" if os.environ.get("CI") else "dev"))

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


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
