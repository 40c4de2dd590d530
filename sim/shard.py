"""Replica groups simulated apart and merged: ``run --executor ray``.

Decode replicas do not talk to each other. What couples them is the router, and the
arrival source when it waits on completions. Where neither depends on replica state
(an open loop routed round-robin: request ``i``, in the order it reaches the decode
replicas, goes to replica ``i mod R``), each replica's steps depend only on the requests
sent to it. So a group of replicas can be simulated on its own, and the groups merged,
giving the serial run's bytes:

* every group runs the whole arrival stream and the prefill instances (they never wait
  on a decode replica), routes every request, and steps only its own replicas;
* each request's row comes from the group that served it (the arrival, the prefill and
  the refusals are the same in every group);
* the per-step series is the groups' steps merged by completion time, which is the
  serial run's order, and the run's totals are summed from the groups (the prefix
  cache's counts too: each replica's cache from the group that stepped it). The two float
  totals (busy time and the inter-token gap sum) are added again step by step in that
  order, as the serial run adds them.

The serial run is taken instead, and :func:`simulate_replicas` says why, when the router
is least-outstanding (it reads every replica's queue), the loop is closed (a client's
next request waits on the last one's completion) or runs sessions (a turn waits on the
turn before), a run streams its rows (above
``STREAM_ABOVE`` requests), there is one replica or one worker, two replicas' steps end
at the very same instant (their serial order is SimPy's event order, which a merge by time
cannot recover), or the merged run reaches the step bound (the serial run stops there).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from dspark_sim.sim import api
from dspark_sim.sim.config import SimConfig
from dspark_sim.sim.engine import STEP_FIELDS, RequestLog, StepStats
from dspark_sim.sim.prefill import PrefillPool
from dspark_sim.sim.prefix_cache import CacheCounts

EXECUTORS = ("serial", "ray")
# StepStats fields that are counts over steps: a merged run's are the groups' sums
_COUNTS = ("steps", "request_steps", "verify_tokens", "batch_tokens", "budget_limited_steps",
           "kv_blocked_steps", "changed_tokens", "skipped_request_steps", "unverified_tokens",
           "unproposed_request_steps")
_HISTOGRAMS = ("accept_hist", "ell_hist", "itl_hist")


@dataclass(frozen=True)
class PrefillTotals:
    """What the summary reads of the prefill instances (the same in every group)."""

    instances: int
    busy_s: float
    steps: int
    submitted_s: np.ndarray
    start_s: np.ndarray
    cache: CacheCounts | None = None  # the instances' prefix cache (the same in every group)

    def summary(self, duration_s: float, gpus_per_instance: int) -> dict:
        return PrefillPool.summary(self, duration_s, gpus_per_instance)


@dataclass(frozen=True)
class GroupRun:
    """One replica group's run, as a worker hands it back (plain arrays: it pickles)."""

    replicas: tuple[int, ...]
    log: RequestLog
    stats: StepStats
    steps: dict
    prefill: PrefillTotals | None
    bounded_by: object
    horizon: float
    caches: dict[int, CacheCounts]  # the prefix cache of each replica the group stepped


def serial_reason(cfg: SimConfig, workers: int) -> str | None:
    """Why this run cannot be split into replica groups (None: it can)."""
    d, w = cfg.deployment, cfg.workload
    if d.replicas < 2:
        return "one replica"
    if workers < 2:
        return "one worker"
    if d.router != "round-robin":
        return f"router {d.router} reads every replica's queue"
    if w.arrival == "closed":
        return "a closed loop waits on completions"
    if w.session_turns:  # a group that never steps a turn's replica never sends the next
        return "a session's next turn waits on its last one's completion"
    return None


def groups_of(replicas: int, workers: int) -> list[tuple[int, ...]]:
    """Replica ``r`` in group ``r mod k``, for ``k = min(workers, replicas)`` groups."""
    k = min(workers, replicas)
    return [tuple(range(g, replicas, k)) for g in range(k)]


def run_group(inputs: api.RunInputs | SimConfig, replicas: tuple[int, ...]) -> GroupRun:
    """Simulate ``inputs`` stepping only ``replicas`` (a worker's task)."""
    run = _in_memory(api._inputs(inputs), replicas)
    pool = run.prefill
    prefill = None if pool is None else PrefillTotals(
        pool.instances, pool.busy_s, pool.steps, pool.submitted_s, pool.start_s,
        None if pool.cache is None else CacheCounts.of(pool.cache))
    caches = {r: CacheCounts.of(run.ctx.replicas[r].cache) for r in replicas
              if run.ctx.replicas[r].cache is not None}
    return GroupRun(replicas, run.log, run.ctx.stats, run.ctx.steps.columns(), prefill,
                    run.bounded_by, run.horizon, caches)


def _in_memory(inputs: api.RunInputs, replicas: tuple[int, ...] | None):
    cfg, policy, profile, trace, calibration, policy_profile = (
        inputs.cfg, inputs.policy, inputs.profile, inputs.trace, inputs.calibration,
        inputs.policy_profile)
    if api._drawn_in_chunks(cfg, trace, None, profile) is not None:
        return None  # a run that streams: its arrivals are never drawn whole
    rng = np.random.default_rng(cfg.seed)
    stream, trace_row = api._request_log(cfg, rng, trace, None, profile)
    if stream.size > api.STREAM_ABOVE:
        return None
    return api.run_in_memory(cfg, policy, profile, trace, calibration, policy_profile,
                             stream, trace_row, replicas=replicas)


class SerialFallback(Exception):
    """The merge cannot reproduce the serial run; its message says why."""


def merge(groups: list[GroupRun], replicas: int, max_engine_steps: int
          ) -> tuple[RequestLog, StepStats, dict]:
    """The serial run's log, totals and per-step series from its replica groups'."""
    first = groups[0]
    owner = np.zeros(replicas, np.int64)
    for g, run in enumerate(groups):
        owner[list(run.replicas)] = g
    served = first.log.replica
    by = np.where(served >= 0, owner[np.maximum(served, 0)], 0)
    merged = {}
    for f in fields(RequestLog):
        col = getattr(first.log, f.name)
        if col is None:  # a column the run does not keep (the prefix cache's, without one)
            merged[f.name] = None
            continue
        col = col.copy()
        for g, run in enumerate(groups[1:], 1):
            mine = by == g
            col[mine] = getattr(run.log, f.name)[mine]
        merged[f.name] = col
    log = RequestLog(**merged)

    cols = {k: np.concatenate([run.steps[k] for run in groups]) for k in STEP_FIELDS}
    order = np.argsort(cols["end_s"], kind="stable")
    steps = {k: v[order] for k, v in cols.items()}
    end, rep = steps["end_s"], steps["replica"]
    if np.any((end[1:] == end[:-1]) & (rep[1:] != rep[:-1])):
        raise SerialFallback("two replicas' steps end at the same instant")
    if end.size >= max_engine_steps:
        raise SerialFallback("the run reaches its step bound")

    stats = StepStats(first.stats.gamma, hist_size=first.stats.hist_size)
    for name in _COUNTS:
        setattr(stats, name, sum(getattr(run.stats, name) for run in groups))
    for name in _HISTOGRAMS:  # in place: they are views of one array (StepStats.hists)
        getattr(stats, name)[:] = sum(getattr(run.stats, name) for run in groups)
    # np.cumsum adds one after another, as the serial run's `+=` does (a step without
    # decoding rows adds 0.0 to the gap sum, which leaves it as it was)
    dt = steps["dt_s"]
    if dt.size:
        stats.busy_s = float(np.cumsum(dt)[-1])
        stats.itl_sum_s = float(np.cumsum(dt * steps["decode_batch"])[-1])
    return log, stats, steps


def simulate_replicas(cfg: api.RunInputs | SimConfig, *, executor: str = "ray",
                      workers: int | None = None, **given) -> tuple[api.SimResult, str | None]:
    """:func:`api.simulate` of :func:`api.prepare`'s inputs (or of a config, prepared
    here with ``given``), with the replica groups on ``executor`` (``"ray"``: Ray
    tasks, on the cluster ``RAY_ADDRESS`` names or a local one; ``"serial"``: one after
    another in this process) where the run allows it. Returns (the result, why it ran
    serially or None). The result's bytes are the serial run's either way."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}")
    inputs = api._inputs(cfg, **given)
    cfg = inputs.cfg  # its replicas resolved: the profile's default_replicas sets the groups
    if workers is None:
        workers = cfg.deployment.replicas
    why = serial_reason(cfg, workers)
    if why is not None:
        return api.simulate(inputs), why
    whole = _in_memory(inputs, replicas=())  # the frame the merge fills in
    if whole is None:
        return api.simulate(inputs), "the run streams its rows"
    parts = groups_of(cfg.deployment.replicas, workers)
    if executor == "ray":
        from dspark_sim.sim.ray_start import start_ray

        ray = start_ray(workers)
        task = ray.remote(run_group)
        groups = ray.get([task.remote(inputs, part) for part in parts])
    else:
        groups = [run_group(inputs, part) for part in parts]
    try:
        log, stats, steps = merge(groups, cfg.deployment.replicas, whole.cfg.max_engine_steps)
    except SerialFallback as exc:
        return api.simulate(inputs), str(exc)
    whole.log, whole.ctx.stats = log, stats
    whole.prefill = groups[0].prefill
    for run in groups:  # the summary's prefix-cache counts: each replica's from its group
        for r, counts in run.caches.items():
            whole.ctx.replicas[r].cache = counts
    whole.bounded_by, whole.horizon = groups[0].bounded_by, groups[0].horizon
    return api.finish_run(whole, steps), None
