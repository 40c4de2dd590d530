"""Frozen configuration dataclasses, one per component, composed into :class:`SimConfig`,
and the one mapping from settings (command-line options, TOML keys) onto them.

Presets are looked up by name (:func:`preset`); files are TOML with one table per
component (``[engine]``, ``[deployment]``, ``[workload]``, ``[run]``). Every field
carries its unit in its name, and is the one place its setting is declared
(:func:`setting`: default, help, option, unit; :data:`SETTINGS` reads them back for the
command line, the TOML reader, the errors and the docs). :func:`resolve_config` layers a preset, a TOML file and
explicitly given options (in that order: explicit option > config file > preset
default); every value is type-checked against the dataclass field's annotation, and
an unknown key is an error. The rules are documented in ``docs/cli.md``.
"""

from __future__ import annotations

import math
import numbers
import types
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from dspark_sim.calibration.profile import LIMITS, EngineLimits
from dspark_sim.errors import MAX_REPLICAS, InputError, check_positive_int
from dspark_sim.io import file_or_none, read_toml
from dspark_sim.policies.registry import DEFAULT_POLICY, policy_help

ARRIVALS = ("poisson", "gamma", "closed", "replay")
ROUTERS = ("round-robin", "least-outstanding", "prefix-affinity")
KV_MODES = ("preempt", "reserve")
PREFIX_CACHE_MODES = ("on", "off")

# -- limits ------------------------------------------------------------------------------
# Beyond these a run allocates gigabytes at once or the simulated clock loses its
# resolution; each is refused with an error naming the option (docs/cli.md lists them).
# Above sim.api.STREAM_ABOVE (1e6) a run streams its per-request rows to disk, so memory
# does not cap the count; 5e7 is ~3 days at 200 req/s, over an hour of wall time.
MAX_NUM_REQUESTS = 50_000_000
# MAX_REPLICAS: dspark_sim.errors (profiles obey it too); the engine limits' bounds:
# calibration/profile.py's EngineLimits, beside each limit's default
MAX_TOKENS_PER_REQUEST = 1 << 24  # prompt or output tokens in a --lengths spec
# lognormal lengths: sigma 4 already spans a factor ~e^16 between the 0.01 % tails
MAX_LOGNORMAL_SIGMA = 4.0
MAX_PREFIX_BLOCK_TOKENS = 1 << 16  # a prefix-cache block; vLLM's are 16 to a few hundred
MAX_SESSION_TURNS = 10_000
MAX_SESSION_REQUESTS = 1_000_000  # sessions are drawn whole: the in-memory runs' bound
# Simulated seconds: the float64 clock keeps ~2 ns resolution below 1e7 s (116 days);
# longer arrival windows make step durations vanish into rounding (0.0 ms latencies).
MAX_SIM_TIME_S = 1e7
# Gamma shape: below 1e-3 most gaps underflow to 0 and one is astronomically long; the
# scale 1/(qps * b) overflows for denormal b.
BURSTINESS_RANGE = (1e-3, 1e3)
MAX_SEED = 2**63 - 1
MAX_ENGINE_STEPS = 100_000_000  # ~30 min of wall time


# -- the settings schema -----------------------------------------------------------------
# Every setting is one dataclass field below, and everything said about it lives on that
# field (``setting(...)``): its default, its help, the command-line option that sets it,
# its unit and the arrival kinds that read it. The CLI's ``run`` options and their
# ``--help``, the TOML reader, the errors' blame and docs/cli.md's tables are derived from
# it (:data:`SETTINGS`); adding a setting is adding a field (docs/architecture.md).


@dataclass(frozen=True)
class SpecOption:
    """A command-line option whose one value is a spec parsed into several settings
    (``--slo ttft:MS,tpot:MS``); each of those fields names it as its ``option``.
    ``parse`` returns the fields' values in their order, ``None`` for one not given."""

    flag: str
    help: str
    parse: Callable[[str], tuple]


def setting(default: Any = None, *, help: str | Callable[[], str],
            option: str | SpecOption | None = "", unit: str | None = None,
            arrivals: tuple[str, ...] | None = None, reads: str | None = None,
            doc: str | None = None, after: str | None = None,
            swept: str | None = None) -> Any:
    """A config field with its schema entry (:class:`Setting`): ``help`` (text, or a
    function of none returning it when the text is built from a registry), ``option``
    (``""``: ``--FIELD-NAME``; ``None``: a config file's key only; a
    :class:`SpecOption` for a field set through a spec), ``unit`` (for the docs),
    ``arrivals`` (the arrival kinds that read it; given under another it is refused;
    ``None``: every kind) and ``reads`` (``"file"``: the value is the path of a file the
    run reads, the option a path option; ``"file or name"``: such a path or a built-in's
    name, a file winning as in every loader; outputs must not overwrite these) and
    ``doc`` (docs/cli.md's text, where a help built from a registry would make the table
    change with it: it links to the registry's own page instead) and ``after`` (the
    setting of its table it is listed after, in the options, the tables and the docs,
    where it belongs among fields a base dataclass declares before it) and ``swept`` (the
    sweep option whose values are a sweep's grid axis over it, one point each: a sweep
    takes every other setting as ``run`` does, one value for all its points)."""
    return field(default=default, metadata={"setting": {
        "help": help, "option": option, "unit": unit, "arrivals": arrivals, "reads": reads,
        "doc": doc, "after": after, "swept": swept}})


def parse_slo(spec: str | None) -> tuple[float | None, float | None]:
    """``ttft:MS,tpot:MS`` (either part optional) -> (ttft_ms, tpot_ms); ``None``: not
    given. An empty one is refused like any other malformed spec, not taken as "not
    given": the option was typed, so a value was meant."""
    if spec is None:
        return None, None
    out: dict[str, float] = {}
    for part in spec.split(","):
        key, _, val = part.partition(":")
        key = key.strip().lower()
        if key not in ("ttft", "tpot"):
            raise InputError("--slo", f"expected ttft:MS,tpot:MS, got {spec!r}")
        try:
            v = float(val)
        except ValueError:
            raise InputError("--slo", f"{key} needs a number of milliseconds, got {val!r}") from None
        if not (math.isfinite(v) and v > 0):
            raise InputError("--slo", f"{key} must be a positive number of ms, got {val!r}")
        if key in out:  # tpot:5,tpot:6 kept the last, silently
            raise InputError("--slo", f"{key} given twice in {spec!r}")
        out[key] = v
    return out.get("ttft"), out.get("tpot")


SLO = SpecOption("--slo", "Goodput SLO, e.g. ttft:2000,tpot:20", parse_slo)
LENGTHS_HELP = ("azure-conv | azure-code | mooncake | long-context[:IN:OUT[:SIGMA]] | fixed:IN:OUT "
                "| lognormal:IN:OUT[:SIGMA] | trace | trace:sample (each request one trace "
                "row's lengths)")


@dataclass(frozen=True)
class EngineConfig(EngineLimits):
    """One replica's scheduler settings (vLLM names where they exist). The limits are
    :class:`~dspark_sim.calibration.profile.EngineLimits`' fields, inherited, each an
    option with the help its ``Limit`` gives (``resolve_limits`` reads them): ``None``
    takes the engine profile's ``[engine]`` value (what the deployment's HBM and graphs
    imply), else the limit's default (``DEFAULT_LIMITS``)."""

    # "preempt": admit optimistically, recompute-preempt the newest request when KV
    # runs out (vLLM); "reserve": admit only if prompt + full output fits (never preempts).
    kv_mode: str = setting("preempt", help="preempt | reserve", after="kv_capacity_tokens")
    # vLLM's automatic prefix caching (sim/prefix_cache.py): a request's leading cached
    # blocks skip prefill. None: on for a workload that carries reuse (a Mooncake file's
    # hash_ids, multi-turn sessions), as vLLM turns it on by default; a workload without
    # prefix information has nothing to hash, so it runs without (on is refused there).
    prefix_cache: str | None = setting(help="on | off: automatic prefix caching (default: "
                                       "on for a workload that carries reuse: Mooncake "
                                       "hash_ids, sessions)", swept="--prefix-cache")
    # None: the workload's own block (a Mooncake file's hash_ids: 512, or the file's
    # hash_block_tokens), else vLLM's 16
    prefix_block_tokens: int | None = setting(help="Prefix-cache block (default: the "
                                              "block of a file's hash_ids, 512 unless its "
                                              "hash_block_tokens says otherwise, else 16; "
                                              "it must divide that block).", unit="tokens")

    def validate(self) -> EngineConfig:
        _validate_engine(self)
        return self


@dataclass(frozen=True)
class DeploymentConfig:
    profile: str = setting("v4flash-h200", help="Engine profile: TOML path or built-in name.",
                           reads="file or name", swept="--profiles")
    # Replicas (batches) behind the router; None: the profile's default_replicas, else
    # DEFAULT_REPLICAS (with_replicas), so a profile fitted to one server runs as one.
    replicas: int | None = setting(help="Replicas behind the router (default: the "
                                   "profile's default_replicas, else 4).")
    # Prefill instances behind one FIFO queue when prefill is disaggregated (sim/prefill.py),
    # each the profile's engine on gpus_per_replica GPUs; chunked prefill has none (a count
    # given for it is refused). Fourteen take the default 200 req/s of chat (~233k prompt
    # tokens/s) at ~80 % of their capacity (busy time), adding ~17 ms to the median TTFT.
    prefill_instances: int = setting(14, help="Prefill instances behind one FIFO queue, "
                                     "disaggregated prefill only (each the profile's engine "
                                     "and GPUs) [14].")
    # prefix-affinity: the replica caching the longest prefix of the prompt, the least
    # outstanding among equals (least-outstanding where the replicas cache nothing)
    router: str = setting("least-outstanding", help="round-robin | least-outstanding | "
                          "prefix-affinity")


# The default profile's replica is one data-parallel attention rank (one GPU) of an
# EP32 group; its peers are assumed to carry the same load (the EP group's global batch
# is the rank's times 32). Four ranks take 200 req/s of chat at ~70 % of their capacity.
DEFAULT_REPLICAS = 4


def with_replicas(cfg: SimConfig, profile) -> SimConfig:
    """``cfg`` with its replica count filled in where it names none: the profile's
    ``default_replicas`` (an ``EngineProfile``; a profile fitted to one server says 1),
    else :data:`DEFAULT_REPLICAS`. A count given anywhere (option, config file, preset,
    Python) is kept."""
    if cfg.deployment.replicas is not None:
        return cfg
    n = getattr(profile, "default_replicas", None) or DEFAULT_REPLICAS
    return replace(cfg, deployment=replace(cfg.deployment, replicas=n))


OPEN_LOOP = ("poisson", "gamma")


@dataclass(frozen=True)
class WorkloadConfig:
    # no option: the options that need an arrival kind imply it (resolve_config)
    arrival: str = setting("poisson", option=None, help="poisson | gamma | closed | replay; "
                           "the settings that need one imply it (a concurrency: closed, a "
                           "workload file: replay, a burstiness: gamma)")
    qps: float = setting(200.0, help="Open-loop request rate (req/s); with --workload: "
                         "rescale its timestamps.", unit="req/s", arrivals=OPEN_LOOP,
                         swept="--qps")
    # gamma shape; 1 = Poisson (vLLM semantics)
    burstiness: float = setting(1.0, help="Gamma arrivals with this shape (1 = Poisson, "
                                "vLLM semantics).", arrivals=("gamma",))
    max_concurrency: int = setting(64, help="Closed loop: this many clients, each sends its "
                                   "next request on completion (with --workload: the file's "
                                   "requests, in order).", unit="clients",
                                   arrivals=("closed",), swept="--concurrency")
    # None: bounded by duration_s (closed: the file's). 10,000 at 200 req/s: a 50 s window,
    # long enough for a steady state ten request lifetimes long.
    num_requests: int | None = setting(10_000, help="Requests to simulate.", unit="requests")
    # arrival window; None: bounded by num_requests
    duration_s: float | None = setting(help="Arrival window in seconds.", unit="s",
                                       arrivals=(*OPEN_LOOP, "replay"))
    # Azure CSV or Mooncake JSONL: replayed (arrival = replay), or its lengths sent in
    # order by the clients of a closed loop (arrival = closed).
    workload_path: str | None = setting(help="Replay an Azure CSV or Mooncake JSONL workload "
                                        "file.", option="--workload", reads="file",
                                        arrivals=("closed", "replay"))
    # rescale a replayed trace's timestamps to this rate
    replay_qps: float | None = setting(help="Time-scale a replayed workload to this rate.",
                                       unit="req/s", arrivals=("replay",))
    # Named distribution, "fixed:IN:OUT" or "lognormal:IN:OUT[:SIGMA]"; None: the
    # workload file's lengths when there is one, else "azure-conv".
    lengths: str | None = setting(help=LENGTHS_HELP)
    domain: str | None = setting(help="Use only this domain of the trace.")
    # Multi-turn sessions (sim/sessions.py): each turn's prompt is the previous prompt,
    # its answer and a new user message (--lengths draws the messages and answers), sent
    # a think time after the previous answer ends. Sessions start as the open loop's
    # arrivals (--qps is then sessions/s), or each closed-loop client runs one after
    # another. None: independent requests.
    session_turns: int | None = setting(help="Multi-turn sessions of this many turns; "
                                        "--qps is then sessions/s, --num-requests rounds "
                                        "up to whole sessions.", unit="turns",
                                        arrivals=(*OPEN_LOOP, "closed"))
    think_time_s: str = setting("exp:5", help="Sessions: the pause between an answer and "
                                "the next turn: exp:MEAN | fixed:S | lognormal:MEDIAN[:SIGMA] "
                                "[exp:5].", unit="s", arrivals=(*OPEN_LOOP, "closed"))
    system_prompt_tokens: int = setting(0, help="Sessions: a system prompt every session's "
                                        "turns start with (shared, so cached once).",
                                        unit="tokens", arrivals=(*OPEN_LOOP, "closed"))


@dataclass(frozen=True)
class SimConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    deployment: DeploymentConfig = field(default_factory=DeploymentConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    policy: str = setting(DEFAULT_POLICY, help=policy_help, doc="The verification policy, "
                          "NAME[:ARG] ([policies.md](policies.md) lists every one; "
                          "`dspark-sim policies` prints them).", swept="--policies")
    # the block drafter's trace; None: the profile's default_trace, else the built-in one
    trace: str | None = setting(help="Acceptance trace, schema v1 or v2 (path or built-in "
                                "name; tree policies need v2, e.g. cure-qwen3-8b-synthetic).",
                                reads="file or name", swept="--traces")
    # trace for the MTP-1 head; None: built-in
    mtp_trace: str | None = setting(help="Trace for the mtp1 policy.", reads="file or name")
    # confidence calibration map (TOML); None: identity
    calibration: str | None = setting(help="Confidence calibration map: TOML path, built-in "
                                      "name, or 'identity' (default: the map the trace "
                                      "names, else identity).", reads="file or name")
    # Draft block the block drafter proposes per step (DSpark-5 is 5); None: the trace's
    # gamma_max. At most the trace's.
    gamma_max: int | None = setting(help="Draft block the block drafter proposes per step "
                                    "(DSpark-5: 5; default: the trace's).", unit="tokens")
    # Where the replayed trace's confidences come from: trace (its own conf), position
    # or synthetic:AUC (dspark_sim.calibration.confidence_source; imported traces have no conf).
    # None: the trace's own, and nothing about them in the summary.
    conf_source: str | None = setting(help="Drafter confidences: trace (the trace's own, "
                                      "default) | position (each position's acceptance "
                                      "rate) | synthetic:AUC (calibrated, that AUC, e.g. "
                                      "synthetic:0.85) for a trace without them (imported); "
                                      "calibration identity unless --calibration.")
    # Draft positions to extrapolate the trace to, past its gamma_max, with its last
    # position's conditional acceptance (a what-if on drafting more); None: as recorded.
    extrapolate_gamma: int | None = setting(help="Draft this many positions: past the "
                                            "trace's gamma_max, rows that accepted every "
                                            "draft go on with its last position's "
                                            "conditional acceptance (a what-if on drafting "
                                            "more).", unit="positions")
    seed: int = setting(0, help="One seed for everything random [0].", swept="--seeds")
    slo_ttft_ms: float | None = setting(help="Goodput: a request's time to first token at "
                                        "most this (--slo ttft:MS).", option=SLO, unit="ms")
    slo_tpot_ms: float | None = setting(help="Goodput: a request's time per output token at "
                                        "most this (--slo tpot:MS).", option=SLO, unit="ms")
    drain_timeout_s: float = setting(120.0, option=None, unit="s", help="Simulate at most "
                                     "this long after the last arrival.")
    # ~20 us of wall time per step: 5M steps ~ 2 min.
    max_engine_steps: int = setting(5_000_000, option=None, unit="steps", help="Every run "
                                    "is bounded: it stops after this many engine steps (all "
                                    "replicas), and the summary says so (bounded_by).")

    def validate(self) -> SimConfig:
        """Types, ranges and the limits above; returns ``self``."""
        _check_types(self)
        _validate_engine(self.engine)
        _validate_deployment(self.deployment)
        _validate_workload(self.workload)
        if not 0 <= self.seed <= MAX_SEED:
            raise InputError("--seed", f"must be an integer in [0, 2**63), got {self.seed}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            v = getattr(self, name)
            if v is not None:
                _pos_float(f"--slo/{name}", v)  # the option, or the file's key
        # no option sets these two: a config file or a preset did (named by _reblame)
        _pos_float("drain_timeout_s", self.drain_timeout_s, MAX_SIM_TIME_S)
        check_positive_int("max_engine_steps", self.max_engine_steps, MAX_ENGINE_STEPS)
        check_positive_int("--gamma-max", self.gamma_max, 64)
        from dspark_sim.calibration.confidence_source import MAX_GAMMA, check_conf_source

        check_conf_source(self.conf_source)
        check_positive_int("--extrapolate-gamma", self.extrapolate_gamma, MAX_GAMMA)
        return self


def _validate_engine(e: EngineConfig) -> None:
    for name, lim in LIMITS.items():  # each within its bound, as a profile's [engine] too
        option, value = SETTINGS[f"engine.{name}"].option, getattr(e, name)
        if not lim.choices:
            check_positive_int(option, value, lim.maximum)
        elif value is not None:
            _choice(option, value, lim.choices)
    if None not in (e.max_num_seqs, e.max_num_batched_tokens) \
            and e.max_num_seqs > e.max_num_batched_tokens:
        raise InputError("--max-num-seqs", "must not exceed max_num_batched_tokens")
    _choice("--kv-mode", e.kv_mode, KV_MODES)
    if e.prefix_cache is not None:
        _choice("--prefix-cache", e.prefix_cache, PREFIX_CACHE_MODES)
    check_positive_int("--prefix-block-tokens", e.prefix_block_tokens, MAX_PREFIX_BLOCK_TOKENS)


def _validate_deployment(d: DeploymentConfig) -> None:
    check_positive_int("--replicas", d.replicas, MAX_REPLICAS)
    check_positive_int("--prefill-instances", d.prefill_instances, MAX_REPLICAS)
    _choice("--router", d.router, ROUTERS)


def _validate_workload(w: WorkloadConfig) -> None:
    _choice("workload.arrival", w.arrival, ARRIVALS)
    check_positive_int("--num-requests", w.num_requests, MAX_NUM_REQUESTS)
    _pos_float("--duration-s", w.duration_s, MAX_SIM_TIME_S)
    if w.arrival in ("poisson", "gamma"):
        _validate_open_loop(w)
    if w.arrival == "closed":
        check_positive_int("--max-concurrency", w.max_concurrency, MAX_NUM_REQUESTS)
        if w.num_requests is None and not w.workload_path:
            raise InputError("--num-requests", "closed-loop runs need --num-requests "
                             "(or a --workload file whose requests the clients send)")
    if w.arrival == "replay" and not w.workload_path:
        raise InputError("--workload", "replay arrivals need a workload file")
    _pos_float("--replay-qps", w.replay_qps)
    if w.lengths is not None:
        _validate_lengths(w.lengths)
    _validate_sessions(w)


def _validate_sessions(w: WorkloadConfig) -> None:
    """Sessions: a count of turns, a think-time spec, a system prompt; drawn whole in
    memory, so bounded by a request count (the streamed runs' threshold) and not by a
    window or a file."""
    check_positive_int("--session-turns", w.session_turns, MAX_SESSION_TURNS)
    if not isinstance(w.system_prompt_tokens, int) or \
            not 0 <= w.system_prompt_tokens <= MAX_TOKENS_PER_REQUEST:
        raise InputError("--system-prompt-tokens", f"must be a whole number in [0, "
                         f"{MAX_TOKENS_PER_REQUEST:,}], got {w.system_prompt_tokens!r}")
    if w.session_turns is None:
        return
    if w.workload_path:
        raise InputError("--session-turns", "a workload file carries its own requests; "
                         "sessions are drawn (leave one of the two out)")
    if w.num_requests is None or w.num_requests > MAX_SESSION_REQUESTS:
        raise InputError("--num-requests", f"sessions need --num-requests (at most "
                         f"{MAX_SESSION_REQUESTS:,}: they are drawn whole, in memory)")
    parse_think_time(w.think_time_s)


def parse_think_time(spec: str) -> tuple[str, float, float]:
    """``exp:MEAN`` | ``fixed:S`` | ``lognormal:MEDIAN[:SIGMA]`` (seconds) -> (kind, first
    argument, sigma: 1 unless given)."""
    kind, _, rest = str(spec).partition(":")
    args = rest.split(":") if rest else []
    try:
        nums = [float(a) for a in args]
    except ValueError:
        nums = []
    ok = (kind in ("exp", "fixed") and len(nums) == 1) or (kind == "lognormal"
                                                          and len(nums) in (1, 2))
    if not ok or not all(math.isfinite(v) and 0 <= v <= MAX_SIM_TIME_S for v in nums) \
            or (kind == "lognormal" and (nums[0] <= 0 or nums[-1] > MAX_LOGNORMAL_SIGMA)):
        raise InputError("--think-time-s", f"expected exp:MEAN, fixed:S or "
                         f"lognormal:MEDIAN[:SIGMA] in seconds, got {spec!r}")
    return kind, nums[0], nums[1] if len(nums) == 2 else 1.0


def _validate_open_loop(w: WorkloadConfig) -> None:
    """Poisson/gamma arrivals: a rate whose window the clock can hold, a shape whose gaps
    neither overflow nor underflow, and at least one request expected in the window."""
    _pos_float("--qps", w.qps)
    _pos_float("--burstiness", w.burstiness)
    lo, hi = BURSTINESS_RANGE
    if w.arrival == "gamma" and not lo <= w.burstiness <= hi:
        raise InputError("--burstiness", f"must lie in [{lo:g}, {hi:g}] (gamma shape; 1 = "
                         f"Poisson), got {w.burstiness:g}")
    if w.num_requests is None and w.duration_s is None:
        raise InputError("--num-requests", "give --num-requests or --duration-s")
    if w.num_requests is not None:
        window_s = w.num_requests / w.qps
        if window_s > MAX_SIM_TIME_S:
            raise InputError("--qps", f"{w.qps:g} req/s spreads {w.num_requests} requests over "
                             f"~{window_s:.3g} s; the simulated clock is limited to "
                             f"{MAX_SIM_TIME_S:g} s: raise --qps or lower --num-requests")
    if w.duration_s is not None:
        expected = w.qps * w.duration_s
        if expected < 1:
            raise InputError("--qps/--duration-s", f"{w.qps:g} req/s over {w.duration_s:g} s "
                             f"expects {expected:.3g} requests: the run would simulate none")
        if w.num_requests is None and expected > MAX_NUM_REQUESTS:
            raise InputError("--qps/--duration-s", f"{w.qps:g} req/s over {w.duration_s:g} s "
                             f"expects {expected:.3g} requests; the limit is "
                             f"{MAX_NUM_REQUESTS:,} (--num-requests caps the count)")


def _validate_lengths(spec: str) -> None:
    """Numeric ``--lengths`` arguments: whole tokens per request below the limit (the
    name and the shape of the spec are checked where it is parsed, in workload.py)."""
    _kind, _, rest = spec.partition(":")
    for a in (x for x in rest.split(":") if x) if rest else ():
        try:
            v = float(a)
        except ValueError:
            return  # workload.sample_lengths names the malformed spec
        if not math.isfinite(v) or v > MAX_TOKENS_PER_REQUEST:
            raise InputError("--lengths", f"{spec!r}: token counts must be finite and at most "
                             f"{MAX_TOKENS_PER_REQUEST:,}")


def _pos_float(option: str, v, limit: float | None = None) -> None:
    """A finite positive number up to ``limit`` (None passes: the field is optional)."""
    if v is None:
        return
    try:
        f = float(v)
    except (TypeError, ValueError):
        f = float("nan")
    if not math.isfinite(f) or f <= 0:
        raise InputError(option, f"must be a positive number, got {v!r}")
    if limit is not None and f > limit:
        raise InputError(option, f"{f:g} is above the limit of {limit:g}")


def _choice(option: str, v: str, options: tuple[str, ...]) -> None:
    if v not in options:
        raise InputError(option, f"must be one of {', '.join(options)}, got {v!r}")


# -- presets --------------------------------------------------------------------------
PRESETS: dict[str, SimConfig] = {
    # The embedded default: four DP-attention ranks (H200) of a V4-Flash-like EP32 decode
    # group with disaggregated prefill, 200 req/s of chat.
    "default": SimConfig(),
    # One replica, closed loop: the shape of an InferenceX point; the default's prefill
    # instances per decode rank (14 for 4), rounded up.
    "single-replica": SimConfig(
        deployment=DeploymentConfig(replicas=1, prefill_instances=4),
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
    except (KeyError, TypeError):
        raise InputError("--preset", f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None


# -- settings -> config -----------------------------------------------------------------
SECTIONS: dict[str, type] = {"engine": EngineConfig, "deployment": DeploymentConfig,
                             "workload": WorkloadConfig}


@dataclass(frozen=True)
class Setting:
    """One setting as the schema (:func:`setting`) declares it, read off its field.
    ``path`` is how a layer names it: a ``[run]`` key (``seed``) or ``table.key``."""

    table: str  # the config file's table: run, workload, deployment, engine
    key: str
    type: Any  # the field's annotation, resolved
    default: Any
    text: str | Callable[[], str]  # the help, or what builds it (read it as .help)
    option: str | None  # the command-line flag ("--workload"); None: config files only
    spec: SpecOption | None  # set through a spec option that sets others too (--slo)
    unit: str | None
    arrivals: tuple[str, ...] | None  # the arrival kinds that read it; None: every kind
    reads: str | None  # "file", "file or name": it names an input (a file, or a built-in)
    doc: str | None  # docs/cli.md's text in place of the help
    swept: str | None  # the sweep option that makes it a grid axis; None: one value

    @property
    def help(self) -> str:
        # built on first use: the policy list loads every policy module (numba's included)
        return self.text() if callable(self.text) else self.text

    @property
    def path(self) -> str:
        return self.key if self.table == "run" else f"{self.table}.{self.key}"

    def get(self, cfg: SimConfig) -> Any:
        return getattr(cfg if self.table == "run" else getattr(cfg, self.table), self.key)


def _schema() -> dict[str, Setting]:
    """Every field of :class:`SimConfig` and its parts, in declaration order (a field
    declared ``after`` another right after it)."""
    out = {}
    # the tables in the order run --help shows them (docs/cli.md too)
    for table, cls in (("run", SimConfig), ("workload", WorkloadConfig),
                       ("deployment", DeploymentConfig), ("engine", EngineConfig)):
        hints = typing.get_type_hints(cls)
        for f in _listed([f for f in fields(cls) if f.name not in SECTIONS]):
            m = _setting_of(f)
            opt = m["option"]
            spec = opt if isinstance(opt, SpecOption) else None
            flag = spec.flag if spec else ("--" + f.name.replace("_", "-") if opt == "" else opt)
            s = Setting(table, f.name, hints[f.name], f.default, m["help"], flag, spec,
                        m["unit"], m["arrivals"], m["reads"], m["doc"], m["swept"])
            out[s.path] = s
    return out


def _setting_of(f) -> dict:
    """A field's schema entry: its ``setting(...)``, or, for an engine limit (declared
    once, on ``EngineLimits``), an option of its name with its ``Limit``'s help and
    unit. A field with neither: declare it with setting()."""
    if "limit" in f.metadata:
        lim = f.metadata["limit"]
        return setting(help=lim.help, unit=lim.unit).metadata["setting"]
    return f.metadata["setting"]


def _listed(fs: list) -> list:
    """``fs`` in the order the schema lists them: a field declared ``after`` another
    right after it."""
    out = [f for f in fs if not _setting_of(f)["after"]]
    for f in fs:
        after = _setting_of(f)["after"]
        if after:
            out.insert(next(i for i, g in enumerate(out) if g.name == after) + 1, f)
    return out


SETTINGS: dict[str, Setting] = _schema()
# The keys each table of a config file takes, in the schema's order.
TABLES: dict[str, tuple[str, ...]] = {t: tuple(s.key for s in SETTINGS.values() if s.table == t)
                                      for t in ("run", "workload", "deployment", "engine")}
RUN_KEYS = TABLES["run"]
# Every config field as a layer names it: a [run] key, or "section.field".
CONFIG_PATHS = frozenset(SETTINGS)
# Command-line flag -> the settings it sets (one, or a spec option's several).
OPTIONS: dict[str, tuple[Setting, ...]] = {}
for _s in SETTINGS.values():
    if _s.option is not None:
        OPTIONS[_s.option] = (*OPTIONS.get(_s.option, ()), _s)
# Command-line option (its Python name) -> the one config field it sets.
OPTION_FIELDS: dict[str, str] = {flag[2:].replace("-", "_"): s[0].path
                                 for flag, s in OPTIONS.items() if len(s) == 1}
# Workload fields that mean nothing under an arrival kind: setting one explicitly (at the
# layer that chose the arrival, or above) is a conflict, not something to drop silently.
UNUSED_BY_ARRIVAL: dict[str, tuple[str, ...]] = {
    a: tuple(s.key for s in SETTINGS.values() if s.arrivals is not None and a not in s.arrivals)
    for a in ARRIVALS}


def settings_markdown() -> str:
    """docs/cli.md's tables of every setting, one per config table: key, option, type,
    default, unit and help, straight from the schema (``cog -r docs/cli.md``)."""
    out = []
    for table, keys in TABLES.items():
        out += [f"`[{table}]`", "", "| key | option | type | default | unit | what it sets |",
                "|---|---|---|---|---|---|"]
        for s in (SETTINGS[k if table == "run" else f"{table}.{k}"] for k in keys):
            out.append(f"| `{s.key}` | {'config only' if s.option is None else f'`{s.option}`'} "
                       f"| {_type_name(s.type).partition(' ')[2]} | {_toml_value(s.default)} "
                       f"| {s.unit or ''} | {_doc_help(s)} |")
        out.append("")
    return "\n".join(out)


def _toml_value(v: Any) -> str:
    """A default as a config file writes it (``5_000_000``, ``"poisson"``), or unset."""
    if v is None:
        return "unset"
    if isinstance(v, int) and abs(v) >= 10_000:
        return f"`{v:_}`"
    return f'`"{v}"`' if isinstance(v, str) else f"`{v!r}`"


def _doc_help(s: Setting) -> str:
    text = s.doc or s.help
    if s.arrivals is not None:
        kinds = s.arrivals[0] if len(s.arrivals) == 1 else \
            f"{', '.join(s.arrivals[:-1])} and {s.arrivals[-1]}"
        text += f" Arrival kinds that read it: {kinds}."
    return text.replace("|", "\\|")


class _Layer:
    """One source of settings (a preset, a TOML file, the command line): field path ->
    value, and field path -> where it was given (for errors)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.values: dict[str, Any] = {}
        self.where: dict[str, str] = {}

    def set(self, path: str, value: Any, where: str) -> None:
        if isinstance(value, str) and not value.strip():
            # given but empty is not "not given": --lengths '' or a file's lengths = ""
            # ran the default lengths, --trace '' the default trace
            raise InputError(where, "is empty: give a value or leave it out")
        self.values[path] = _coerce(value, SETTINGS[path].type, where)
        self.where[path] = where

    def __contains__(self, path: str) -> bool:
        return path in self.values


def _type_name(hint: Any) -> str:
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    names = {int: "an integer", float: "a number", str: "a string", bool: "true/false"}
    return " or ".join(names.get(a, getattr(a, "__name__", str(a)))
                       for a in args if a is not type(None))


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """``value`` as the annotation ``hint`` wants it (int, float, str, bool, X | None);
    an int is a valid float, a bool is never a number."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in args:
        return None
    is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    for t in args:
        if t is float and is_number:
            return float(value)
        if t is int and is_number and isinstance(value, numbers.Integral):
            return int(value)
        if t in (str, bool) and isinstance(value, t):
            return value
    raise InputError(where, f"must be {_type_name(hint)}, got {value!r}")


def _check_types(cfg: SimConfig) -> None:
    """Every field of ``cfg`` matches its annotation (configs built in Python too)."""
    for s in SETTINGS.values():
        _check_field(s, s.get(cfg))


def _check_field(s: Setting, value: Any) -> None:
    # named by its option (a spec option's field by its own name, as before the schema)
    where = s.option if s.option and not s.spec else f"--{s.key.replace('_', '-')}"
    _coerce(value, s.type, where)
    if isinstance(value, str) and not value.strip():
        # given but empty, as the layers refuse it (_Layer.set): a config built in Python
        # with trace="" (or domain, lengths, calibration, mtp_trace) ran the default
        raise InputError(where, "is empty: give a value or leave it out")


def _unknown_table(name: str, body) -> str:
    """An unknown table, or a setting written above every table (``qps = 5`` on the first
    line): the latter names the table that holds it."""
    known = ", ".join((*SECTIONS, "run"))
    if isinstance(body, dict):
        return f"unknown table [{name}]; known: {known}"
    holders = [t for t in (*SECTIONS, "run") if name in TABLES[t]]
    if holders:
        return f"'{name}' is outside any table; it belongs under [{holders[0]}]"
    return f"unknown top-level key '{name}'; settings go in the tables {known}"


def _toml_layer(data: dict, source: str) -> _Layer:
    layer = _Layer(source)
    for table, body in data.items():
        if table == "preset":
            continue
        if table not in (*SECTIONS, "run"):
            raise InputError(source, _unknown_table(table, body))
        if not isinstance(body, dict):
            raise InputError(source, f"[{table}] must be a table, got {body!r}")
        names = TABLES[table]
        for key, value in body.items():
            if key not in names:
                raise InputError(f"{source} [{table}]", f"unknown key {key!r}; known: "
                                 f"{', '.join(names)}")
            layer.set(key if table == "run" else f"{table}.{key}", value,
                      f"{source} [{table}] {key}")
    return layer


def _options_layer(options: dict[str, Any]) -> _Layer:
    layer = _Layer("command line")
    for name, value in options.items():
        if value is None:
            continue  # not given: lower layers decide
        flag = f"--{name.replace('_', '-')}"
        if flag not in OPTIONS:
            raise InputError(flag, "is not a simulation setting")
        settings = OPTIONS[flag]
        spec = settings[0].spec
        for s, v in zip(settings, spec.parse(value) if spec else (value,), strict=True):
            if v is not None:  # a spec's part not given
                layer.set(s.path, str(v) if s.reads == "file" else v, flag)
    return layer


def _apply(cfg: SimConfig, layer: _Layer, arrival_layer: int, index: int) -> tuple[SimConfig, int]:
    """``cfg`` with ``layer``'s settings and their implications; returns the index of the
    layer that now decides the arrival kind."""
    w = cfg.workload
    v = layer.values
    # Implications of a layer's own keys, unless the same layer names the arrival itself.
    if "workload.arrival" not in layer:
        implied = None
        if "workload.max_concurrency" in layer:
            implied = ("closed", "workload.max_concurrency")
        elif "workload.workload_path" in layer:
            implied = ("replay", "workload.workload_path")
        elif "workload.burstiness" in layer and w.arrival in ("poisson", "gamma"):
            implied = ("gamma", "workload.burstiness")
        elif w.arrival == "closed":
            implied = _opened_loop(layer, w)
        if implied is not None:
            v["workload.arrival"] = implied[0]
            layer.where["workload.arrival"] = layer.where[implied[1]]
    arrival = v.get("workload.arrival", w.arrival)
    if arrival == "replay" and "workload.qps" in layer and "workload.replay_qps" not in layer:
        # --qps with a replayed file rescales its timestamps to that rate.
        v["workload.replay_qps"] = v.pop("workload.qps")
        layer.where["workload.replay_qps"] = layer.where.pop("workload.qps")
    if "workload.duration_s" in layer and "workload.num_requests" not in layer:
        v["workload.num_requests"] = None  # the window alone bounds the run
        layer.where["workload.num_requests"] = layer.where["workload.duration_s"]
    policy = v.get("policy", cfg.policy)
    if "trace" in layer and "mtp_trace" not in layer and str(policy).strip().lower() == "mtp1":
        v["mtp_trace"] = v["trace"]  # `--policy mtp1 --trace X` means: replay X

    parts = {s: {k.partition(".")[2]: x for k, x in v.items() if k.startswith(s + ".")}
             for s in SECTIONS}
    cfg = replace(cfg, **{s: replace(getattr(cfg, s), **kv) for s, kv in parts.items() if kv},
                  **{k: x for k, x in v.items() if "." not in k})
    return cfg, (index if "workload.arrival" in layer else arrival_layer)


def _opened_loop(layer: _Layer, w: WorkloadConfig) -> tuple[str, str] | None:
    """An open-loop setting (a rate, a burstiness, a window) in a layer above the one that
    chose a closed loop overrides that choice, as a higher layer overrides any setting:
    ``--preset single-replica --qps 5`` is Poisson at 5 req/s. A closed loop that sends a
    workload file's requests opens into a replay of the file (``--qps`` rescales it, as
    with ``--workload``); a burstiness cannot shape a replay, so it opens nothing there.
    None: the layer gives no open-loop setting (or gives a concurrency as well, which
    implied the closed loop first)."""
    keys = ("workload.qps", "workload.duration_s") if w.workload_path else \
        ("workload.burstiness", "workload.qps", "workload.duration_s")
    given = [k for k in keys if k in layer]
    if not given:
        return None
    if w.workload_path:
        return "replay", given[0]
    return ("gamma" if "workload.burstiness" in layer else "poisson"), given[0]


def _check_conflicts(cfg: SimConfig, layers: list[_Layer], arrival_layer: int) -> None:
    arrival = cfg.workload.arrival
    decided_by = layers[arrival_layer].where.get("workload.arrival", layers[arrival_layer].name)
    for layer in layers[max(arrival_layer, 1):]:
        for name in UNUSED_BY_ARRIVAL.get(arrival, ()):  # an unknown kind: validated next
            where = layer.where.get(f"workload.{name}")
            if where is not None:
                raise InputError(where, f"does not apply to {arrival} arrivals (chosen by "
                                 f"{decided_by}); {_ARRIVAL_HELP[arrival]}")


_ARRIVAL_HELP = {
    "poisson": "--burstiness makes gamma arrivals, --max-concurrency a closed loop",
    "gamma": "--max-concurrency makes a closed loop, --workload a replay",
    "closed": "each client sends its next request when the previous one finishes, so "
              "there is no arrival rate or window",
    "replay": "the file's timestamps set the arrivals (--qps or --replay-qps rescales them)",
}


def resolve_config(*, preset_name: str | None = None, config_path: str | Path | None = None,
                   options: dict[str, Any] | None = None,
                   layers_out: list | None = None) -> SimConfig:
    """The run's config: preset < config file < explicitly given options.

    ``preset_name`` (``--preset``) wins over the file's own ``preset = ...`` key, which
    wins over ``default``. ``options`` maps option names (the flags of :data:`OPTIONS`
    as Python names: ``workload``, ``slo``) to values; ``None`` means not given. Some settings imply others within the
    layer that gives them (``max_concurrency`` -> a closed loop, ``workload`` -> replay,
    ``burstiness`` -> gamma, ``duration_s`` without ``num_requests`` -> the window alone
    bounds the run, ``qps`` with a replay -> ``replay_qps``; ``qps``, ``burstiness`` or
    ``duration_s`` over a lower layer's closed loop -> an open loop, :func:`_opened_loop`);
    a setting that does not apply to the resulting arrival kind is an error naming it.
    ``layers_out``, if given, receives the layers, for :func:`blame_config`.
    """
    data: dict = {}
    file_layer = None
    if config_path is not None:
        data = read_toml(config_path, "config file")
        file_layer = _toml_layer(data, str(config_path))
    file_preset = data.get("preset")
    if preset_name is None and file_preset is not None and not isinstance(file_preset, str):
        raise InputError(f"{config_path} preset", f"must be a string, got {file_preset!r}")
    if preset_name is not None and not isinstance(preset_name, str):  # .strip() raised
        raise InputError("--preset", f"must be a string, got {preset_name!r}")
    if preset_name is not None and not preset_name.strip():
        raise InputError("--preset", "is empty: give a preset name or leave the option out")
    name = preset_name or file_preset or "default"
    try:
        cfg = preset(name)
    except InputError as err:
        if preset_name:
            raise
        # the file's preset, not the --preset option nobody typed
        raise InputError(f"{config_path} preset", err.problem) from None
    layers = [_preset_layer(name, cfg)]
    arrival_layer = 0
    for layer in (file_layer, _options_layer(options or {})):
        if layer is None:
            continue
        layers.append(layer)
        cfg, arrival_layer = _apply(cfg, layer, arrival_layer, len(layers) - 1)
    _check_conflicts(cfg, layers, arrival_layer)
    cfg = _validate_blaming(cfg, layers)
    _check_engine_limits(cfg, layers)
    _check_prefill_count(cfg, layers)
    if layers_out is not None:
        layers_out.extend(layers)
    return cfg


@contextmanager
def blame_config(layers: list[_Layer]) -> Iterator[None]:
    """An :class:`InputError` raised in the block about a setting (a policy, profile,
    trace, length spec or domain found bad only when it is loaded) names where the value
    was given: the config file's table and key, or the preset, rather than an option the
    user never typed (``--policy: unknown policy`` for the file's ``[run] policy``)."""
    try:
        yield
    except InputError as err:
        _reblame(err, layers)


def _preset_layer(name: str, cfg: SimConfig) -> _Layer:
    """The preset as a layer: the settings it changes from the defaults, each given by
    ``--preset NAME`` (so an error about one names the preset)."""
    layer = _Layer(f"preset {name}")
    base = SimConfig()
    for s in SETTINGS.values():
        if s.get(cfg) != s.get(base):
            layer.where[s.path] = f"--preset {name}"
    return layer


def _validate_blaming(cfg: SimConfig, layers: list[_Layer]) -> SimConfig:
    """``cfg.validate()``, with an error about a setting that a config file gave (not the
    command line) naming the file, table and key instead of the option the user never
    typed: ``c.toml [deployment] replicas: must be a positive integer, got 0``."""
    try:
        return cfg.validate()
    except InputError as err:
        _reblame(err, layers)


def _reblame(err: InputError, layers: list[_Layer]) -> typing.NoReturn:
    """Raise ``err`` naming where its option was actually given (a config file's table
    and key, or the preset) rather than the option itself, if not on the command line.
    ``layers[0]`` (the preset) is blamed only when no higher layer gave any of them."""
    flags = (err.where or "").split("/")
    if not all(f.startswith("--") or f in CONFIG_PATHS for f in flags):
        raise err  # a file's path ("runs/workload/w.csv"), not options: it names the file
    for group in (layers[1:], layers[:1]):
        found = False
        for flag in flags:
            # an option's name, or a config field no option sets ("drain_timeout_s",
            # "workload.arrival"): named as itself, not as an option nobody can type
            path = OPTION_FIELDS.get(flag.removeprefix("--").replace("-", "_"),
                                     flag if flag in CONFIG_PATHS else None)
            given = next((layer.where[path] for layer in reversed(group)
                          if path is not None and path in layer.where), None)
            if given is not None and given != flag:
                raise InputError(given, err.problem) from None
            found |= given is not None
        if found:
            break
    raise err


def _check_engine_limits(cfg: SimConfig, layers: list[_Layer]) -> None:
    """``max_num_seqs <= max_num_batched_tokens`` once the profile (or the default) fills
    in the one of the two the run does not give. The engine checks it too, but names only
    options; here the error names what the user gave: the option, the config file's key
    or the preset. Costs a profile load only when exactly one of the two is given."""
    e = cfg.engine
    if (e.max_num_seqs is None) == (e.max_num_batched_tokens is None):
        return  # both given: validate() compared them; neither: the profile's own pair
    from dspark_sim.calibration.profile import load_profile, resolve_limits

    try:
        resolve_limits(e, load_profile(cfg.deployment.profile))
    except InputError as err:
        _reblame(err, layers)


def _check_prefill_count(cfg: SimConfig, layers: list[_Layer]) -> None:
    """A prefill-instance count given (option, config file; a preset's is its default)
    for a run whose prefill is chunked, in the decode batch, would be ignored: refused,
    naming where it was given. Costs a profile load only when the count is given and the
    prefill mode is left to the profile."""
    path = "deployment.prefill_instances"
    where = next((layer.where[path] for layer in reversed(layers[1:]) if path in layer), None)
    if where is None:
        return
    mode = cfg.engine.prefill
    if mode is None:
        from dspark_sim.calibration.profile import load_profile, resolve_limits

        try:
            mode = resolve_limits(cfg.engine, load_profile(cfg.deployment.profile)).prefill
        except InputError as err:
            _reblame(err, layers)
    if mode != "disaggregated":
        raise InputError(where, f"this run's prefill is {mode} (in the decode batch), so it "
                         "has no prefill instances: give --prefill disaggregated, or leave "
                         "the count out")


def input_files(cfg: SimConfig) -> dict[str, Path]:
    """The files a run of ``cfg`` reads, by the option that names each (``--profile``,
    ``--trace``, ``--mtp-trace``, ``--calibration``, ``--workload``); built-in names are
    no files and are left out."""
    files = {}
    for s in SETTINGS.values():
        spec = s.get(cfg) if s.reads else None
        if spec is not None and Path(spec).is_file():
            files[s.option or s.path] = Path(spec)
    return files


def requests_known(w: WorkloadConfig) -> int | None:
    """How many requests a run of workload ``w`` simulates (None: a workload file's, or a
    closed loop bounded by time: known only as it runs)."""
    if w.workload_path:
        return None
    n = w.num_requests
    if w.duration_s is not None:
        if w.arrival == "closed":
            return None
        window = math.ceil(w.qps * w.duration_s)
        n = window if n is None else min(n, window)
    return n


def files_read(cfg: SimConfig, options: dict[str, str | Path | None]) -> dict[str, str | None]:
    """The files a run of ``cfg`` reads, as :func:`dspark_sim.io.check_writable`'s
    ``not_over``: those its config names (a built-in name is none) and ``options``'
    (option -> path or spec; None: not given)."""
    reads: dict[str, str | None] = {f"the {opt} file": str(p)
                                    for opt, p in input_files(cfg).items()}
    reads.update({f"the {opt} file": file_or_none(str(v))
                  for opt, v in options.items() if v is not None})
    return reads


def load_config(path: str | Path, base: SimConfig | None = None) -> SimConfig:
    """Read a TOML config; missing keys keep ``base`` (default: the file's ``preset``, else
    the default preset). Type-checked and validated like :func:`resolve_config`."""
    if base is None:
        return resolve_config(config_path=path)
    layers = [_Layer("base config"), _toml_layer(read_toml(path, "config file"), str(path))]
    cfg, arrival_layer = _apply(base, layers[1], 0, 1)
    _check_conflicts(cfg, layers, arrival_layer)
    return _validate_blaming(cfg, layers)


def check_draft_length(policy: Any, trace: Any, gamma_max: int | None = None) -> None:
    """A policy that verifies a fixed ``k`` draft tokens (``fixed:K``) cannot verify more
    than the drafter drafts (the trace's ``gamma_max``, or the run's ``--gamma-max``):
    refuse rather than silently verify fewer; nor can ``--gamma-max`` exceed what the
    trace recorded. ``policy`` is a registry Policy, ``trace`` an AcceptanceTrace or None."""
    if trace is None or getattr(policy, "drafter", None) is None:
        return
    from dspark_sim.calibration.confidence_source import MAX_GAMMA

    if gamma_max is not None and gamma_max > trace.gamma_max:
        raise InputError("--gamma-max", f"{gamma_max} exceeds the {trace.gamma_max} draft "
                         f"positions {trace.source_path} records; --extrapolate-gamma "
                         f"{gamma_max} extrapolates the trace past them")
    limit = trace.gamma_max if gamma_max is None else gamma_max
    k = getattr(policy, "draft_gamma", None)
    if k is None or k <= limit:
        return
    # what lifts the limit: --gamma-max up to the trace's positions, past them only an
    # extrapolation of the trace (int8 accept_len: at most MAX_GAMMA positions)
    if limit < trace.gamma_max:
        hint = f" or raise --gamma-max (the trace records {trace.gamma_max})"
    elif k <= MAX_GAMMA:
        hint = f", or --extrapolate-gamma {k} to extrapolate the trace past position {limit}"
    else:
        hint = ""
    raise InputError("--policy", f"{policy.name} verifies {k} draft tokens per step but the "
                     f"drafter drafts at most gamma_max = {limit}: use K <= {limit}{hint}")
