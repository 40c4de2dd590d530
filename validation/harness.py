"""``validate``: hold the simulator against a real speculative-decoding serving run.

For every (policy, request rate) point:

1. **real run** -- :class:`dspark_sim.validation.server.SpecServer` serves a Poisson workload
   (held-out prompts of the project's prompt sets, ``max_new_tokens`` output tokens each,
   EOS ignored) on the target (default: SmolLM2-135M on CPU) with a drafter (``auto``: the
   shipped trained ``dspark`` checkpoint when present, else the training-free ``lookup``
   drafter). Its per-request log and step statistics are summarised by
   :func:`dspark_sim.sim.metrics.summarize`, the simulator's own code;
2. **simulation** of the *same* workload: the arrival times and lengths are written as a
   Mooncake JSONL file and replayed (``WorkloadConfig(arrival="replay")``), with the
   engine profile calibrated on this machine and the acceptance trace of the same target
   and drafter. Two variants:

   * ``sim``: :func:`dspark_sim.sim.api.simulate` itself (trace rows drawn at random per
     request, as in every simulation), averaged over ``sim_seeds`` seeds;
   * ``paired``: the same engine with request ``i`` replaying trace row ``i`` (its own
     acceptance sequence), which removes acceptance sampling noise and isolates the
     step-time model;

3. a table of measured vs simulated output throughput, median/p90 TPOT, median TTFT,
   tau and mean verify tokens per request step, with relative errors, plus a per-step
   check of the cost model (measured step time vs ``draft + target(B) + kv * KV +
   logits * rows + attn * query_ctx`` of the profile, split into decode-only and prefill
   steps).

Profiles (``ValidationSetup.profiles``): ``"auto"`` uses the built-in ``smollm2-cpu``
when shipped, else measures one *engine-in-the-loop*
(:mod:`dspark_sim.validation.server_profile`) immediately before the runs (a shared CPU
drifts); ``"measure"`` forces that; ``"insitu"`` rescales the first real profile to the
other points' serving steps; anything else is a profile name/path.

Traces: ``lookup`` -- exact, from the served sequences themselves (the lookup draft at
every output position depends only on the tokens); learned drafters -- drafted on the
served sequences the way :mod:`dspark_sim.traces.capture` records a trace.

:func:`validate` runs the phases in order: :func:`_start_server` (load the models),
:func:`_resolve_profiles`, :func:`_real_runs`, then :func:`_simulate_point` per point and
:func:`_write_comparison`. Everything torch-side is imported lazily:
``import dspark_sim.validation.harness`` needs no torch.

Everything torch-side is imported lazily: ``import dspark_sim.validation.harness`` needs no torch.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import platform
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from dspark_sim.calibration.confmap import CalibrationMap, load_calibration
from dspark_sim.calibration.profile import EngineProfile, builtin_profiles, load_profile
from dspark_sim.errors import InputError, check_positive_int
from dspark_sim.io import (
    check_writable,
    jsonable,
    write_json_atomic,
    write_text_atomic,
)
from dspark_sim.policies.registry import get_policy
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import DeploymentConfig, EngineConfig, SimConfig, WorkloadConfig
from dspark_sim.sim.metrics import requests_frame, summarize
from dspark_sim.sim.outputs import write_run, write_unit
from dspark_sim.sim.workload import build_stream
from dspark_sim.traces.schema import AcceptanceTrace, TraceMeta, trace_from_frame

METRICS = (
    ("output_throughput", "output tok/s"),
    ("median_tpot_ms", "median TPOT ms"),
    ("p90_tpot_ms", "p90 TPOT ms"),
    ("median_ttft_ms", "median TTFT ms"),
    ("spec_decode_acceptance_length", "tau"),
    ("mean_verify_tokens_per_request_step", "verify tok/req/step"),
)
DEFAULT_POLICIES = ("mtp1", "fixed:3", "confidence")
DEFAULT_RATES = (0.25, 0.6)
# Generous caps, so a typo fails in a second instead of serving for days (the defaults
# take ~9 min on the CPU target: ~1.5 min per policy x rate point of 10 requests)
MAX_REQUESTS = 1_000  # per point; at 0.25 req/s the arrivals alone span ~67 min
MAX_RATES = 16  # each rate is one real run per policy
# req/s: below, a wall clock sleeps ~100 s per request between arrivals; far above, every
# request arrives at once anyway
RATE_RANGE = (0.01, 1000.0)
MAX_SIM_SEEDS = 100  # one simulation per seed, point and profile
SHIPPED_PROFILE = "smollm2-cpu"
INSITU = "insitu"  # profile spec: rescaled on the other points' real steps (leave-one-point-out)
INSITU_SELF = "insitu-self"  # diagnostic: rescaled on the point's *own* steps (level known)
_INSITU = (INSITU, INSITU_SELF)
@dataclass(frozen=True)
class Workload:
    arrival_s: np.ndarray
    prompts: list[list[int]]
    output_tokens: np.ndarray
    domains: list[str]
    rate: float

    @property
    def prompt_tokens(self) -> np.ndarray:
        return np.array([len(p) for p in self.prompts], dtype=np.int64)


# -- workloads ------------------------------------------------------------------------------


def prompt_pool(target: Any, num: int, max_prompt_tokens: int = 128, seed: int = 0,
                vocab: int | None = None) -> tuple[list[list[int]], list[str]]:
    """``num`` held-out prompts (math/code/chat round-robin) tokenised with the target's
    chat template; without a prompt set (or tokenizer) random token prompts."""
    try:
        from dspark_sim.traces.targets import load_prompts, select_prompts

        if getattr(target, "tokenizer", None) is None:
            raise InputError("prompts", "target has no tokenizer")
        per = max(1, math.ceil(num / 3))
        chosen = select_prompts(load_prompts(), "heldout", per)
        by_dom: dict[str, list] = {}
        for p in chosen:
            by_dom.setdefault(p.domain, []).append(p)
        mixed = [q for group in zip(*by_dom.values(), strict=False) for q in group][:num]
        if len(mixed) < num:
            raise InputError("prompts", "not enough held-out prompts")
        return ([target.encode_prompt(list(p.turns), max_prompt_tokens) for p in mixed],
                [p.domain for p in mixed])
    except InputError:
        rng = np.random.default_rng(seed)
        v = int(vocab or 256)
        out = []
        for _ in range(num):  # a repeated motif, so that n-gram lookup finds something
            motif = rng.integers(0, v, size=int(rng.integers(4, 12))).tolist()
            out.append((motif * (max_prompt_tokens // len(motif) + 1))[: int(
                rng.integers(max_prompt_tokens // 2, max_prompt_tokens + 1))])
        return out, ["random"] * num


def poisson_workload(prompts: list[list[int]], domains: list[str], rate: float,
                     max_new_tokens: int, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    n = len(prompts)
    arr = np.cumsum(rng.exponential(1.0 / rate, size=n))
    arr -= arr[0]
    return Workload(arr, prompts, np.full(n, int(max_new_tokens), np.int64), domains, rate)


def write_mooncake(path: str | Path, w: Workload) -> Path:
    """The workload as Mooncake JSONL (timestamp ms, input_length, output_length)."""
    lines = [json.dumps({"timestamp": float(t) * 1e3, "input_length": int(p),
                         "output_length": int(o)})
             for t, p, o in zip(w.arrival_s, w.prompt_tokens, w.output_tokens, strict=True)]
    return write_text_atomic(path, "\n".join(lines) + "\n")


# -- traces ------------------------------------------------------------------------------------


def lookup_trace(prompts: list[list[int]], outputs: list[list[int]], domains: list[str],
                 gamma: int, target_name: str, max_ngram: int = 3) -> AcceptanceTrace:
    """The lookup drafter's exact trace on the served sequences (row ``i`` = request ``i``)."""
    from dspark_sim.validation.server import lookup_accept_lengths

    rows = []
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        m, conf = lookup_accept_lengths(list(p) + list(o), len(p), gamma, max_ngram)
        rows.append(pl.DataFrame({
            "request_id": np.full(len(m), i, np.int32),
            "domain": [domains[i]] * len(m),
            "position": np.arange(len(m), dtype=np.int32),
            "accept_len": m.astype(np.int8),
            "conf": pl.Series("conf", conf.astype(np.float32), dtype=pl.Array(pl.Float32, gamma)),
        }))
    meta = TraceMeta(drafter="lookup", target=target_name, gamma_max=gamma, source="captured",
                     temperature=0.0,
                     generator={"tool": "dspark_sim.validation.harness", "from": "served sequences"})
    return trace_from_frame(pl.concat(rows), meta, "validate-lookup")


def learned_trace(target: Any, drafter: Any, prompts: list[list[int]], outputs: list[list[int]],
                  domains: list[str], gamma: int, kind: str, chunk: int = 4) -> AcceptanceTrace:
    """A learned drafter's trace on the served sequences, the way
    :mod:`dspark_sim.traces.capture` records one: a clean target forward over
    prompt + output gives the features, the drafter drafts ``gamma`` tokens at every
    output position, :func:`dspark_sim.traces.capture.draft_rows` verifies them."""
    import torch

    from dspark_sim.traces.capture import draft_rows, records_frame
    from dspark_sim.traces.drafters import SequenceStore, Shared

    layers = list(drafter.cfg.feature_layers) + [target.num_layers]
    shared = Shared.of(target)
    frames = []
    for lo in range(0, len(prompts), chunk):
        recs = [{"prompt": torch.tensor(p), "tokens": torch.tensor(o)}
                for p, o in zip(prompts[lo : lo + chunk], outputs[lo : lo + chunk], strict=True)]
        with torch.inference_mode():
            target._hidden_for(recs, layers)
        store = SequenceStore.from_records(recs)
        with torch.inference_mode():
            rows = draft_rows(drafter, store, shared, gamma, max(len(o) for o in outputs))
        frames.append(records_frame(rows, range(lo, lo + len(recs)),
                                    domains[lo : lo + len(recs)], gamma))
    meta = TraceMeta(drafter=kind, target=target.name, gamma_max=gamma, source="captured",
                     temperature=0.0,
                     generator={"tool": "dspark_sim.validation.harness", "from": "served sequences"})
    return trace_from_frame(pl.concat(frames), meta, f"validate-{kind}")


# -- simulation -----------------------------------------------------------------------------------


def sim_config(workload_path: Path, policy: str, engine: EngineConfig, profile_path: str,
               n: int, seed: int = 0, calibration: str | None = None) -> SimConfig:
    return SimConfig(
        engine=engine,
        deployment=DeploymentConfig(replicas=1, router="round-robin", profile=profile_path),
        workload=WorkloadConfig(arrival="replay", workload_path=str(workload_path),
                                num_requests=n),
        policy=policy, seed=seed, drain_timeout_s=1e6, calibration=calibration,
    )


def simulate_paired(cfg: SimConfig, profile: EngineProfile, trace: AcceptanceTrace,
                    calibration: CalibrationMap | None = None,
                    policy_profile: EngineProfile | None = None) -> dict:
    """The simulator's engine on a replayed workload with request ``i`` replaying trace row
    ``i`` (no random row assignment). Same engine code as :func:`simulate`."""
    n = build_stream(cfg.workload, np.random.default_rng(cfg.seed)).size
    res = simulate(cfg, profile=profile, trace=trace,
                   calibration=calibration or load_calibration(cfg.calibration),
                   trace_rows=np.arange(n) % trace.num_requests, policy_profile=policy_profile)
    return res.summary


def _mean_summaries(summaries: list[dict]) -> dict:
    out = dict(summaries[0])
    for key, _ in METRICS + (("mean_step_ms", ""), ("engine_steps", ""), ("duration", "")):
        vals = [s.get(key) for s in summaries]
        vals = [float(v) for v in vals if v is not None]
        out[key] = float(np.mean(vals)) if vals else None
    return out


# -- the comparison ------------------------------------------------------------------------------------


def _rel(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None or not math.isfinite(real) or real == 0:
        return None
    return float(sim) / float(real) - 1.0


def _f(v) -> float | None:
    return None if v is None else float(v)


@dataclass(frozen=True)
class ValidationSetup:
    """Everything a validation run takes: the one parameter list of :func:`validate` and
    of ``dspark-sim validate``. :meth:`check` finds bad values before any model loads.

    ``profiles``: one or several cost tables, each simulated; the first is the headline,
    the first that is not ``"insitu"``/``"insitu-self"`` gives the server's SPS curve (and
    every simulation's, via ``policy_profile``, so rows compare step-cost models under the
    same scheduler table): ``"auto"`` (built-in ``smollm2-cpu`` if shipped, else
    measured), ``"measure"`` (engine-in-the-loop,
    :func:`~dspark_sim.validation.server_profile.measure_server_profile`; ``save_profile``
    writes it), ``"insitu"`` (the first real profile rescaled to the *other* points' real
    steps, :func:`~dspark_sim.validation.server_profile.rescale_to_steps`:
    leave-one-point-out), ``"insitu-self"`` (a diagnostic: the point's own steps), a
    profile name/path or an :class:`EngineProfile`. ``target``: ``"smollm2"``, a path, a
    :class:`~dspark_sim.traces.targets.Target` or a ``(model, tokenizer)`` pair (tokenizer
    may be None: random prompts). ``drafter``: ``auto`` | ``lookup`` | a shipped kind | a
    checkpoint directory.
    """

    policies: tuple[str, ...] = DEFAULT_POLICIES
    rates: tuple[float, ...] = DEFAULT_RATES
    num_requests: int = 10
    max_new_tokens: int = 128
    out_dir: Path = Path("runs/validate")
    device: str = "cpu"
    target: Any = "smollm2"
    drafter: str = "auto"
    profiles: tuple[Any, ...] = (INSITU, "measure", "auto")
    calibration: str | None = None
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    max_prompt_tokens: int = 128
    gamma_max: int = 7
    clock: str = "auto"
    num_threads: int | None = 1
    sim_seeds: int = 5
    seed: int = 0
    save_profile: Path | None = None

    def check(self) -> ValidationSetup:
        """Every argument, cheaply, before any model loads (a bad one fails in a second,
        not after minutes of loading). Returns ``self``."""
        from dspark_sim.traces.capture import MAX_NEW_TOKENS, check_drafter_spec
        from dspark_sim.traces.targets import check_device, check_target_spec
        from dspark_sim.validation.clock import CLOCKS

        if not self.policies:
            raise InputError("--policies", "name at least one policy")
        for p in self.policies:
            try:
                get_policy(p)
            except InputError as exc:  # the registry names run's --policy; the user typed this
                raise InputError("--policies", exc.problem) from None
        if not self.rates:
            raise InputError("--rates", "name at least one rate")
        if len(self.rates) > MAX_RATES:
            raise InputError("--rates", f"{len(self.rates):,} rates are above the limit of "
                                        f"{MAX_RATES} (each is a real run per policy)")
        lo, hi = RATE_RANGE
        for r in self.rates:
            if isinstance(r, bool) or not (isinstance(r, int | float) and math.isfinite(r)
                                           and r > 0):
                raise InputError("--rates", f"rates must be positive, got {r!r}")
            if not lo <= r <= hi:
                raise InputError("--rates", f"{r:g} req/s is outside the limits [{lo:g}, "
                                            f"{hi:g}]")
        for option, v, low, limit in (
                ("--num-requests", self.num_requests, 1, MAX_REQUESTS),
                ("--max-new-tokens", self.max_new_tokens, 2, MAX_NEW_TOKENS),
                ("--sim-seeds", self.sim_seeds, 1, MAX_SIM_SEEDS), ("--seed", self.seed, 0, None),
                ("--max-prompt-tokens", self.max_prompt_tokens, 1, None)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise InputError(option, f"must be an integer >= {low}, got {v!r}")
            if limit is not None:
                check_positive_int(option, v, limit)  # run's and sweep's caps say it alike
        if not 1 <= self.gamma_max <= 32:
            raise InputError("--gamma-max", f"must be in [1, 32], got {self.gamma_max}")
        if self.num_threads is not None and self.num_threads < 1:
            raise InputError("--num-threads", f"must be >= 1, got {self.num_threads}")
        if self.clock not in CLOCKS:
            raise InputError("--clock", f"must be one of {', '.join(CLOCKS)}, got {self.clock!r}")
        self.engine_config(1).validate()
        check_device(self.device)
        check_target_spec(self.target)
        if self.drafter != "auto":
            check_drafter_spec(self.drafter, self.gamma_max, option="--drafter")
        self._check_profiles()
        load_calibration(self.calibration)
        check_writable(self.out_dir, "--out")
        if self.save_profile is not None:
            check_writable(self.save_profile, "--save-profile", kind="file")
        return self

    def _check_profiles(self) -> None:
        if not self.profiles:
            raise InputError("--profile", "name at least one profile")
        real = [p for p in self.profiles if not (isinstance(p, str) and p in _INSITU)]
        if not real:
            raise InputError("--profile", "'insitu' needs another profile for the server's SPS")
        for p in real:
            if isinstance(p, str) and p not in ("auto", "measure"):
                load_profile(p)

    def engine_config(self, max_len: int) -> EngineConfig:
        """The server's (and the simulations') scheduler limits; KV for every slot at
        ``max_len`` tokens, reserved up front (nothing is ever preempted)."""
        return EngineConfig(max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            kv_capacity_tokens=self.max_num_seqs * max_len, kv_mode="reserve")


@dataclass(frozen=True)
class ValidationResult:
    """One row per (profile, policy, rate, metric): ``real``, ``sim`` (mean of
    ``sim_seeds`` :func:`simulate` runs), ``rel_error`` (sim / real - 1), ``paired`` and
    ``paired_rel_error`` (request ``i`` replays its own trace row)."""

    frame: pl.DataFrame
    out_dir: Path

    HEADLINE_METRICS = ("output_throughput", "median_tpot_ms")

    def table(self) -> str:
        return format_table(self.frame)

    def worst_error(self) -> float | None:
        """Largest |error| on output throughput and median TPOT under the first profile."""
        first = self.frame["profile"][0]
        key = self.frame.filter(pl.col("metric").is_in(self.HEADLINE_METRICS)
                                & (pl.col("profile") == first))
        return key["rel_error"].abs().max()

    def passed(self, tolerance: float = 0.10) -> bool:
        worst = self.worst_error()
        return worst is not None and worst <= tolerance

    def headline(self) -> str:
        return (f"worst |error| on output throughput / median TPOT: "
                f"{_fmt(self.worst_error(), True)} (target 10%); results in {self.out_dir}")


@dataclass
class _Rig:
    """The loaded models and the server they run in."""

    target: Any
    drafter: Any  # the drafter model (a Lookup or a learned drafter)
    kind: str  # the drafter's kind, the profiles' draft key
    runner: Any  # DraftRunner
    server: Any  # SpecServer
    prompts: list[list[int]]
    domains: list[str]
    engine: EngineConfig
    calibration: CalibrationMap
    clock: str


@dataclass
class _Profiles:
    """The profiles to simulate (``"insitu"`` specs stay strings, rescaled per point),
    the headline real profile (the server's SPS table) and where each was written."""

    specs: list[Any]
    headline: EngineProfile
    paths: list[Path | None]


@dataclass
class _RealRun:
    rate: float
    workload: Workload
    workload_path: Path
    policy: Any
    tag: str
    served: Any  # ServeResult
    summary: dict
    trace: AcceptanceTrace
    elapsed_s: float


def validate(setup: ValidationSetup | None = None, *, log=print, **options) -> ValidationResult:
    """Real serving runs vs simulations of the same workloads (see the module docstring).

    ``options`` override fields of ``setup`` (default :class:`ValidationSetup`). Writes
    under ``out_dir``: ``<policy>-r<rate>/{real,sim,paired}/summary.json`` (+
    ``requests.parquet`` for real/sim, ``steps.parquet`` for real),
    ``workload-r<rate>.jsonl``, the profiles used, ``comparison.parquet`` /
    ``comparison.csv`` and ``validation.json``."""
    import torch

    setup = replace(setup or ValidationSetup(), **options).check()
    log = log or (lambda _m: None)
    saved_threads = torch.get_num_threads()
    if setup.num_threads is not None and torch.device(setup.device).type == "cpu":
        torch.set_num_threads(int(setup.num_threads))
    out = Path(setup.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_begin = time.perf_counter()
    try:
        rig = _start_server(setup)
        profiles = _resolve_profiles(setup, rig, log)
        runs = _real_runs(setup, rig, log)
        rows: list[dict] = []
        points: list[dict] = []
        for ri in range(len(runs)):
            point_rows, point = _simulate_point(setup, rig, profiles, runs, ri, log)
            rows += point_rows
            points.append(point)
        df = pl.DataFrame(rows, schema={
            "profile": pl.Utf8, "policy": pl.Utf8, "rate": pl.Float64, "metric": pl.Utf8,
            "label": pl.Utf8, "real": pl.Float64, "sim": pl.Float64, "rel_error": pl.Float64,
            "paired": pl.Float64, "paired_rel_error": pl.Float64})
        _write_comparison(setup, rig, profiles, df, points, time.perf_counter() - t_begin)
        return ValidationResult(df, out)
    finally:
        torch.set_num_threads(saved_threads)


def _resolve_drafter(spec: str) -> str:
    """``auto``: the shipped trained ``dspark`` (else ``mtp1``) checkpoint, else lookup."""
    if spec != "auto":
        return spec
    from dspark_sim.traces.capture import SHIPPED_DRAFTERS

    for kind in ("dspark", "mtp1"):
        if (SHIPPED_DRAFTERS / kind / "drafter.safetensors").is_file():
            return kind
    return "lookup"


def _start_server(setup: ValidationSetup) -> _Rig:
    """Load the target and the drafter, pick the prompts, build the server."""
    import torch

    from dspark_sim.traces.capture import resolve_drafter_spec
    from dspark_sim.traces.drafters import Lookup, Shared, load_drafter
    from dspark_sim.traces.targets import load_target
    from dspark_sim.validation.clock import resolve_clock
    from dspark_sim.validation.server import DraftRunner, ServerConfig, SpecServer

    tgt = load_target(setup.target, device=setup.device)
    spec = _resolve_drafter(setup.drafter)
    if spec == "lookup":
        dmodel: Any = Lookup(max_ngram=3)
        shared, kind = None, "lookup"
    else:
        p = resolve_drafter_spec(spec)
        dmodel, info = load_drafter(p, tgt)
        dmodel.cfg.gamma = max(dmodel.cfg.gamma, setup.gamma_max)
        shared, kind = Shared.of(tgt), info.get("kind", Path(str(p)).name)
    runner = DraftRunner(dmodel, shared, kind)
    runner.gamma_max = setup.gamma_max
    prompts, domains = prompt_pool(tgt, setup.num_requests, setup.max_prompt_tokens, setup.seed,
                                   vocab=tgt.vocab_size)
    max_len = max(len(p) for p in prompts) + setup.max_new_tokens + setup.gamma_max + 2
    engine = setup.engine_config(max_len)
    calib = load_calibration(setup.calibration)
    server = SpecServer(tgt.model, runner, ServerConfig(engine, clock=setup.clock),
                        max_len=max(max_len, 256 + setup.gamma_max + 2,
                                    setup.max_num_batched_tokens + 1),
                        calibration=None if calib.is_identity else calib)
    clock = resolve_clock(setup.clock, server.engine.device.type, torch.get_num_threads())
    return _Rig(tgt, dmodel, kind, runner, server, prompts, domains, engine, calib, clock)


def _resolve_profiles(setup: ValidationSetup, rig: _Rig, log) -> _Profiles:
    """Load or measure every profile spec (measuring at most once), give each the
    drafter's cost when it lacks it, write them; the first real one drives the server."""
    from dspark_sim.validation.server_profile import measure_server_profile, with_draft

    measured: EngineProfile | None = None

    def measure() -> EngineProfile:
        nonlocal measured
        measured = measured or measure_server_profile(rig.server, clock=rig.clock, log=log)
        return measured

    specs: list[Any] = []
    for spec in setup.profiles:
        if isinstance(spec, str) and spec in _INSITU:
            if spec not in specs:
                specs.append(spec)
            continue
        if isinstance(spec, EngineProfile):
            p = spec
        elif spec == "auto" and SHIPPED_PROFILE in builtin_profiles():
            p = load_profile(SHIPPED_PROFILE)
        elif spec in ("auto", "measure"):
            p = measure()
        else:
            p = load_profile(spec)
        if rig.kind not in p.drafts:
            p = with_draft(p, rig.kind, measure())
        if all(isinstance(q, str) or q.name != p.name for q in specs):
            specs.append(p)
    headline = next(p for p in specs if not isinstance(p, str))
    rig.server.profile = headline
    out = Path(setup.out_dir)
    paths: list[Path | None] = []
    for i, p in enumerate(specs):
        paths.append(None if isinstance(p, str) else
                     write_text_atomic(out / f"profile-{i}-{p.name}.toml", p.to_toml()))
    if setup.save_profile is not None and measured is not None:
        write_text_atomic(setup.save_profile, measured.to_toml())
    return _Profiles(specs, headline, paths)


def _real_runs(setup: ValidationSetup, rig: _Rig, log) -> list[_RealRun]:
    """Serve every (rate, policy) point on the real server; record its summary, steps and
    the drafter's trace on the served sequences."""
    out = Path(setup.out_dir)
    traces: dict[tuple, AcceptanceTrace] = {}
    runs = []
    for rate in setup.rates:
        w = poisson_workload(rig.prompts, rig.domains, float(rate), setup.max_new_tokens,
                             setup.seed)
        wpath = write_mooncake(out / f"workload-r{rate:g}.jsonl", w)
        for spec in setup.policies:
            pol = get_policy(spec)
            tag = f"{pol.name.replace(':', '')}-r{rate:g}"
            t0 = time.perf_counter()
            res = rig.server.serve(w.prompts, list(w.output_tokens), list(w.arrival_s), pol)
            real = summarize(res.log, res.stats, gpus=1, slo_ttft_ms=None, slo_tpot_ms=None,
                             stable=True, queue_growth_per_s=0.0)
            real = jsonable({"policy": pol.name, "source": "real server", "clock": res.clock,
                             "drafter": rig.kind, "rate": float(rate), "wall_s": res.wall_s,
                             "cpu_s": res.cpu_s, **real})
            _write_run(out / tag / "real", real, requests_frame(res.log), steps=res.step_records)
            # greedy decoding is lossless, so every policy and rate serves the same tokens:
            # the trace of the same models on the same sequences is built once
            key = tuple(tuple(o) for o in res.outputs)
            if key not in traces:
                traces[key] = _served_trace(setup, rig, w, res.outputs)
            runs.append(_RealRun(float(rate), w, wpath, pol, tag, res, real, traces[key],
                                 time.perf_counter() - t0))
            log(f"[{pol.name} @ {rate:g} req/s] real run: {real['engine_steps']} steps, "
                f"{real['output_throughput']:.1f} tok/s, median TPOT "
                f"{real['median_tpot_ms']:.1f} ms ({res.wall_s:.0f} s wall)")
    return runs


def _served_trace(setup: ValidationSetup, rig: _Rig, w: Workload, outputs) -> AcceptanceTrace:
    if rig.kind == "lookup":
        return lookup_trace(w.prompts, outputs, w.domains, setup.gamma_max, rig.target.name,
                            rig.runner.max_ngram)
    return learned_trace(rig.target, rig.drafter, w.prompts, outputs, w.domains,
                         setup.gamma_max, rig.kind)


def _draft_gamma(policy: Any, gamma_max: int) -> int:
    return min(gamma_max, policy.draft_gamma if policy.draft_gamma is not None else gamma_max)


def _point_profile(setup: ValidationSetup, rig: _Rig, profiles: _Profiles, runs: list[_RealRun],
                   ri: int, spec: Any, path: Path | None) -> tuple[EngineProfile, Path]:
    """The profile a point is simulated under: a loaded one as is; ``insitu`` rescaled on
    the other points' steps (leave-one-out), ``insitu-self`` on the point's own steps (a
    diagnostic of the structure once the level is known)."""
    if not (isinstance(spec, str) and spec in _INSITU):
        return spec, path
    from dspark_sim.validation.server_profile import rescale_to_steps

    head = profiles.headline
    others = ([r for j, r in enumerate(runs) if j != ri] or [runs[ri]]) if spec == INSITU \
        else [runs[ri]]
    name = "insitu-loo" if spec == INSITU else "insitu-self"
    p = rescale_to_steps([r.served.step_records for r in others], head,
                         rig.kind if rig.kind in head.drafts else None,
                         [_draft_gamma(r.policy, setup.gamma_max) for r in others],
                         _draft_gamma(runs[ri].policy, setup.gamma_max), name=name)
    ppath = Path(setup.out_dir) / runs[ri].tag / f"profile-{name}.toml"
    ppath.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(ppath, p.to_toml())
    return p, ppath


def _simulate_point(setup: ValidationSetup, rig: _Rig, profiles: _Profiles,
                    runs: list[_RealRun], ri: int, log) -> tuple[list[dict], dict]:
    """Simulate one real run's point under every profile; its comparison rows and its
    entry in validation.json."""
    from dspark_sim.validation.server_profile import step_model_check

    run = runs[ri]
    out = Path(setup.out_dir)
    t0 = time.perf_counter()
    real = run.summary
    point = {"policy": run.policy.name, "rate": run.rate, "tag": run.tag,
             "real_steps": real.get("engine_steps"), "real_mean_step_ms": real.get("mean_step_ms"),
             "real_duration_s": real.get("duration"), "real_wall_s": run.served.wall_s,
             "real_cpu_s": run.served.cpu_s, "profiles": {}}
    rows: list[dict] = []
    head_rows: list[dict] = []
    head_check: dict = {}
    for pi, (spec, path) in enumerate(zip(profiles.specs, profiles.paths, strict=True)):
        p, ppath = _point_profile(setup, rig, profiles, runs, ri, spec, path)
        cfg = sim_config(run.workload_path, run.policy.name, rig.engine, str(ppath),
                         len(run.workload.prompts), calibration=setup.calibration)
        # the scheduler's SPS curve comes from the table the server's scheduler used,
        # whatever profile prices the steps: each row compares step-cost models, not two
        # schedulers fed different tables
        sims = [simulate(replace(cfg, seed=setup.seed + k), profile=p, trace=run.trace,
                         policy_profile=profiles.headline)
                for k in range(max(1, setup.sim_seeds))]
        sim = _mean_summaries([x.summary for x in sims])
        sub = "" if pi == 0 else f"-{p.name}"
        _write_run(out / run.tag / f"sim{sub}", sim, sims[0].requests)
        paired = simulate_paired(cfg, p, run.trace, rig.calibration,
                                 policy_profile=profiles.headline)
        _write_run(out / run.tag / f"paired{sub}", paired, None)
        check = step_model_check(run.served.step_records, p,
                                 rig.kind if rig.kind in p.drafts else None,
                                 _draft_gamma(run.policy, setup.gamma_max))
        new = [{"profile": p.name, "policy": run.policy.name, "rate": run.rate, "metric": key,
                "label": label, "real": _f(real.get(key)), "sim": _f(sim.get(key)),
                "rel_error": _rel(sim.get(key), real.get(key)), "paired": _f(paired.get(key)),
                "paired_rel_error": _rel(paired.get(key), real.get(key))}
               for key, label in METRICS]
        rows += new
        point["profiles"][p.name] = {
            "sim_steps": sim.get("engine_steps"), "sim_mean_step_ms": sim.get("mean_step_ms"),
            "paired_steps": paired.get("engine_steps"),
            "paired_mean_step_ms": paired.get("mean_step_ms"), "step_check": check}
        if pi == 0:
            head_rows, head_check = new, check
    point["sim_wall_s"] = time.perf_counter() - t0
    log(_point_line(run.policy.name, run.rate, head_rows, head_check, run.elapsed_s))
    return rows, point


def _write_comparison(setup: ValidationSetup, rig: _Rig, profiles: _Profiles,
                      df: pl.DataFrame, points: list[dict], elapsed_s: float) -> None:
    import torch

    out = Path(setup.out_dir)
    head = profiles.headline
    # one unit (sim.outputs.write_unit): the tables first, validation.json (with their
    # hashes) last, so a failure never leaves one run's table beside another's verdict
    write_unit(out, "validation.json", jsonable({
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor()} ({platform.node()})",
        "device": setup.device, "threads": int(torch.get_num_threads()), "clock": rig.clock,
        "target": rig.target.name, "drafter": rig.kind, "profile": head.name,
        "profiles": [p if isinstance(p, str) else p.name for p in profiles.specs],
        "profile_kind": head.kind, "policies": [get_policy(p).name for p in setup.policies],
        "rates": [float(r) for r in setup.rates], "num_requests": setup.num_requests,
        "max_new_tokens": setup.max_new_tokens, "max_num_seqs": setup.max_num_seqs,
        "max_num_batched_tokens": setup.max_num_batched_tokens, "sim_seeds": setup.sim_seeds,
        "elapsed_s": elapsed_s, "points": points}),
        {"comparison.parquet": df.write_parquet, "comparison.csv": df.write_csv})


STEP_COLUMNS = ["step_s", "forward_s", "decoding", "verify_tokens", "prefill_tokens",
                "kv_tokens", "finishing_prefills", "query_ctx", "multi_ctx", "ctx_requests"]


def _write_run(d: Path, summary: dict, requests: pl.DataFrame | None,
               steps: list[tuple] | None = None) -> None:
    """A run folder as one unit (``sim.outputs.write_run``: summary.json with a manifest
    of the tables, ordered renames, rollback); a summary alone is one atomic file."""
    if requests is None:
        d.mkdir(parents=True, exist_ok=True)
        write_json_atomic(d / "summary.json", jsonable(summary))
        return
    extra = None
    if steps is not None:
        extra = {"steps.parquet": pl.DataFrame(
            np.asarray(steps, dtype=np.float64).reshape(-1, len(STEP_COLUMNS)),
            schema=STEP_COLUMNS, orient="row")}
    write_run(d, jsonable(summary), requests, extra=extra)


def _fmt(v: float | None, err: bool = False) -> str:
    if v is None or not math.isfinite(v):
        return "-"
    return f"{v:+.1%}" if err else (f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}")


def _point_line(policy: str, rate: float, rows: list[dict], check: dict, elapsed: float) -> str:
    parts = [f"{r['label']} {_fmt(r['real'])}/{_fmt(r['sim'])} ({_fmt(r['rel_error'], True)})"
             for r in rows]
    step = (f"; step model {_fmt(check.get('all_rel_error'), True)}" if check else "")
    return f"[{policy} @ {rate:g} req/s, {elapsed:.0f} s] real/sim: " + ", ".join(parts) + step


def format_table(df: pl.DataFrame) -> str:
    """A Markdown table: one row per (policy, rate), real / sim (error) per metric."""
    head = "| profile | policy | rate | " + " | ".join(lbl for _, lbl in METRICS) + " |"
    lines = [head, "|" + "---|" * (3 + len(METRICS))]
    for (prof, pol, rate), g in df.group_by(["profile", "policy", "rate"], maintain_order=True):
        cells = []
        by = {r["metric"]: r for r in g.iter_rows(named=True)}
        for key, _ in METRICS:
            r = by.get(key)
            cells.append("-" if r is None else
                         f"{_fmt(r['real'])} / {_fmt(r['sim'])} ({_fmt(r['rel_error'], True)}; "
                         f"paired {_fmt(r['paired_rel_error'], True)})")
        lines.append(f"| {prof} | {pol} | {rate:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = ["ValidationSetup", "ValidationResult", "validate", "format_table", "simulate_paired",
           "lookup_trace", "learned_trace", "poisson_workload", "prompt_pool", "write_mooncake"]
