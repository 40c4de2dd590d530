"""Frozen configuration dataclasses, one per component, composed into :class:`SimConfig`.

Presets are looked up by name (:func:`preset`); files are TOML with one table per
component (``[engine]``, ``[deployment]``, ``[workload]``, ``[run]``), see
``docs/configuration.md``. Every field carries its unit in its name.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from dspark_sim.errors import InputError
from dspark_sim.io import read_toml

ARRIVALS = ("poisson", "gamma", "closed", "replay")
ROUTERS = ("round-robin", "least-outstanding")
KV_MODES = ("preempt", "reserve")


@dataclass(frozen=True)
class EngineConfig:
    """One replica's scheduler limits (vLLM names where they exist)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # KV-cache capacity of one replica in tokens (prompt + generated + verify slots).
    kv_capacity_tokens: int = 2_000_000
    # "preempt": admit optimistically, recompute-preempt the newest request when KV
    # runs out (vLLM); "reserve": admit only if prompt + full output fits (never preempts).
    kv_mode: str = "preempt"


@dataclass(frozen=True)
class DeploymentConfig:
    replicas: int = 2
    router: str = "least-outstanding"
    profile: str = "v4flash-h200"  # built-in name or TOML path


@dataclass(frozen=True)
class WorkloadConfig:
    arrival: str = "poisson"
    qps: float = 200.0
    burstiness: float = 1.0  # gamma shape; 1 = Poisson (vLLM semantics)
    max_concurrency: int = 64  # closed loop only
    num_requests: int | None = 2000  # None: bounded by duration_s
    duration_s: float | None = None  # arrival window; None: bounded by num_requests
    workload_path: str | None = None  # Azure CSV or Mooncake JSONL (arrival = replay)
    replay_qps: float | None = None  # rescale a replayed trace's timestamps to this rate
    # Named distribution, "fixed:IN:OUT" or "lognormal:IN:OUT[:SIGMA]"; None: the
    # workload file's lengths when replaying, else "azure-conv".
    lengths: str | None = None
    domain: str | None = None  # restrict the acceptance trace to one domain


@dataclass(frozen=True)
class SimConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    deployment: DeploymentConfig = field(default_factory=DeploymentConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    policy: str = "confidence"
    trace: str | None = None  # schema-v1 trace for the block drafter; None: built-in
    mtp_trace: str | None = None  # trace for the MTP-1 head; None: built-in
    calibration: str | None = None  # confidence calibration map (TOML); None: identity
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    drain_timeout_s: float = 120.0  # simulate at most this long after the last arrival

    def validate(self) -> SimConfig:
        e, d, w = self.engine, self.deployment, self.workload
        _pos_int("max_num_seqs", e.max_num_seqs)
        _pos_int("max_num_batched_tokens", e.max_num_batched_tokens)
        _pos_int("kv_capacity_tokens", e.kv_capacity_tokens)
        if e.max_num_seqs > e.max_num_batched_tokens:
            raise InputError("--max-num-seqs", "must not exceed max_num_batched_tokens")
        _choice("kv_mode", e.kv_mode, KV_MODES)
        _pos_int("replicas", d.replicas)
        _choice("router", d.router, ROUTERS)
        _choice("arrival", w.arrival, ARRIVALS)
        if w.arrival in ("poisson", "gamma"):
            _pos_float("qps", w.qps)
            _pos_float("burstiness", w.burstiness)
        if w.arrival == "closed":
            _pos_int("max_concurrency", w.max_concurrency)
        if w.arrival == "replay" and not w.workload_path:
            raise InputError("--workload", "replay arrivals need a workload file")
        if w.replay_qps is not None:
            _pos_float("replay_qps", w.replay_qps)
        if w.num_requests is None and w.duration_s is None:
            raise InputError("--num-requests", "give --num-requests or --duration-s")
        if w.num_requests is not None:
            _pos_int("num_requests", w.num_requests)
        if w.duration_s is not None:
            _pos_float("duration_s", w.duration_s)
        if w.arrival == "closed" and w.num_requests is None:
            raise InputError("--num-requests", "closed-loop runs need --num-requests")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            v = getattr(self, name)
            if v is not None:
                _pos_float("--slo", v)
        _pos_float("drain_timeout_s", self.drain_timeout_s)
        return self

    def to_dict(self) -> dict:
        return asdict(self)


def _pos_int(name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise InputError(f"--{name.replace('_', '-')}", f"must be a positive integer, got {v!r}")


def _pos_float(name: str, v) -> None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        f = float("nan")
    if not math.isfinite(f) or f <= 0:
        raise InputError(f"--{name.replace('_', '-').lstrip('-')}", f"must be a positive number, got {v!r}")


def _choice(name: str, v: str, options: tuple[str, ...]) -> None:
    if v not in options:
        raise InputError(f"--{name.replace('_', '-')}", f"must be one of {', '.join(options)}, got {v!r}")


PRESETS: dict[str, SimConfig] = {
    # The embedded default: V4-Flash-like MoE, 2 replicas x 32 H200, 200 req/s chat.
    "default": SimConfig(),
    # One replica, closed loop: the shape of an InferenceX point.
    "single-replica": SimConfig(
        deployment=DeploymentConfig(replicas=1),
        workload=WorkloadConfig(arrival="closed", max_concurrency=64, num_requests=1000),
    ),
    # Small and fast, for tests and notebooks.
    "tiny": SimConfig(
        deployment=DeploymentConfig(replicas=1),
        workload=WorkloadConfig(qps=20.0, num_requests=200),
    ),
}


def preset(name: str) -> SimConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise InputError("--preset", f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None


def _merge(cls, base, table: dict, where: str):
    names = {f.name for f in fields(cls)}
    unknown = set(table) - names
    if unknown:
        raise InputError(where, f"unknown key(s) {', '.join(sorted(unknown))}")
    return replace(base, **table)


def load_config(path: str | Path, base: SimConfig | None = None) -> SimConfig:
    """Read a TOML config; missing keys keep ``base`` (default: the default preset)."""
    source = str(path)
    data = read_toml(path, "config file")
    cfg = base or preset(data.pop("preset", "default"))
    cfg = replace(
        cfg,
        engine=_merge(EngineConfig, cfg.engine, data.pop("engine", {}), f"{source} [engine]"),
        deployment=_merge(DeploymentConfig, cfg.deployment, data.pop("deployment", {}),
                          f"{source} [deployment]"),
        workload=_merge(WorkloadConfig, cfg.workload, data.pop("workload", {}),
                        f"{source} [workload]"),
    )
    run = data.pop("run", {})
    if data:
        raise InputError(source, f"unknown table(s) {', '.join(sorted(data))}")
    try:
        cfg = _merge(SimConfig, cfg, run, f"{source} [run]")
    except TypeError as exc:
        raise InputError(source, str(exc)) from exc
    return cfg
