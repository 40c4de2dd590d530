"""An open loop's arrivals and prefill instances computed ahead (``sim/ahead.py``) against
the SimPy processes they stand for (``OpenLoop`` + ``PrefillPool``): the same summary and
the same per-request rows, through queueing, chunked prompts, the front end, refusals,
one-token answers and both ways a run stops; and where the order of two events at one
instant is not known ahead, the run is simulated again as SimPy processes."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dspark_sim.calibration.profile import EngineProfile, load_profile
from dspark_sim.policies import compiled
from dspark_sim.sim import ahead, api
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import DeploymentConfig, EngineConfig, SimConfig, WorkloadConfig

pytest.importorskip("numba")

class _Spy:
    """Stands for ``api.Handoffs``: counts the runs computed ahead and the ones it gave up."""

    def __init__(self) -> None:
        self.made: list[ahead.Handoffs] = []
        self.gave_up: list[str] = []

    def __call__(self, *args, **kwargs):
        obj = ahead.Handoffs(*args, **kwargs)
        self.made.append(obj)
        finish = obj.finish

        def checked():
            try:
                finish()
            except ahead.NotAhead as e:
                self.gave_up.append(str(e))
                raise
        obj.finish = checked
        return obj


def _refuse(*args, **kwargs):
    raise ahead.NotAhead("the reference: SimPy processes")


def _frames_equal(a, b) -> bool:
    if a.columns != b.columns or a.height != b.height:
        return False
    for name in a.columns:
        x, y = a[name].to_numpy(), b[name].to_numpy()
        if x.dtype.kind == "f":
            if not np.array_equal(x, y, equal_nan=True):
                return False
        elif not np.array_equal(x, y):
            return False
    return True


def _ahead_and_reference(monkeypatch, cfg: SimConfig, name: str, spy, profile=None):
    """(the run with ``api.<name>`` computed ahead through ``spy``, the run with the
    SimPy processes instead, the spy)."""
    with monkeypatch.context() as m:
        m.setattr(api, name, spy)
        fast = simulate(cfg, profile=profile)
    with monkeypatch.context() as m:
        m.setattr(api, name, _refuse)
        ref = simulate(cfg, profile=profile)
    return fast, ref, spy


def _both(monkeypatch, cfg: SimConfig, profile=None):
    """(the run computed ahead, the reference run, the spy of the first)."""
    monkeypatch.setattr(compiled, "NUMBA", True)
    return _ahead_and_reference(monkeypatch, cfg, "Handoffs", _Spy(), profile)


def _same(fast, ref) -> None:
    """The same summary and rows (a streamed run's rows are a lazy scan)."""
    assert json.dumps(fast.summary, sort_keys=True, default=str) == \
        json.dumps(ref.summary, sort_keys=True, default=str)
    rows = [r.requests for r in (fast, ref)]
    assert _frames_equal(*(r.collect() if hasattr(r, "collect") else r for r in rows))


def _cfg(*, n=300, qps=200.0, lengths=None, replicas=None, router=None, instances=None,
         drain_s=None, max_steps=None, policy="confidence", **workload) -> SimConfig:
    cfg = SimConfig(policy=policy)
    wl = dataclasses.replace(cfg.workload, num_requests=n, duration_s=None, qps=qps,
                             lengths=lengths, **workload)
    dep = cfg.deployment
    if replicas is not None:
        dep = dataclasses.replace(dep, replicas=replicas)
    if router is not None:
        dep = dataclasses.replace(dep, router=router)
    if instances is not None:
        dep = dataclasses.replace(dep, prefill_instances=instances)
    cfg = dataclasses.replace(cfg, workload=wl, deployment=dep)
    if drain_s is not None:
        cfg = dataclasses.replace(cfg, drain_timeout_s=drain_s)
    if max_steps is not None:
        cfg = dataclasses.replace(cfg, max_engine_steps=max_steps)
    return cfg


CASES = {
    "default deployment": {},
    "prefill queueing, prompts chunked over steps":
        {"instances": 2, "lengths": "lognormal:9000:40:0.9", "qps": 40.0},
    "one-token answers among the rest": {"lengths": "lognormal:400:2:1.2", "n": 200},
    "round robin over three replicas": {"replicas": 3, "router": "round-robin"},
    "the horizon cuts the prefill backlog":
        {"instances": 1, "lengths": "fixed:6000:20", "qps": 100.0, "drain_s": 0.5},
    "the step bound stops the run": {"max_steps": 300},
    "no speculation": {"policy": "none", "n": 200},
    "light load: replicas idle between requests": {"qps": 0.1, "n": 20},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_computed_ahead_gives_the_processes_bytes(monkeypatch, case):
    fast, ref, spy = _both(monkeypatch, _cfg(**CASES[case]))
    assert len(spy.made) == 1 and not spy.gave_up  # it did run ahead
    _same(fast, ref)
    assert fast.summary["prefill_steps"] > 0


@pytest.mark.parametrize("qps, n, lazily", [(200.0, 300, True), (0.1, 20, False)])
def test_hand_offs_are_events_only_while_a_replica_idles(monkeypatch, qps, n, lazily):
    """Under load every replica is stepping and each hands over, as its step ends, what
    was prefilled while it ran; at first (all idle), and at light load throughout, the
    hand-offs are SimPy events at their instants."""
    seen = {"lazily": 0, "as events": 0}

    class Counted(ahead.Handoffs):
        def deliver_before(self, now):
            before = self._i
            super().deliver_before(now)
            seen["lazily"] += self._i > before

        def _deliver(self):
            seen["as events"] += self._idle_wait is None and self.env.now == self.next_s
            super()._deliver()

    monkeypatch.setattr(compiled, "NUMBA", True)
    monkeypatch.setattr(api, "Handoffs", Counted)
    simulate(_cfg(qps=qps, n=n))
    assert bool(seen["lazily"]) == lazily and seen["as events"], seen


def test_the_horizon_case_does_cut_the_backlog(monkeypatch):
    """The case above is what it says: prompts were still queued when the run stopped
    (their arrival stamped, no first chunk), so the truncation at the stop is tested."""
    fast, _, spy = _both(monkeypatch, _cfg(**CASES["the horizon cuts the prefill backlog"]))
    h = spy.made[0]
    assert np.isnan(h.pool.start_s).any() and np.isfinite(h.started).all()
    assert fast.summary["prefill_steps"] < len(h.step_start)


def test_front_end_refusals_and_an_attention_window(monkeypatch):
    """A profile with a front end (requests through it one at a time), a sliding attention
    window and a model length that refuses the longest requests."""
    prof = load_profile("v4flash-h100")
    assert prof.attn_window_tokens is not None
    prof = dataclasses.replace(prof, frontend_s_per_request=4e-4)
    cfg = _cfg(n=300, lengths="lognormal:3000:80:1.0")
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, max_model_len=9000))
    fast, ref, spy = _both(monkeypatch, cfg, profile=prof)
    assert len(spy.made) == 1 and not spy.gave_up
    _same(fast, ref)
    assert fast.summary["rejected"] > 0


def test_a_replayed_workload_with_simultaneous_arrivals(monkeypatch, shared_dir):
    """Mooncake's timestamps are whole milliseconds, so requests arrive together (and
    its first ones all at 0): ties inside the front end, in SimPy's order."""
    mooncake = shared_dir / "data/workloads/mooncake_conversation_trace.jsonl"
    cfg = _cfg(n=400, arrival="replay", workload_path=str(mooncake), replay_qps=20.0)
    # its hash_ids turn the prefix cache on, which the pass ahead leaves to the processes
    cfg = dataclasses.replace(cfg, engine=EngineConfig(prefix_cache="off"))
    fast, ref, spy = _both(monkeypatch, cfg)
    assert len(spy.made) == 1
    arrived = spy.made[0].arrived
    assert len(arrived) - len(np.unique(arrived)) > 10  # requests that arrive together
    _same(fast, ref)


def test_a_prefix_cache_runs_the_prefill_instances_as_processes(monkeypatch, shared_dir):
    """The prefill instances hold the prefix cache, which the pass ahead does not model:
    a caching run never computes them ahead, and gives the processes' bytes."""
    mooncake = shared_dir / "data/workloads/mooncake_conversation_trace.jsonl"
    cfg = _cfg(n=300, arrival="replay", workload_path=str(mooncake), replay_qps=20.0)
    fast, ref, spy = _both(monkeypatch, cfg)
    assert spy.made == []
    assert fast.summary["prefix_cache_hit_rate_tokens"] > 0.05
    _same(fast, ref)


def test_an_event_at_the_instant_the_run_stops_falls_back(monkeypatch):
    """The horizon put at exactly a prefill step's end: which comes first is SimPy's
    event order, which the pass ahead does not know, so the run is simulated again as
    processes and gives their bytes."""
    base = CASES["the horizon cuts the prefill backlog"]
    _, _, spy = _both(monkeypatch, _cfg(**base))
    h = spy.made[0]
    ends = h.step_start + h.step_dt
    end = float(ends[ends > h.last_arrival_s][0])
    drain = ahead._delay_to(h.last_arrival_s, end)
    cfg = _cfg(**{**base, "drain_s": drain})
    fast, ref, spy = _both(monkeypatch, cfg)
    assert spy.gave_up and "run's end" in spy.gave_up[0]
    _same(fast, ref)


def test_a_chunked_prefill_run_has_nothing_to_compute_ahead(monkeypatch):
    cfg = _cfg(n=150)
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, prefill="chunked"),
                              deployment=DeploymentConfig(replicas=1))
    _, _, spy = _both(monkeypatch, cfg)
    assert not spy.made


def test_a_closed_loop_keeps_the_processes(monkeypatch):
    cfg = SimConfig(policy="none", engine=EngineConfig(),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=8,
                                            num_requests=40, lengths="fixed:300:20"))
    _, _, spy = _both(monkeypatch, cfg)
    assert not spy.made


@given(st.floats(0.0, 1e7, allow_nan=False), st.floats(0.0, 1e7, allow_nan=False))
def test_a_timeout_lands_at_exactly_the_instant(a, b):
    now, at = min(a, b), max(a, b)
    assert now + ahead._delay_to(now, at) == at


def test_the_pass_ahead_matches_a_pool_by_hand():
    """Two instances, a 10 ms step of up to 16 tokens, prompts of 8 tokens at 0, 0, 0 and
    5 ms. At 0 the first instance wakes to request 0 and fills its step with requests 0
    and 1, the second wakes to request 2 (SimPy's order for events at one instant);
    request 3 waits for the first step's end."""
    prof = EngineProfile(name="t", kind="measured", gpus_per_replica=1,
                         tokens=np.array([1, 64]), step_s=np.array([0.010, 0.010]))
    table = np.asarray(prof.target_time_s(np.arange(17)), dtype=np.float64)
    arrival = np.array([0.0, 0.0, 0.0, 0.005])
    got = ahead.front_end(arrival, np.zeros(4, np.int8), np.array([8, 8, 8, 8]), 0.0, 2, 16,
                          table, 0.0, -1.0, 0.0, 16)
    arrived, submitted, started, hand_rid, hand_s, step_start, step_dt = got
    assert arrived.tolist() == [0.0, 0.0, 0.0, 0.005] and submitted.tolist() == arrived.tolist()
    assert started.tolist() == [0.0, 0.0, 0.0, 0.010]
    assert hand_rid.tolist() == [0, 1, 2, 3]
    assert hand_s.tolist() == [0.010, 0.010, 0.010, 0.020]
    assert step_start.tolist() == [0.0, 0.0, 0.010] and step_dt.tolist() == [0.010] * 3


# -- streamed runs: the front end run a chunk of arrivals at a time --------------------


class _StreamSpy:
    """Stands for ``api.StreamedHandoffs``: the runs computed ahead, and where one gave up
    (``NotAhead``), and which of the window's chunks it took in."""

    def __init__(self) -> None:
        self.made: list[ahead.StreamedHandoffs] = []
        self.gave_up: list[str] = []
        spy = self

        class Spied(ahead.StreamedHandoffs):
            def _admits(self):
                try:
                    yield from super()._admits()
                except ahead.NotAhead as e:
                    spy.gave_up.append(str(e))
                    raise

            def finish(self):
                try:
                    super().finish()
                except ahead.NotAhead as e:
                    spy.gave_up.append(str(e))
                    raise

            def _feed(self):
                try:
                    super()._feed()
                except ahead.NotAhead as e:
                    spy.gave_up.append(str(e))
                    raise

        self.cls = Spied

    def __call__(self, *args, **kwargs):
        obj = self.cls(*args, **kwargs)
        self.made.append(obj)
        return obj


def _stream_small(monkeypatch, chunk: int, chunks: int) -> None:
    monkeypatch.setattr(compiled, "NUMBA", True)
    monkeypatch.setattr(api, "STREAM_ABOVE", 10)
    monkeypatch.setattr(api, "STREAM_CHUNK", chunk)
    monkeypatch.setattr(api, "STREAM_CHUNKS", chunks)


def _streamed_both(monkeypatch, cfg: SimConfig, chunk: int, chunks: int, profile=None):
    """(the streamed run computed ahead, the streamed run with the SimPy processes, the
    spy of the first)."""
    _stream_small(monkeypatch, chunk, chunks)
    return _ahead_and_reference(monkeypatch, cfg, "StreamedHandoffs", _StreamSpy(), profile)


STREAMED_CASES = {
    # ~10 s of arrivals in the window: its oldest chunks are let go as the run goes on
    "default deployment, the slots reused": ({"n": 6000}, 512, 8),
    "prefill queueing, prompts chunked over steps":
        ({"instances": 2, "lengths": "lognormal:9000:40:0.9", "qps": 8.0, "n": 300}, 32, 8),
    "the horizon cuts the prefill backlog":
        ({"instances": 1, "lengths": "fixed:6000:20", "qps": 100.0, "drain_s": 0.5,
          "n": 300}, 64, 8),
    "the step bound stops the run": ({"max_steps": 2000, "n": 6000}, 512, 8),
    "light load: replicas idle between requests": ({"qps": 0.5, "n": 120}, 16, 4),
}


@pytest.mark.parametrize("case", sorted(STREAMED_CASES))
def test_a_streamed_run_computed_ahead_gives_the_processes_bytes(monkeypatch, case):
    kw, chunk, chunks = STREAMED_CASES[case]
    fast, ref, spy = _streamed_both(monkeypatch, _cfg(**kw), chunk, chunks)
    assert len(spy.made) == 1 and not spy.gave_up  # it did run ahead
    _same(fast, ref)
    assert fast.summary["prefill_steps"] > 0


def test_a_streamed_run_takes_chunks_into_the_window_as_it_goes(monkeypatch):
    kw, chunk, chunks = STREAMED_CASES["default deployment, the slots reused"]
    _, _, spy = _streamed_both(monkeypatch, _cfg(**kw), chunk, chunks)
    window = spy.made[0].window
    assert window.flushed * chunk >= kw["n"] > chunk * chunks


def _replayed(path, n: int, qps: float, seed: int = 0, huge=slice(0, 0)) -> str:
    """A Mooncake JSONL of ``n`` Poisson arrivals (the requests ``huge`` with prompts no
    replica takes): a stream read whole, the same requests streamed or in memory."""
    rng = np.random.default_rng(seed)
    t_ms = np.cumsum(rng.exponential(1e3 / qps, n))
    prompt = rng.integers(16, 2048, n)
    prompt[huge] = 10_000_000
    lines = [json.dumps({"timestamp": float(t), "input_length": int(a), "output_length": int(b)})
             for t, a, b in zip(t_ms, prompt, rng.integers(1, 400, n), strict=True)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _replay_cfg(path) -> SimConfig:
    return _cfg(n=None, arrival="replay", workload_path=path)


def test_a_streamed_run_computed_ahead_gives_the_in_memory_bytes(monkeypatch, tmp_path):
    """The same requests (a workload file read whole): streamed with the pass ahead, in
    memory with it, and in memory with the SimPy processes give the same bytes, with a
    front end and an attention window."""
    prof = dataclasses.replace(load_profile("v4flash-h100"), frontend_s_per_request=2e-4)
    cfg = _replay_cfg(_replayed(tmp_path / "w.jsonl", 1500, 100.0))
    fast, ref, _ = _both(monkeypatch, cfg, profile=prof)
    _same(fast, ref)
    _stream_small(monkeypatch, 128, 8)
    spy = _StreamSpy()
    monkeypatch.setattr(api, "StreamedHandoffs", spy)
    streamed = simulate(cfg, profile=prof)
    assert len(spy.made) == 1 and not spy.gave_up
    assert spy.made[0].window.flushed > 0
    assert json.dumps(streamed.summary, sort_keys=True, default=str) == \
        json.dumps(fast.summary, sort_keys=True, default=str)
    assert _frames_equal(streamed.requests.collect(), fast.requests)


def test_a_streamed_run_falls_back_where_the_window_fills(monkeypatch, tmp_path):
    """A window too small for the requests in the system stops the run; which event at
    that instant comes first is left to the processes, as are their bytes."""
    cfg = _cfg(n=3000)
    fast, ref, spy = _streamed_both(monkeypatch, cfg, 256, 4)
    assert spy.gave_up and "window is full" in spy.gave_up[0]
    assert fast.summary["bounded_by"] == "window"
    _same(fast, ref)


def test_a_streamed_run_falls_back_past_a_stretch_of_refusals(monkeypatch, tmp_path):
    """Refused requests hand nothing off: over a stretch of them the front end would
    have to read further ahead than its ring holds, and the processes run instead."""
    path = _replayed(tmp_path / "refused.jsonl", 400, 10.0, huge=slice(100, 250))
    fast, ref, spy = _streamed_both(monkeypatch, _replay_cfg(path), 16, 4)
    assert spy.gave_up and "ahead of the window" in spy.gave_up[0]
    _same(fast, ref)
    assert fast.summary["rejected"] == 150
