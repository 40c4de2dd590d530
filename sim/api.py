"""The Python API shared by the CLI, tests, sweeps and notebooks.

>>> from dspark_sim.sim.api import simulate
>>> from dspark_sim.sim.config import preset
>>> res = simulate(preset("tiny"))
>>> res.summary["completed"]
200
>>> res.requests.to_pandas()  # doctest: +SKIP
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np

from dspark_sim.calibration.confidence_source import (
    CONF_RECORD,
    EXTEND_RECORD,
    apply_conf_source,
    extend_gamma,
    parse_conf_source,
)
from dspark_sim.calibration.confmap import CalibrationMap, builtin_calibrations, load_calibration
from dspark_sim.calibration.profile import EngineProfile, load_profile
from dspark_sim.errors import InputError
from dspark_sim.io import LazyModule, jsonable
from dspark_sim.policies import compiled
from dspark_sim.policies.registry import Policy, engine_support, get_policy
from dspark_sim.sim.ahead import Handoffs, NotAhead, StreamedHandoffs
from dspark_sim.sim.arrivals import ClosedLoop, OpenLoop, SessionLoop
from dspark_sim.sim.config import (
    MAX_ENGINE_STEPS,
    SimConfig,
    check_draft_length,
    with_replicas,
)
from dspark_sim.sim.engine import (
    NUM_COLUMNS,
    OUTPUT_TOKENS,
    PROMPT_TOKENS,
    RequestLog,
    Router,
    SimContext,
    request_rows,
)
from dspark_sim.sim.metrics import StepSeries, requests_frame, summarize
from dspark_sim.sim.outputs import write_run
from dspark_sim.sim.prefill import PrefillPool
from dspark_sim.sim.prefix_cache import PrefixCache, PromptBlocks, resolve_blocks
from dspark_sim.sim.prefix_cache import summary as prefix_summary
from dspark_sim.sim.quality import task_score
from dspark_sim.sim.sessions import SessionPlan
from dspark_sim.sim.stream import (
    ChunkTee,
    RequestWindow,
    SpillFolder,
    sliced,
)
from dspark_sim.sim.workload import (
    ChunkedStream,
    RequestStream,
    StreamChunk,
    build_stream,
    draws_in_chunks,
    uses_trace_lengths,
)
from dspark_sim.traces.schema import AcceptanceTrace, load_trace

DEFAULT_TRACE = "dspark-synthetic"
# Self-speculation (sparsespec) replays a target-drafting-for-itself trace with entropies
DEFAULT_SELFSPEC_TRACE = "selfspec-synthetic"
DEFAULT_MTP_TRACE = "mtp1-synthetic"


pl = LazyModule("polars")  # imported when the rows are read or written


class _BuiltOnRead:
    """A field holding a value, or a :class:`functools.partial` that makes it, called on the
    first read: a run's rows become a frame only when read or written (building it imports
    polars, which a run that prints its summary and writes nothing never needs)."""

    def __set_name__(self, owner, name):
        self.slot = "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:  # no default: the field is required
            raise AttributeError(self.slot[1:])
        value = obj.__dict__[self.slot]
        if isinstance(value, partial):
            value = obj.__dict__[self.slot] = value()
        return value

    def __set__(self, obj, value):
        obj.__dict__[self.slot] = value


@dataclass(frozen=True, eq=False)
class SimResult:
    """A run's summary and per-request rows. ``requests`` is a frame, or for a run of
    more than ``STREAM_ABOVE`` requests a lazy scan of the parts it streamed (they are
    removed with the result: ``collect()`` what you keep). ``steps``: the engine's
    per-step series, kept only when :func:`simulate` is asked to (``keep_steps``) and the
    run was in memory (a streamed run's steps are summarised chunk by chunk)."""

    config: SimConfig
    summary: dict
    requests: pl.DataFrame | pl.LazyFrame = _BuiltOnRead()
    # a streamed run's requests.parquet, sunk from its parts while the summary was
    # computed: ``requests_file(path)`` places it (``SpillFolder.write_requests_file``)
    requests_file: Callable[[Path], object] | None = field(default=None, repr=False)
    steps: StepSeries | None = field(default=None, repr=False)

    def to_pandas(self):
        frame = self.requests
        return (frame.collect() if isinstance(frame, pl.LazyFrame) else frame).to_pandas()

    def write(self, out_dir: str | Path) -> Path:
        """``summary.json`` and ``requests.parquet`` as one unit (``sim.outputs``: a
        manifest with the parquet's hash, ordered renames, rollback on failure); read
        them back with :func:`dspark_sim.sim.outputs.read_run`."""
        return write_run(out_dir, self.summary, self.requests if self.requests_file is None
                         else self.requests_file)


def block_trace_spec(cfg: SimConfig, profile: EngineProfile | None = None) -> str:
    """The block drafter's trace a run replays: ``--trace``, else the profile's
    ``default_trace`` (the drafter its published setup measured; ``profile`` None: the
    config's), else the package default."""
    if cfg.trace:
        return cfg.trace
    if profile is None:
        profile = load_profile(cfg.deployment.profile)
    return profile.default_trace or DEFAULT_TRACE


def replayed_trace_spec(cfg: SimConfig, policy: Policy,
                        profile: EngineProfile | None = None) -> str | None:
    """The trace (a path or built-in name) ``policy`` replays; None: it replays none.
    ``profile`` as :func:`resolve_trace`'s."""
    if not policy.speculates:
        return None
    if policy.drafter == "mtp1":
        # --mtp-trace names the MTP head's own trace; without it the run's --trace is the
        # one every policy replays, mtp1 included, however it was given (an option, a
        # config file's key, a sweep's --traces): one rule, so no path runs what another
        # refuses.
        return cfg.mtp_trace or cfg.trace or DEFAULT_MTP_TRACE
    if policy.drafter == "selfspec":
        return cfg.trace or DEFAULT_SELFSPEC_TRACE
    return block_trace_spec(cfg, profile)


def resolve_trace(cfg: SimConfig, policy: Policy,
                  profile: EngineProfile | None = None) -> AcceptanceTrace | None:
    """The trace ``policy`` replays. ``profile`` is the one the run costs steps with
    (None: the config's), read for its ``default_trace`` when no ``--trace`` is given."""
    spec = replayed_trace_spec(cfg, policy, profile)
    if spec is None:
        return None
    trace = load_trace(spec)
    if cfg.workload.domain:
        trace = trace.select_domain(cfg.workload.domain)
    return prepare_trace(cfg, trace)


# The inputs a config may name that not every policy reads: (option, what it is, whether
# ``policy`` reads it in a run of ``cfg``). A run replays ``--trace`` when its policy's
# drafter does, or, with no drafter, for ``--lengths trace``; ``--domain`` selects rows of
# whatever trace the run reads.
def _reads_trace(cfg: SimConfig, policy: Policy) -> bool:
    return replayed_trace_spec(cfg, policy) == cfg.trace or (
        not policy.speculates and uses_trace_lengths(cfg.workload))


NAMED_INPUTS = (
    ("trace", "--trace", "names the trace to replay", _reads_trace),
    ("mtp_trace", "--mtp-trace", "names the MTP-1 drafter's trace",
     lambda cfg, p: p.drafter == "mtp1"),
    ("workload.domain", "--domain", "selects the requests of one domain of the trace",
     lambda cfg, p: p.speculates or uses_trace_lengths(cfg.workload)),
    ("gamma_max", "--gamma-max", "sets the block drafter's draft length",
     lambda cfg, p: p.drafts_block),
    ("extrapolate_gamma", "--extrapolate-gamma", "extends the drafter's trace",
     lambda cfg, p: p.speculates),
    ("conf_source", "--conf-source", "sets the drafter's confidences",
     lambda cfg, p: p.speculates),
    ("calibration", "--calibration", "names the map that calibrates the drafter's "
     "confidences", lambda cfg, p: p.reads.survival),
)


def check_inputs_read(cfg: SimConfig, policies: list[Policy], *,
                      policy_option: str = "--policy") -> None:
    """Every input ``cfg`` names (a file, a built-in name, a domain, a draft length) is
    read by at least one of ``policies``, else it is refused naming the option and the
    policies: a run that leaves a named input unread (``--trace missing.parquet --policy
    none``) answers another question than the one asked, and never even finds that the
    file is missing. Built-in defaults name none of these, so only what the user gave (an
    option, a config file's key: ``blame_config`` names the key) is ever refused.
    ``policy_option``: how the user named the policies (a sweep's ``--policies``)."""
    for path, option, what, reads in NAMED_INPUTS:
        obj = cfg.workload if path.startswith("workload.") else cfg
        value = getattr(obj, path.rpartition(".")[2])
        if value is None or any(reads(cfg, p) for p in policies):
            continue
        names = ", ".join(p.name for p in policies)
        if len(policies) == 1:
            p = policies[0]
            by = (f"{policy_option} {p.name} (drafter {p.drafter})" if p.drafter else
                  f"{policy_option} {p.name} (it drafts nothing)")
            why = f"{by} never reads it"
        else:
            why = f"none of {policy_option} {names} reads it"
        hint = ("; with no drafter a run reads a trace only for --lengths trace"
                if option in ("--trace", "--domain") else "")
        raise InputError(option, f"{value!r} {what}, but {why}{hint}: leave one of the two "
                                 "out")


def prepare_trace(cfg: SimConfig, trace: AcceptanceTrace | None) -> AcceptanceTrace | None:
    """The trace as the run replays it: extrapolated to ``--extrapolate-gamma`` draft
    positions, then given ``--conf-source``'s confidences (on the extended positions
    too). Each step's report stays in the trace's generator metadata, where the summary
    reads it, and a step the trace already carries for this run (resolve_trace's trace
    handed on to simulate) is not done twice. The default source (the trace's own conf)
    changes nothing: a trace without conf is refused by the policies that read it."""
    if trace is None:
        return None
    gen = trace.meta.generator
    if cfg.extrapolate_gamma is not None and not _carries(
            gen.get(EXTEND_RECORD), cfg.seed, gamma=max(cfg.extrapolate_gamma, trace.gamma_max)):
        trace, _ = extend_gamma(trace, cfg.extrapolate_gamma, seed=cfg.seed)
    src = None if cfg.conf_source is None else parse_conf_source(cfg.conf_source)
    if src is None or (src.kind == "trace" and trace.conf is None):
        return trace
    if not _carries(trace.meta.generator.get(CONF_RECORD), cfg.seed, gamma=trace.gamma_max,
                    spec=src.text):
        trace, _ = apply_conf_source(trace, src, seed=cfg.seed)
    return trace


def _carries(record: dict | None, seed: int, **want) -> bool:
    """The trace's record of a preparation step matches this run's."""
    return isinstance(record, dict) and record.get("seed") == seed \
        and all(record.get(k) == v for k, v in want.items())


def require_trace_columns(trace: AcceptanceTrace | None, policy: Policy) -> None:
    """A confidence policy needs the trace's ``conf`` column; the others run without it."""
    if trace is not None and policy.reads.survival and trace.conf is None:
        raise InputError(trace.source_path, f"policy {policy.name} reads drafter confidences "
                         "but the trace has no 'conf' column; give --conf-source position "
                         "or synthetic:AUC")


def resolve_calibration(cfg: SimConfig, trace: AcceptanceTrace | None) -> CalibrationMap:
    """``--calibration`` wins; otherwise the identity when ``--conf-source`` made the
    confidences (they are calibrated by construction: the trace's map was fitted to
    other, raw ones); otherwise the map the trace's metadata names (a built-in name), as
    a deployed drafter ships with its fitted map; otherwise the identity."""
    if cfg.calibration is not None:
        return load_calibration(cfg.calibration)
    if cfg.conf_source is not None and parse_conf_source(cfg.conf_source).kind != "trace":
        return load_calibration(None)
    name = trace.meta.extra.get("calibration") if trace is not None else None
    if name:
        # a built-in name, never a file: a path here would be read relative to wherever
        # the command runs; a name not found is the trace's fault, so the error names it
        if name not in ("identity", "none", *builtin_calibrations()):
            raise InputError(trace.source_path, f"trace metadata 'calibration' names {name!r}, "
                             "which is not a built-in calibration map; give the map with "
                             "--calibration (built-in: "
                             f"{', '.join(builtin_calibrations())})")
        return load_calibration(name)
    return load_calibration(None)


def trace_from_profile(cfg: SimConfig, profile: EngineProfile,
                       trace: AcceptanceTrace | None) -> bool:
    """The run replays its profile's ``default_trace`` because it named no ``--trace``."""
    if cfg.trace or trace is None or not profile.default_trace:
        return False
    return trace.source_path in (profile.default_trace, f"builtin:{profile.default_trace}")


def _deployment_text(cfg: SimConfig, profile: EngineProfile,
                     prefill: PrefillPool | None = None,
                     trace: AcceptanceTrace | None = None) -> str:
    """The deployment in words. A profile whose replica is one rank of a larger
    expert-parallel group (its ``deploy_ep_size``) says so: the run simulates those ranks,
    and the group's other ranks, assumed to carry the same load, are not counted. A run
    replaying its profile's ``default_trace`` says which and why (a run that names its
    trace, or replays the package default, reads as before); one of as many replicas as
    the profile's ``default_replicas`` says that too."""
    d = cfg.deployment
    g = profile.gpus_per_replica
    ep = profile.parameters.get("deploy_ep_size")
    if isinstance(ep, int) and ep > g:
        text = (f"{d.replicas} decode replica(s) = {d.replicas * g} GPUs, each replica one "
                f"rank ({g} GPU) of an EP{ep} group")
    else:
        text = f"{d.replicas} replica(s) x {g} GPU = {d.replicas * g} GPUs"
    if d.replicas == profile.default_replicas:
        text += " (the profile's default_replicas; --replicas replaces it)"
    if prefill is not None:
        pg = prefill.instances * g
        text += (f"; {prefill.instances} prefill instance(s) x {g} GPU = {pg} GPUs "
                 f"({d.replicas * g + pg} GPUs in all)")
    text += f", profile {profile.name} ({profile.kind}), router {d.router}"
    if trace_from_profile(cfg, profile, trace):
        text += (f"; trace {profile.default_trace}: the profile's default_trace (its "
                 "published setup's drafter; --trace replaces it)")
    return text


def _request_log(cfg: SimConfig, rng: np.random.Generator, trace: AcceptanceTrace | None,
                 trace_rows: np.ndarray | None, profile: EngineProfile):
    """The request stream and each request's trace row (drawn from ``rng`` after the
    stream, so the same seed gives the same rows; zeros without a trace)."""
    stream = build_stream(cfg.workload, rng, trace=_length_trace(cfg, trace, profile))
    n = stream.size
    row = np.zeros(n, np.int64)
    if trace is not None:
        row[:] = rng.integers(0, trace.num_requests, size=n)
        if stream.trace_rows is not None:  # each request replays the row its lengths came from
            row[:] = stream.trace_rows
        if trace_rows is not None:
            # integers as given: a cast cut 1.7 to row 1 and read True as row 1, and NaN,
            # None or 2**70 were ValueError / TypeError / OverflowError tracebacks
            rows_in = np.asarray(trace_rows)
            if rows_in.dtype.kind not in "iu" or rows_in.shape != (n,) \
                    or rows_in.min(initial=0) < 0 or rows_in.max(initial=0) >= trace.num_requests:
                raise InputError("trace_rows", f"need {n} integer row indices in "
                                               f"[0, {trace.num_requests})")
            row[:] = rows_in
    return stream, row


def _length_trace(cfg: SimConfig, trace: AcceptanceTrace | None,
                  profile: EngineProfile) -> AcceptanceTrace | None:
    """The trace ``--lengths trace`` takes lengths (and rows) from: the run's, or loaded
    even when the policy replays none (`none` then serves the same requests as the
    speculative runs)."""
    if trace is None and uses_trace_lengths(cfg.workload):
        trace = load_trace(block_trace_spec(cfg, profile))
        if cfg.workload.domain:
            trace = trace.select_domain(cfg.workload.domain)
    return trace


def _drawn_in_chunks(cfg: SimConfig, trace: AcceptanceTrace | None, trace_rows,
                     profile: EngineProfile) -> ChunkedStream | None:
    """A streamed run's drawn stream (``workload.ChunkedStream``): a Poisson, gamma or
    closed-loop workload expecting more than ``STREAM_ABOVE`` requests, with no rows
    pinned by the caller; None for the others (drawn whole, as they always were)."""
    w = cfg.workload
    if trace_rows is not None or not draws_in_chunks(w):
        return None
    expected = float("inf") if w.num_requests is None else w.num_requests
    if w.arrival != "closed" and w.duration_s is not None:
        expected = min(expected, w.qps * w.duration_s)
    if expected <= STREAM_ABOVE:
        return None
    return ChunkedStream(w, cfg.seed, STREAM_CHUNK, trace=_length_trace(cfg, trace, profile),
                         rows_of=trace)


def _in_memory_log(stream, trace_row: np.ndarray) -> RequestLog:
    log = RequestLog.empty(stream.size)
    log.prompt_tokens[:] = stream.prompt_tokens
    log.output_tokens[:] = stream.output_tokens
    log.trace_row[:] = trace_row
    return log


def _summary(cfg: SimConfig, policy, profile: EngineProfile, stream,
             trace: AcceptanceTrace | None, calibration: CalibrationMap, log: RequestLog,
             ctx: SimContext, *, closed: bool, bounded_by, horizon: float,
             prefill: PrefillPool | None = None, steps: StepSeries | None = None) -> dict:
    """summary.json's fields: what ran, the engine's limits, the metrics (whole run and
    steady state) and, for a lossy policy, its quality cost."""
    gpus = cfg.deployment.replicas * profile.gpus_per_replica
    prefill_gpus = None if prefill is None else prefill.instances * profile.gpus_per_replica
    # Stability (unfinished requests, or requests in the system growing through the
    # steady window) and the steady-state figures come from the per-step series.
    summary = summarize(log, ctx.stats, gpus=gpus, prefill_gpus=prefill_gpus,
                        slo_ttft_ms=cfg.slo_ttft_ms, slo_tpot_ms=cfg.slo_tpot_ms,
                        steps=steps if steps is not None
                        else StepSeries.from_columns(ctx.steps.columns()), closed=closed)
    lim = ctx.limits
    summary |= {
        "max_num_seqs": lim.max_num_seqs,
        "max_num_batched_tokens": lim.max_num_batched_tokens,
        "kv_capacity_tokens": lim.kv_capacity_tokens,
        "max_model_len": lim.max_model_len,
        "prefill": lim.prefill,
        # the prefill instances' count, GPUs, load and queue (absent with chunked prefill)
        **({} if prefill is None else
           prefill.summary(summary["duration"], profile.gpus_per_replica)),
        # the prefix cache's hit rates and the prefill it saved (absent without one)
        **_prefix_summary(ctx, prefill, gpus, prefill_gpus),
        "gamma_max": ctx.gamma,
        "engine_limits_source": dict(lim.sources),
        "bounded_by": bounded_by,
        "horizon_s": horizon,
        "max_engine_steps": cfg.max_engine_steps,
    }
    summary = {
        "policy": policy.name,
        "policy_description": policy.description,
        # lossy: emitted tokens may differ from the target's (changed_tokens says how many);
        # never to be drawn or compared as lossless throughput
        "lossy": policy.lossy,
        "deployment": _deployment_text(cfg, profile, prefill, trace),
        "replicas": cfg.deployment.replicas,
        "gpus_per_replica": profile.gpus_per_replica,
        "profile": profile.name,
        "profile_kind": profile.kind,
        "workload": stream.description,
        "trace": None if trace is None else trace.source_path,
        "trace_drafter": None if trace is None else trace.meta.drafter,
        "trace_source": None if trace is None else trace.meta.source,
        "trace_gamma_max": None if trace is None else trace.gamma_max,
        # why this trace ran, when the profile chose it (absent otherwise: summaries of
        # runs on profiles without one stay as they were)
        **({"trace_chosen_by": f"profile {profile.name} default_trace"}
           if trace_from_profile(cfg, profile, trace) else {}),
        "calibration": calibration.source,
        **_preparation_summary(cfg, trace),
        **_drafter_summary(cfg, policy, trace),
        "seed": cfg.seed,
        **summary,
    }
    if policy.lossy:  # the quality cost, on its own axis (docs/lossy.md)
        labels = None if trace is None or trace.v2 is None else trace.v2.req_correct
        summary |= task_score(log.changed_tokens, ~np.isnan(log.finish_s), log.trace_row,
                              labels)
        steps = ctx.stats.request_steps
        summary["verifier_skipped_request_steps"] = ctx.stats.skipped_request_steps
        summary["num_unverified_tokens"] = ctx.stats.unverified_tokens
        summary["verifier_call_fraction"] = \
            1.0 - ctx.stats.skipped_request_steps / steps if steps else None
    return summary


def _prefix_summary(ctx: SimContext, prefill: PrefillPool | None, gpus: int,
                    prefill_gpus: int | None) -> dict:
    """The prefix cache's figures, over the GPUs that prefill (the prefill instances',
    else the replicas'); empty for a run without one."""
    if ctx.prefix_blocks is None:
        return {}
    if prefill is not None and prefill.cache is not None:
        return prefix_summary([prefill.cache], prefill_gpus)
    return prefix_summary(ctx.caches(), gpus)


def _drafter_summary(cfg: SimConfig, policy: Policy, trace: AcceptanceTrace | None) -> dict:
    """Where the policy's confidences came from (``confidences``: None when it reads
    none) and whether the measured drafter can run the policy in a serving engine
    (``engine_can_run``, ``engine_note``): a policy it cannot run is still simulated,
    and labelled so."""
    reads = policy.reads.survival and trace is not None
    given = None if cfg.conf_source is None else parse_conf_source(cfg.conf_source)
    own = trace is not None and trace.conf is not None and (given is None
                                                              or given.kind == "trace")
    if not reads:
        source = None
    elif own:
        source = "trace (the drafter's own)"
    else:
        source = f"{given.text} (--conf-source: assumed, not the drafter's)"
    if trace is None:
        return {"confidences": source, "engine_can_run": True, "engine_note": None}
    ok, note = engine_support(policy, drafter=trace.meta.drafter, confidence_head=own,
                              proposes_everywhere=trace.draft_tokens is None)
    return {"confidences": source, "engine_can_run": ok, "engine_note": note}


def _preparation_summary(cfg: SimConfig, trace: AcceptanceTrace | None) -> dict:
    """The confidence source with its measured ECE and AUC, and the extrapolated
    positions, each only when the run asks for it (absent otherwise: summaries of runs
    without them stay as they were). None where the run replays no trace or the trace
    has no confidences to measure."""
    out: dict = {}
    gen = {} if trace is None else trace.meta.generator
    if cfg.conf_source is not None:
        rec = gen.get(CONF_RECORD) or {}
        out |= {"conf_source": parse_conf_source(cfg.conf_source).text,
                "conf_source_ece": rec.get("ece"), "conf_source_auc": rec.get("auc")}
    if cfg.extrapolate_gamma is not None:
        out["trace_extrapolation"] = (gen.get(EXTEND_RECORD) or {}).get("text")
    return out


def _inputs(cfg: RunInputs | SimConfig, **given) -> RunInputs:
    """``cfg`` when prepared already (then nothing may be given beside it), else
    :func:`prepare`'s record of it with ``given``."""
    if not isinstance(cfg, RunInputs):
        return prepare(cfg, **given)
    extra = [k for k, v in given.items() if v is not None]
    if extra:
        raise TypeError(f"simulate: {', '.join(extra)} given beside prepared RunInputs: "
                        "give them to prepare()")
    return cfg


def _loaded(value, cls: type, load, what: str):
    """``value`` as a ``cls``: a name or path is loaded; anything else was an
    AttributeError traceback deep in the engine ('str' object has no attribute 'limits')."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str | Path):
        return load(value)
    raise TypeError(f"simulate: {what} must be a {cls.__name__} object, a built-in name or a "
                    f"path, got {type(value).__name__}")


def simulate(cfg: RunInputs | SimConfig, *,
             profile: EngineProfile | str | Path | None = None,
             trace: AcceptanceTrace | str | Path | None = None,
             calibration: CalibrationMap | str | Path | None = None,
             trace_rows: np.ndarray | None = None,
             policy_profile: EngineProfile | str | Path | None = None,
             keep_steps: bool = False) -> SimResult:
    """Run one simulation of :func:`prepare`'s inputs, or of a config (prepared here with
    ``profile``/``trace``/``calibration``/``policy_profile``, each an object, a
    built-in name or a file path). ``trace_rows`` pins request ``i`` to trace row
    ``trace_rows[i]`` (validation replays each served request's own row); by default
    rows are drawn from the seeded generator. ``policy_profile`` is the table the
    scheduler's SPS curve comes from when it differs from the one the steps cost
    (``profile``): a real server's configured table, or a what-if on a stale one.
    ``keep_steps`` keeps the per-step series on the result (``SimResult.steps``) for a
    run held in memory."""
    inputs = _inputs(cfg, profile=profile, trace=trace, calibration=calibration,
                     policy_profile=policy_profile)
    cfg, policy, profile, trace, calibration, policy_profile = (
        inputs.cfg, inputs.policy, inputs.profile, inputs.trace, inputs.calibration,
        inputs.policy_profile)
    drawn = _drawn_in_chunks(cfg, trace, trace_rows, profile)
    if drawn is not None:
        return _simulate_streamed(cfg, policy, profile, trace, calibration, policy_profile,
                                  drawn.chunks, drawn.size, drawn.last_arrival_s,
                                  drawn.description)
    rng = np.random.default_rng(cfg.seed)
    stream, trace_row = _request_log(cfg, rng, trace, trace_rows, profile)
    if stream.size > STREAM_ABOVE:  # a workload file's, or rows the caller pinned
        if resolve_blocks(cfg.engine.prefix_cache, cfg.engine.prefix_block_tokens,
                          stream.reuse) is not None:
            raise InputError("--prefix-cache", f"a run of more than {STREAM_ABOVE:,} "
                             "requests streams them, and a streamed run has no prefix "
                             "cache: give --prefix-cache off or fewer requests")
        last = float(stream.arrival_s[-1]) if stream.size else 0.0
        return _simulate_streamed(cfg, policy, profile, trace, calibration, policy_profile,
                                  partial(sliced, stream, trace_row, STREAM_CHUNK), stream.size,
                                  last,
                                  stream.description)
    run = run_in_memory(cfg, policy, profile, trace, calibration, policy_profile, stream,
                        trace_row)
    return finish_run(run, run.ctx.steps.columns(), keep_steps=keep_steps)


@dataclass(frozen=True, eq=False)
class RunInputs:
    """Everything one run reads, loaded once and checked to fit together
    (:func:`prepare`): the validated config, its policy, the profile the steps cost, the
    trace as the run replays it (None: the policy replays none), the calibration map and
    the scheduler's profile (None: the steps' own). :func:`simulate` and the sharded
    runner (``sim.shard``) take it whole, so nothing downstream re-checks it."""

    cfg: SimConfig
    policy: Policy
    profile: EngineProfile
    trace: AcceptanceTrace | None
    calibration: CalibrationMap
    policy_profile: EngineProfile | None = None


def prepare(cfg: SimConfig, *, profile: EngineProfile | str | Path | None = None,
            trace: AcceptanceTrace | str | Path | None = None,
            calibration: CalibrationMap | str | Path | None = None,
            policy_profile: EngineProfile | str | Path | None = None,
            grid_point: bool = False) -> RunInputs:
    """The run of ``cfg`` ready to simulate: the policy built once, every input loaded
    (given objects kept, names and paths loaded as ``--profile``/``--trace``/... load
    them, missing ones resolved) and every check of fit between policy, trace and
    settings made here, for every caller alike (``run``, a config file, ``sweep``,
    :func:`simulate`): an input the policy never reads (:func:`check_inputs_read`), the
    trace's columns and schema-v2 fields, the draft length (:func:`check_fit`).
    ``grid_point``: ``cfg`` is a sweep's point, whose named inputs the sweep held
    against all its policies (``sweep.check_grid``: a ``none`` point shares the grid's
    ``--traces``)."""
    if not isinstance(cfg, SimConfig):
        raise TypeError(f"simulate: cfg must be a SimConfig (sim.config.preset(name) or "
                        f"load_config(path)), got {type(cfg).__name__}")
    profile = _loaded(profile, EngineProfile, load_profile, "profile")
    policy_profile = _loaded(policy_profile, EngineProfile, load_profile, "policy_profile")
    trace = _loaded(trace, AcceptanceTrace, load_trace, "trace")
    calibration = _loaded(calibration, CalibrationMap, load_calibration, "calibration")
    cfg = cfg.validate()
    policy = get_policy(cfg.policy)
    if not grid_point:
        check_inputs_read(cfg, [policy])
    profile = profile or load_profile(cfg.deployment.profile)
    cfg = with_replicas(cfg, profile)
    trace = resolve_trace(cfg, policy, profile) if trace is None else prepare_trace(cfg, trace)
    check_fit(cfg, policy, trace)
    if calibration is None:
        calibration = resolve_calibration(cfg, trace)
    return RunInputs(cfg, policy, profile, trace, calibration, policy_profile)


def check_fit(cfg: SimConfig, policy: Policy, trace: AcceptanceTrace | None) -> None:
    """``policy`` can replay ``trace`` under ``cfg``: the trace has the columns the policy
    reads (confidences, schema-v2 fields), and the policy's draft length fits what the
    drafter drafts (``--gamma-max`` for the block drafter, else the trace's)."""
    require_trace_columns(trace, policy)
    check_draft_length(policy, trace, cfg.gamma_max if policy.drafts_block else None)
    check_policy_fields(policy, trace)


def check_policy_fields(policy: Policy, trace: AcceptanceTrace | None) -> None:
    """A policy that reads schema-v2 fields (trees, lossy) fails up front, naming them,
    on a trace that lacks them; a run that drafts nothing reads none."""
    fields = policy.reads.fields
    if not fields or trace is None or not policy.speculates or not trace.gamma_max:
        return
    missing = [f for f in fields
               if trace.v2 is None or getattr(trace.v2, f, None) is None]
    if missing:
        raise InputError(trace.source_path, f"policy {policy.name} needs the trace's "
                         f"{', '.join(missing)} (schema v2); this trace has none")


@dataclass(eq=False)
class InMemoryRun:
    """A finished in-memory run, before its summary: what :func:`finish_run` reads."""

    cfg: SimConfig
    policy: Policy
    profile: EngineProfile
    trace: AcceptanceTrace | None
    calibration: CalibrationMap
    policy_profile: EngineProfile | None
    stream: object
    log: RequestLog
    ctx: SimContext
    prefill: PrefillPool | None
    closed: bool
    horizon: float
    bounded_by: object


def run_in_memory(cfg: SimConfig, policy: Policy, profile: EngineProfile,
                  trace: AcceptanceTrace | None, calibration: CalibrationMap,
                  policy_profile: EngineProfile | None, stream, trace_row: np.ndarray,
                  replicas: tuple[int, ...] | None = None) -> InMemoryRun:
    """Run every request in memory. ``replicas``: step only these replicas (the others
    are routed to and never run: ``sim.shard`` simulates replica groups apart and merges
    them; the arrivals and prefill instances run whole in every group); ``()``: build the
    run and run nothing (the merge's frame)."""
    blocks = resolve_blocks(cfg.engine.prefix_cache, cfg.engine.prefix_block_tokens,
                            stream.reuse)
    # the pass ahead has no prefix cache and no sessions (their turns wait on the engine)
    ahead = compiled.NUMBA and cfg.workload.arrival != "closed" and blocks is None \
        and stream.sessions is None
    while True:
        log = _in_memory_log(stream, trace_row)
        ctx, finishes = _context(cfg, profile, policy, trace, calibration, log,
                                 policy_profile)
        rows = request_rows(stream.prompt_tokens, stream.output_tokens, trace, log.trace_row,
                            disaggregated=ctx.limits.prefill == "disaggregated")
        ctx.set_rows(rows)
        log.rejected[:] = rejections(rows, ctx)
        # an open loop's prefill instances are computed ahead of the run (``sim.ahead``)
        prefill = _prefill_pool(cfg, ctx, profile, stream.prompt_tokens, serve=not ahead)
        if blocks is not None:
            _cache_prefixes(ctx, prefill, blocks)
        if replicas == ():  # what a merge of replica groups summarises over: nothing runs
            return InMemoryRun(cfg, policy, profile, trace, calibration, policy_profile,
                               stream, log, ctx, prefill, cfg.workload.arrival == "closed",
                               0.0, None)
        try:
            closed, horizon, bounded_by = _run(cfg, ctx, finishes, prefill, stream.size,
                                               stream.arrival_s, replicas=replicas,
                                               ahead=ahead, sessions=stream.sessions)
        except NotAhead:
            if not ahead:
                raise
            ahead = False  # two events at one instant: run it again as SimPy processes
            continue
        return InMemoryRun(cfg, policy, profile, trace, calibration, policy_profile, stream,
                           log, ctx, prefill, closed, horizon, bounded_by)


def finish_run(run: InMemoryRun, step_columns: dict, *, keep_steps: bool = False
               ) -> SimResult:
    """The run's result: the summary over its log, stats and per-step series (kept on
    the result with ``keep_steps``)."""
    log = run.log
    bounded_by = run.bounded_by
    if not int((np.isnan(log.finish_s) & (log.rejected == 0)).sum()):
        bounded_by = None  # the bound was reached, but nothing was cut short
    steps = StepSeries.from_columns(step_columns)
    summary = _summary(run.cfg, run.policy, run.profile, run.stream, run.trace,
                       run.calibration, log, run.ctx, closed=run.closed,
                       bounded_by=bounded_by, horizon=run.horizon, prefill=run.prefill,
                       steps=steps)
    if run.policy_profile is not None and run.policy_profile is not run.profile:
        # the scheduler's table, when given apart from the cost's: without it two runs'
        # outputs could not be told apart (absent otherwise: summaries stay as they were)
        summary["policy_profile"] = run.policy_profile.name
    return SimResult(run.cfg, jsonable(summary), partial(requests_frame, log),
                     steps=steps if keep_steps else None)


# Runs of more requests than this stream their per-request rows and step series to
# parquet parts (sim.stream): STREAM_CHUNKS chunks of STREAM_CHUNK requests in memory at
# once (~200 MB), whatever the request count. At or below it a run keeps every request
# in memory, as it always has (the same summary either way: tests/sim/test_streaming.py).
STREAM_ABOVE = 1_000_000
STREAM_CHUNK = 1 << 17
STREAM_CHUNKS = 8


# A streamed run left at the default step bound (sized for runs of up to 1,000,000
# requests: 5 steps a request) keeps that allowance per request, up to the limit: the
# default deployment takes ~0.7 steps a request, so a day at 200 req/s (17.3 M requests,
# ~12 M steps) would stop at 5 M steps, 10 simulated hours in. The summary's
# max_engine_steps states the bound the run had.
STREAMED_STEPS_PER_REQUEST = 5


def _streamed_step_bound(cfg: SimConfig, n: int) -> SimConfig:
    default = SimConfig().max_engine_steps
    if cfg.max_engine_steps != default:
        return cfg
    return replace(cfg, max_engine_steps=min(MAX_ENGINE_STEPS,
                                             max(default, STREAMED_STEPS_PER_REQUEST * n)))


def _simulate_streamed(cfg: SimConfig, policy: Policy, profile: EngineProfile,
                       trace: AcceptanceTrace | None, calibration: CalibrationMap,
                       policy_profile: EngineProfile | None,
                       chunks: Callable[[], Iterator[StreamChunk]], n: int,
                       last_arrival_s: float, description: str) -> SimResult:
    """:func:`simulate` for a run above ``STREAM_ABOVE`` requests: the same engine and
    sources over a window of request slots fed ``chunks()`` (the stream's ``n``
    requests in ``STREAM_CHUNK`` chunks, the same each call), the outputs spilled in
    chunks."""
    cfg = _streamed_step_bound(cfg, n)
    # an open loop's prefill instances are computed ahead, a chunk at a time
    # (``sim.ahead.StreamedHandoffs``); where that cannot be exact, the run is simulated
    # again with them as SimPy processes
    ahead = compiled.NUMBA and cfg.workload.arrival != "closed"
    while True:
        spill = SpillFolder(lossy=policy.lossy)
        try:
            log = RequestLog.empty(RequestWindow.slots(n, STREAM_CHUNK, STREAM_CHUNKS))
            ctx, finishes = _context(cfg, profile, policy, trace, calibration, log,
                                     policy_profile)
            disaggregated = ctx.limits.prefill == "disaggregated"
            ctx.set_rows(np.zeros((len(log.arrival_s), NUM_COLUMNS), np.int64))
            requests = chunks()
            if ahead and disaggregated:  # the front end reads the chunks ahead of the window
                requests = ChunkTee(requests)
            window = RequestWindow(ctx, requests, n, last_arrival_s, spill, rejections,
                                   chunk=STREAM_CHUNK, chunks=STREAM_CHUNKS,
                                   disaggregated=disaggregated)
            del requests  # the window holds the stream's chunks, and lets each go
            # over the slots' prompts (the window refills them with each chunk)
            prefill = _prefill_pool(cfg, ctx, profile, log.prompt_tokens, serve=not ahead)
            if prefill is not None:
                window.attach(prefill)
            try:
                closed, horizon, bounded_by = _run(cfg, ctx, finishes, prefill, n, None,
                                                   window, ahead=ahead)
            except NotAhead:
                if not ahead:
                    raise
                spill.close()
                ahead = False  # two events at one instant: run it again as SimPy processes
                continue
            window.finish()
            # requests.parquet is sunk from the parts on the other core while the summary
            # is computed (``SimResult.write`` places the file)
            spill.sink_requests()
            # the window's memory goes before the kept columns are joined for the summary:
            # the event loop's processes (the sources, the replicas) hold the log and slots
            del window, log
            finishes.source = None
            ctx.log = ctx.rows = ctx.admit_need = ctx.request_state = None
            ctx.env = ctx.stop = ctx.handoffs = None
            ctx.replicas = []
            if prefill is not None:
                prefill.env = None
            gc.collect()
            stream = RequestStream(np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64),
                                   description)  # what the summary reads of it
            full = spill.kept_log()
            if not int((np.isnan(full.finish_s) & (full.rejected == 0)).sum()) \
                    and bounded_by != "window":
                bounded_by = None  # the bound was reached, but nothing was cut short
            if prefill is not None:
                prefill = spill.kept_prefill(prefill)
            summary = _summary(cfg, policy, profile, stream, trace, calibration, full, ctx,
                               closed=closed, bounded_by=bounded_by, horizon=horizon,
                               prefill=prefill, steps=spill.kept_steps())
            del full
            if policy_profile is not None and policy_profile is not profile:
                summary["policy_profile"] = policy_profile.name
            result = SimResult(cfg, jsonable(summary), spill.requests(),
                               requests_file=spill.write_requests_file)
        except BaseException:
            spill.close()
            raise
        weakref.finalize(result, spill.close)  # the parts live as long as the result
        return result


class _Finishes:
    """The engine's finish callback, handed on to the arrival source once it exists (the
    source is built over the context the callback is given to)."""

    source: OpenLoop | ClosedLoop | None = None

    def __call__(self, k: int) -> None:
        self.source.on_finish(k)


def _context(cfg: SimConfig, profile: EngineProfile, policy: Policy,
             trace: AcceptanceTrace | None, calibration: CalibrationMap, log: RequestLog,
             policy_profile: EngineProfile | None) -> tuple[SimContext, _Finishes]:
    finishes = _Finishes()
    return SimContext(cfg, profile, policy, trace, calibration, log, finishes,
                      policy_profile=policy_profile), finishes


def _run(cfg: SimConfig, ctx: SimContext, finishes: _Finishes, prefill: PrefillPool | None,
         n: int, arrival_s: np.ndarray | None, window=None,
         replicas: tuple[int, ...] | None = None,
         ahead: bool = False, sessions: SessionPlan | None = None) -> tuple[bool, float, object]:
    """Start the replicas (those in ``replicas``; None: all) and the arrival source (open
    or closed loop, over ``window``'s slots when the run streams), run until the step
    bound or the horizon, and record the progress of requests still running or waiting.
    ``ahead``: an open loop with prefill instances has them computed ahead (the pool was
    built without its processes); raises :class:`NotAhead` where that cannot be exact.
    Returns (closed loop, horizon, what bounded the run)."""
    env = ctx.env
    router = Router(ctx.replicas, cfg.deployment.router)
    stepping = [rep for rep in ctx.replicas if replicas is None or rep.index in replicas]
    for rep in stepping:
        env.process(rep.run())
    frontend_s = ctx.profile.frontend_s_per_request
    closed = cfg.workload.arrival == "closed"
    handoffs = None
    if sessions is not None:  # turns sent as earlier turns end: bounded like a closed loop
        finishes.source = SessionLoop(env, router, ctx.log, sessions, prefill, frontend_s)
        ctx.on_finished = finishes.source.finished
        horizon = CLOSED_LOOP_HORIZON_S
    elif closed:
        finishes.source = ClosedLoop(env, router, ctx.log, n, cfg.workload.max_concurrency,
                                     prefill, frontend_s, window=window)
        horizon = CLOSED_LOOP_HORIZON_S
    elif ahead and prefill is not None:
        finishes.source = ctx.handoffs = handoffs = Handoffs(
            env, router, ctx.log, arrival_s, prefill, frontend_s, stepping) \
            if window is None else StreamedHandoffs(
            env, router, ctx.log, window, prefill, frontend_s, stepping)
        horizon = finishes.source.last_arrival_s + cfg.drain_timeout_s
    else:
        finishes.source = OpenLoop(env, router, ctx.log, arrival_s, prefill, frontend_s,
                                   window=window)
        horizon = finishes.source.last_arrival_s + cfg.drain_timeout_s
    env.process(_alarm(env, ctx.stop, horizon))
    bounded_by = env.run(until=ctx.stop)
    if handoffs is not None:
        handoffs.finish()
    for rep in ctx.replicas:  # requests still running or waiting keep their progress
        rep.flush()
    return closed, horizon, bounded_by


def _cache_prefixes(ctx: SimContext, prefill: PrefillPool | None,
                    blocks: PromptBlocks) -> None:
    """Prefix caching on: each replica's cache, or with disaggregated prefill the prefill
    instances' one cache over their KV (each instance the replica's capacity)."""
    ctx.set_prefix_blocks(blocks)
    if prefill is not None:
        prefill.cache = PrefixCache(blocks)
        prefill.cache_tokens = prefill.instances * ctx.kv_capacity
    # each request's hits, whichever cache served it (requests.parquet's column)
    ctx.log.cached_prompt_tokens = np.zeros(ctx.log.arrival_s.size, np.int64)
    for cache in [*ctx.caches(), *([] if prefill is None else [prefill.cache])]:
        cache.request_hit_tokens = ctx.log.cached_prompt_tokens


def _prefill_pool(cfg: SimConfig, ctx: SimContext, profile: EngineProfile,
                  prompt_tokens: np.ndarray, serve: bool = True) -> PrefillPool | None:
    """The prefill instances of a disaggregated run (the decode replica's token budget
    per step), or None with chunked prefill (a count given for it is refused where the
    config is resolved, ``config.resolve_config``)."""
    if ctx.limits.prefill != "disaggregated":
        return None
    return PrefillPool(ctx.env, profile, cfg.deployment.prefill_instances,
                       ctx.max_num_batched_tokens, prompt_tokens, serve=serve)


# A closed loop has no arrival window: it runs until its requests are done, bounded by
# the step bound and this much simulated time (11.6 days; the clock keeps ns resolution).
CLOSED_LOOP_HORIZON_S = 1e6


def rejections(rows: np.ndarray, ctx: SimContext) -> np.ndarray:
    """Reason code per request (0: servable) for requests that can never be served, as
    vLLM refuses a prompt + max_tokens beyond max_model_len: longer than the model
    length, or needing more KV than a replica has (prompt + output, plus the verify slots
    a running request commits in preempt mode). Refused at arrival, counted with the
    reason, never lost from the accounting."""
    total = rows[:, PROMPT_TOKENS] + rows[:, OUTPUT_TOKENS]
    need = total if ctx.reserve else total + ctx.verify_slots
    code = np.zeros(len(rows), np.int8)
    code[need > ctx.kv_capacity] = 2
    if ctx.limits.max_model_len is not None:
        code[total > ctx.limits.max_model_len] = 1
    return code


def _alarm(env, stop, at_s: float):
    """Trigger ``stop`` at the time horizon (unless the step bound did first)."""
    yield env.timeout(at_s)
    if not stop.triggered:
        stop.succeed("time")


__all__ = ["RunInputs", "SimResult", "prepare", "simulate", "replace"]
