"""The serving front end (``frontend_us_per_request``): requests pass an API server one at
a time before the engine sees them, so requests sent together reach an idle engine in
turn and the first one's prefill runs alone (what vLLM's TTFTs show under a closed loop)."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_sim.calibration.profile import EngineLimits, EngineProfile, load_profile
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import DeploymentConfig, EngineConfig, SimConfig, WorkloadConfig


def _profile(frontend_s: float) -> EngineProfile:
    # a step costs 100 ms + 1 ms per batch token: a 100-token prompt prefills in 200 ms
    return EngineProfile(name="t", kind="measured", gpus_per_replica=1,
                         tokens=np.array([1, 4096]), step_s=np.array([0.101, 4.196]),
                         interpolation="linear", frontend_s_per_request=frontend_s,
                         limits=EngineLimits(max_num_seqs=16, max_num_batched_tokens=4096,
                                             kv_capacity_tokens=1 << 20))


def _closed(clients: int, n: int) -> SimConfig:
    return SimConfig(engine=EngineConfig(prefill="chunked"),
                     deployment=DeploymentConfig(replicas=1),
                     workload=WorkloadConfig(arrival="closed", max_concurrency=clients,
                                             num_requests=n, lengths="fixed:100:4"),
                     policy="none")


def test_without_a_front_end_simultaneous_requests_prefill_together():
    log = simulate(_closed(4, 4), profile=_profile(0.0)).requests
    ttft = (log["first_token_s"] - log["arrival_s"]).to_numpy()
    # one step of 400 prompt tokens: 100 + 400 ms for all four
    assert ttft == pytest.approx([0.5] * 4)


def test_a_front_end_lets_the_first_request_in_alone():
    log = simulate(_closed(4, 4), profile=_profile(0.010)).requests
    ttft = np.sort((log["first_token_s"] - log["arrival_s"]).to_numpy())
    # the first reaches the engine after 10 ms and prefills alone (200 ms); the other
    # three have passed the front end (20, 30, 40 ms) by then and prefill together in the
    # next step, beside the first one's decode token (100 + 301 ms)
    assert ttft[0] == pytest.approx(0.010 + 0.200)
    assert ttft[1:] == pytest.approx([0.210 + 0.401] * 3)


def test_front_end_time_round_trips_and_defaults_to_zero(tmp_path):
    prof = _profile(0.045)
    path = tmp_path / "p.toml"
    path.write_text(prof.to_toml())
    assert load_profile(path).frontend_s_per_request == pytest.approx(0.045)
    assert "frontend_us_per_request" not in _profile(0.0).to_toml()
    assert load_profile("v4flash-h200").frontend_s_per_request == 0.0
    bad = prof.to_toml().replace("frontend_us_per_request = 45000.0",
                                 "frontend_us_per_request = -1")
    path.write_text(bad)
    with pytest.raises(Exception, match="frontend_us_per_request"):
        load_profile(path)
