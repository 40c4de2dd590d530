"""Calibrate from a real vLLM deployment's own measurements: ``bench serve`` result files
(and optionally ``/metrics`` scrapes) -> an engine profile and an acceptance trace.

Input is what a vLLM user already has: ``vllm bench serve --save-result`` JSON files
(``--save-detailed`` for each request's prompt length and send time) at several loads,
with and without speculation. A file's speculation setting is read from its own fields:
``spec_decode_per_position_acceptance_rates`` (its length is ``num_speculative_tokens``),
or none without them; ``--metadata dspark_setting=NAME`` names it (the live runs of
:mod:`dspark_sim.validation.vllm_live` tag theirs).

The fit is by simulation, not by formula. Each run is re-simulated on its own workload (its
requests' prompt and output lengths; closed loop at its ``max_concurrency``, or its send
times replayed when it ran open loop) with a candidate profile, and the profile's
parameters minimise the squared log-errors of the simulated against the measured
figures, weighted by how well a run measures each: output throughput and median TPOT
(1), median TTFT (0.5); and, where the none runs' timings show requests that ran alone,
a lone request's TTFT at both ends of their TTFT-against-prompt-length line (0.5 each,
:func:`ttft_line`), which tells the fixed per-request overhead from the per-token
prefill cost where every run's median TTFT is at about one prompt length. The parameters are what a CPU or GPU step costs in vLLM's
model-runner: a fixed cost per step (scheduler, sampler, launch), a cost per batch token
(weights and activations), a cost per decoding request (its attention and sampling
set-up) and a cost per logit row (the LM head on every decode and verify row, skipped for
prefill rows that produce no token); a linear ``[target]`` table holds the first two,
or, where the none runs show the step is not linear in the batch, a table with a step
time at each batch they decode (:class:`StepModel`, ``--step-table``).
Besides the step: the API server's time per request before the engine sees it (one
request at a time, so requests sent together reach the engine in turn), and, when a
speculative run is fitted, what speculation adds per step and per decoding request.
Levenberg-Marquardt in log space keeps them positive. A simulated closed loop is exactly
homogeneous in the step costs, so the fit is well conditioned whatever the hardware's
speed: it works for a GPU deployment as for this CPU one.

Each speculative setting replays its own measured per-request trace where the run folder
has one (``acceptance/<setting>.jsonl``: :mod:`dspark_sim.validation.vllm_acceptance`),
each bench request its own row. Without it, the trace comes from the speculative runs'
counters, pooled per ``k`` (the largest ``k`` fitted), through
:func:`dspark_sim.traces.importers.import_vllm_counters`: per-position survival and, where a
run says how many request-steps there were, how often the drafter proposed at all (an
n-gram drafter drafts only where it finds a match).
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from dspark_sim.calibration.profile import DraftCost, EngineLimits, EngineProfile
from dspark_sim.errors import InputError, is_decimal
from dspark_sim.io import loads_bench_serve_json, not_a_file
from dspark_sim.sim.config import DeploymentConfig, EngineConfig, SimConfig, WorkloadConfig
from dspark_sim.traces.schema import AcceptanceTrace
from dspark_sim.validation.vllm_acceptance import SettingTraces, setting_traces
from dspark_sim.validation.vllm_repeats import (
    BOOTSTRAP_SAMPLES,
    constant_uncertainty,
    group_points,
    log_covariance,
    relative_half_range,
)

if TYPE_CHECKING:
    from dspark_sim.sim.api import SimResult
    from dspark_sim.sim.metrics import StepSeries

# Figures compared, with their weights in the fit (TTFT is one prefill per request, with
# the client's and the HTTP path's noise on top: it informs the per-token cost, weakly).
METRICS = {"output_throughput": 1.0, "median_tpot_ms": 1.0, "median_ttft_ms": 0.5}
PARAMS = ("step_fixed_ms", "token_ms", "request_ms", "logit_row_ms", "frontend_ms",
          "draft_step_ms", "draft_request_ms")
DRAFTER = "vllm"  # the [draft.<name>] table and trace drafter of a calibrated pair
UNSIMULATED = 5.0  # the log-error charged for a figure a candidate could not produce
MAX_LOG_STEP = 1.0  # at most a factor e per parameter and iteration
STEP_TABLES = ("auto", "by-batch", "linear")
# "auto" tables the step by batch only where the none runs' token gaps miss a line, or
# the linear model misses a none point's TPOT, by more than this many times the repeats'
# spread (half the range of 3 repeats is about 0.85 standard deviations, so 3x is about
# 2.5 of them), or MIN_SPREAD where the repeats happened to agree
NOISE_MULTIPLE = 3.0
MIN_SPREAD = 0.02
MIN_GAPS = 200  # token gaps that price a batch's step (about three requests' worth)
STEP_WEIGHT = 1.0  # a tabled batch's measured decode step, weighed as a TPOT
# The lone requests' TTFT line (:func:`ttft_line`) is fitted where at least this many
# none requests ran alone (Theil-Sen's breakdown point is 29 %: two outliers among eight
# are outvoted) and their prompt lengths spread by at least this much (the 10th to 90th
# percentile range over the median): with less, the slope is the noise's, and the
# intercept, extrapolated to an empty prompt, more so.
MIN_LONE = 8
MIN_PROMPT_SPREAD = 0.25
LINE_QUANTILES = (0.1, 0.9)  # the line is held at these quantiles of its prompts
LINE_WEIGHT = METRICS["median_ttft_ms"]  # each end of the line, weighed as a median TTFT
MAX_PAIRS = 200_000  # Theil-Sen slopes drawn at random past this many pairs


@dataclass(frozen=True, eq=False)
class BenchRun:
    """One ``bench serve`` result: its load, its requests and what it measured."""

    path: Path
    setting: str
    k: int  # num_speculative_tokens; 0: no speculation
    concurrency: int | None  # closed loop; None: open loop at ``rate``
    rate: float | None
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    send_s: np.ndarray | None  # open loop: each request's send time from the first
    measured: dict[str, float]
    counters: dict  # the spec_decode_* fields (empty without speculation)
    # decode steps per request: its streamed chunks after the first token (vLLM streams
    # one chunk per engine step), None without --save-detailed
    decode_steps: np.ndarray | None = None
    round: int | None = None  # vllm measure's round (--metadata dspark_round), if tagged
    # what stood in for a field the file lacks (no --save-detailed): said as a warning
    substituted: tuple[str, ...] = ()
    # each request's generated text (--save-detailed): matches it to its acceptance row
    generated_texts: tuple[str, ...] | None = None
    # each request's time to first token and gaps between streamed chunks (seconds;
    # --save-detailed): when it decoded, and how long each of its steps took
    ttft_s: np.ndarray | None = None
    itl_s: tuple[np.ndarray, ...] | None = None

    @property
    def name(self) -> str:
        load = f"c{self.concurrency}" if self.concurrency is not None else f"r{self.rate:g}"
        return f"{self.setting}@{load}"

    @property
    def load(self) -> str:
        return f"C={self.concurrency}" if self.concurrency is not None \
            else f"{self.rate:g} req/s"


def _num(d: dict, key: str, where: str, *, positive: bool = True) -> float:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
            or (positive and v <= 0):
        raise InputError(where, f"'{key}' must be a {'positive ' if positive else ''}number "
                                f"(a vllm bench serve --save-result file), got {v!r}")
    return float(v)


def read_bench_run(path: str | Path) -> BenchRun:
    """Read and check one result file (one-line errors naming it)."""
    p = Path(path)
    where = str(p)
    if not p.is_file():
        raise InputError(where, not_a_file(p, "bench serve result"))
    try:
        d = loads_bench_serve_json(p.read_text(encoding="utf-8-sig"), where)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(where, f"not a JSON bench serve result ({exc})") from None
    if not isinstance(d, dict):
        raise InputError(where, "not a bench serve result (a JSON object)")
    measured = {m: _num(d, m, where) for m in METRICS}
    completed = int(_num(d, "completed", where))
    rates = d.get("spec_decode_per_position_acceptance_rates")
    k = len(rates) if isinstance(rates, list) else 0
    meta_setting = d.get("dspark_setting")
    setting = str(meta_setting) if meta_setting else ("none" if k == 0 else f"spec-k{k}")
    conc = d.get("max_concurrency")
    rate = d.get("request_rate")
    if conc is None and (rate in (None, "inf") or rate == float("inf")):
        raise InputError(where, "neither max_concurrency nor a finite request_rate: cannot "
                                "tell the run's load")
    prompt, output, send, substituted = _requests(d, where, completed,
                                                  None if conc is not None else float(rate))
    counters = {key: d[key] for key in d if key.startswith("spec_decode_")} if k else {}
    if k:
        measured["acceptance_length"] = _num(d, "spec_decode_acceptance_length", where)
        counters["completed"] = completed
        counters["total_output_tokens"] = int(output.sum())
    itls = d.get("itls")
    steps = np.array([len(x) for x in itls], np.int64) \
        if isinstance(itls, list) and len(itls) == completed \
        and all(isinstance(x, list) for x in itls) else None
    ttfts = d.get("ttfts")
    timed = steps is not None and isinstance(ttfts, list) and len(ttfts) == completed \
        and send is not None
    try:
        ttft_s = np.asarray(ttfts, np.float64) if timed else None
        itl_s = tuple(np.asarray(x, np.float64) for x in itls) if timed else None
    except (TypeError, ValueError):
        raise InputError(where, "ttfts / itls must be numbers (seconds)") from None
    if k and steps is None:
        substituted += ("no per-request streamed chunks (itls): the trace's rows are the "
                        "pooled counters', not each request's",)
    rnd = d.get("dspark_round")
    texts = d.get("generated_texts")
    texts = tuple(texts) if isinstance(texts, list) and len(texts) == completed \
        and all(isinstance(x, str) for x in texts) else None
    return BenchRun(p, setting, k, int(conc) if conc is not None else None,
                    None if conc is not None else float(rate), prompt, output, send,
                    measured, counters, steps,
                    int(rnd) if is_decimal(str(rnd), 6) else None, substituted, texts,
                    ttft_s, itl_s)


def _requests(d: dict, where: str, completed: int, rate: float | None):
    """Per-request lengths (``--save-detailed``), else each request at the mean lengths;
    open loop, each request's send time, else sends evenly spaced at the run's rate. The
    last item says what was substituted."""
    substituted: tuple[str, ...] = ()
    ins, outs = d.get("input_lens"), d.get("output_lens")
    if isinstance(ins, list) and isinstance(outs, list) and len(ins) == len(outs) == completed:
        prompt = np.asarray(ins, dtype=np.int64)
        output = np.asarray(outs, dtype=np.int64)
    else:
        total_in = _num(d, "total_input_tokens", where)
        total_out = _num(d, "total_output_tokens", where)
        prompt = np.full(completed, max(1, round(total_in / completed)), np.int64)
        output = np.full(completed, max(1, round(total_out / completed)), np.int64)
        substituted += (f"no per-request lengths (input_lens, output_lens): every request "
                        f"at the mean, {prompt[0]} prompt and {output[0]} output tokens",)
    if (prompt < 1).any() or (output < 1).any():
        raise InputError(where, "input_lens / output_lens must be positive token counts")
    starts = d.get("start_times")
    send = None
    if isinstance(starts, list) and len(starts) == completed:
        s = np.asarray(starts, dtype=np.float64)
        send = s - s.min()
    elif rate is not None:
        send = np.arange(completed, dtype=np.float64) / rate
        substituted += (f"no send times (start_times): requests sent evenly at its "
                        f"{rate:g} req/s",)
    return prompt, output, send, substituted


def read_bench_runs(paths: list[Path]) -> list[BenchRun]:
    """Files, or folders of ``*.json`` files (sorted)."""
    files: list[Path] = []
    for p in paths:
        files += sorted(Path(p).glob("*.json")) if Path(p).is_dir() else [Path(p)]
    if not files:
        raise InputError(", ".join(map(str, paths)) or "FILES", "no bench serve result files")
    seen: set[Path] = set()
    for f in files:
        if f.resolve() in seen:
            raise InputError(str(f), "given twice: a repeat is another run's file")
        seen.add(f.resolve())
    runs = [read_bench_run(f) for f in files]
    group_points(runs)  # repeats of a point must be repeats (the same requests)
    return runs


def substitution_warnings(runs: list[BenchRun]) -> list[str]:
    """One line per run that lacked a ``--save-detailed`` field, saying what stood in."""
    return [f"{r.path}: {'; '.join(r.substituted)} (bench serve --save-detailed records it)"
            for r in runs if r.substituted]


# -- simulating one run -----------------------------------------------------------------
def workload_file(run: BenchRun, folder: Path) -> Path:
    """The run's requests as a Mooncake JSONL (send times in ms; lengths)."""
    path = folder / f"{run.name.replace('@', '_')}.jsonl"
    send = run.send_s if run.send_s is not None else np.zeros(len(run.prompt_tokens))
    order = _send_order(run)
    with path.open("w", encoding="utf-8") as fh:
        for i in order:
            fh.write(json.dumps({"timestamp": round(float(send[i]) * 1e3, 3),
                                 "input_length": int(run.prompt_tokens[i]),
                                 "output_length": int(run.output_tokens[i])}) + "\n")
    return path


def _send_order(run: BenchRun) -> np.ndarray:
    send = run.send_s if run.send_s is not None else np.zeros(len(run.prompt_tokens))
    return np.argsort(send, kind="stable")


def run_config(run: BenchRun, workload: Path, engine: EngineConfig, seed: int = 0
               ) -> SimConfig:
    """The simulator's configuration of a bench run: one replica, its load, fixed-k."""
    k = run.k
    if run.concurrency is not None:
        wl = WorkloadConfig(arrival="closed", max_concurrency=run.concurrency,
                            workload_path=str(workload), num_requests=None)
    else:
        wl = WorkloadConfig(arrival="replay", workload_path=str(workload), num_requests=None)
    return SimConfig(engine=engine, deployment=DeploymentConfig(replicas=1),
                     workload=wl, policy="none" if k == 0 else f"fixed:{k}", seed=seed)


def simulate_run(run: BenchRun, profile: EngineProfile,
                 trace: AcceptanceTrace | SettingTraces | None, engine: EngineConfig,
                 workload: Path, seed: int = 0) -> dict[str, float]:
    """The run's figures, simulated. ``trace``: one trace for every ``k`` (rows paired
    where its request lengths are the run's), or each setting's own
    (:class:`~dspark_sim.validation.vllm_acceptance.SettingTraces`)."""
    return _figures(run, _simulate(run, profile, trace, engine, workload, seed).summary)


def simulate_with_steps(run: BenchRun, profile: EngineProfile,
                        trace: AcceptanceTrace | SettingTraces | None, engine: EngineConfig,
                        workload: Path, seed: int = 0) -> tuple[dict[str, float], StepSeries]:
    """:func:`simulate_run`'s figures and the simulation's per-step series."""
    res = _simulate(run, profile, trace, engine, workload, seed, keep_steps=True)
    return _figures(run, res.summary), res.steps


def _simulate(run: BenchRun, profile: EngineProfile,
              trace: AcceptanceTrace | SettingTraces | None, engine: EngineConfig,
              workload: Path, seed: int, *, keep_steps: bool = False) -> SimResult:
    from dspark_sim.sim.api import simulate

    cfg = run_config(run, workload, engine, seed)
    if isinstance(trace, SettingTraces):
        tr, rows = trace.for_run(run)
    else:
        tr = None if run.k == 0 else trace_for_k(trace, run.k, run.name)
        rows = None if tr is None else paired_rows(run, tr)
    if rows is not None:  # the workload file lists the requests in send order
        rows = rows[_send_order(run)]
    return simulate(cfg, profile=profile, trace=tr, trace_rows=rows, keep_steps=keep_steps)


def _figures(run: BenchRun, s: dict) -> dict[str, float]:
    # a figure the run could not produce (a candidate so slow that nothing finished in
    # the time bound) is NaN, never a crash of the fit that tried it
    out = {m: float("nan") if s.get(m) is None else float(s[m]) for m in METRICS}
    if run.k:
        tau = s.get("spec_decode_acceptance_length")
        out["acceptance_length"] = float("nan") if tau is None else float(tau)
    return out


def trace_for_k(trace: AcceptanceTrace | None, k: int, name: str) -> AcceptanceTrace:
    if trace is None:
        raise InputError(name, "a speculative run needs an acceptance trace: fit at least "
                               "one speculative run")
    if k <= trace.gamma_max:
        return trace
    from dspark_sim.calibration.confidence_source import extend_gamma

    return extend_gamma(trace, k)[0]


# -- the profile ----------------------------------------------------------------------
@dataclass(frozen=True)
class StepModel:
    """How a fitted profile prices a step's batch tokens ``B``: ``fixed + token x B``
    (no knots), or a table with its own step time at each knot ``B`` (the batch sizes
    at which the fitted none runs decode) and ``token`` per token past the last knot.
    A measured engine's step time need not grow smoothly with the batch: CUDA graphs
    pad to captured sizes, and vLLM's CPU matmuls take other kernels at other row
    counts (SmolLM2 on two cores decodes 4 rows faster than 1 or 2)."""

    knots: tuple[int, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        if not self.knots:
            return PARAMS
        return (*(f"step_ms@{b}" for b in self.knots), *PARAMS[1:])

    def target_table(self, theta: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
        """The target table (tokens, step ms) of ``theta`` up to ``top`` tokens."""
        token = float(theta[len(self.knots) if self.knots else 1])
        if not self.knots:
            fixed = float(theta[0])
            return np.array([1, top], np.int64), np.array([fixed + token, fixed + token * top])
        knots = np.array(self.knots, np.int64)
        values = np.asarray(theta[:len(knots)], float)
        tokens, step = list(knots), list(values)
        if knots[0] > 1:  # below the first knot, its slope continues down (and stays > 0)
            tokens.insert(0, 1)
            step.insert(0, max(values[0] - token * (knots[0] - 1), 0.5 * values[0]))
        if top > knots[-1]:
            tokens.append(top)
            step.append(values[-1] + token * (top - knots[-1]))
        return np.array(tokens, np.int64), np.array(step)

    def full(self, theta: np.ndarray) -> np.ndarray:
        """``theta`` padded with 0 for the drafter constants a none-only fit leaves out."""
        return np.concatenate([np.asarray(theta, float),
                               np.zeros(len(self.names) - len(theta))])


def decode_gaps(run: BenchRun) -> dict[int, np.ndarray]:
    """A none run's gaps between one request's consecutive tokens (ms), by how many
    requests were decoding at the gap's midpoint: each gap is one engine step (one token
    per request per step), taken at that batch (or longer, where a prompt's chunk shared
    the step: the median of many is the decode step's). Empty without the run's
    per-request timings."""
    if run.k:
        return {}
    gaps = _labelled_gaps(run)
    return {} if gaps is None else by_batch(gaps.ms, gaps.batch)


def step_gaps(run: BenchRun) -> dict[int, np.ndarray]:
    """Any run's engine steps as its requests saw them (ms), by how many requests were
    decoding at the gap's midpoint (:func:`decode_gaps`), speculative runs' too: vLLM
    streams a request one chunk per step, whatever it accepted. A gap in which another
    request's first token arrived is left out (:func:`prompt_step_gaps`): that step ran
    a prompt's chunk as well, so it prices a prefill, not the decode or verify step of
    that batch. Empty without the run's per-request timings."""
    gaps = _labelled_gaps(run)
    return {} if gaps is None else by_batch(gaps.ms, np.where(gaps.prompt, 0, gaps.batch))


def prompt_step_gaps(run: BenchRun) -> np.ndarray:
    """The gaps (ms) in which another request's first token arrived: the steps that ran
    the end of a prompt beside the requests decoding, as those requests saw them."""
    gaps = _labelled_gaps(run)
    return np.zeros(0) if gaps is None else gaps.ms[gaps.prompt]


class _Gaps(NamedTuple):
    ms: np.ndarray  # every request's gaps between consecutive chunks, in turn
    batch: np.ndarray  # requests decoding at each gap's midpoint (0: a gap to leave out)
    prompt: np.ndarray  # whether it ended the step of another request's first token


def _labelled_gaps(run: BenchRun) -> _Gaps | None:
    if run.itl_s is None or run.ttft_s is None or run.send_s is None:
        return None
    first = run.send_s + run.ttft_s
    times = [f + np.concatenate([[0.0], np.cumsum(g)]) for f, g in zip(first, run.itl_s,
                                                                        strict=True)]
    starts = np.sort(first)
    ends = np.sort([t[-1] for t in times])
    gaps = np.concatenate(run.itl_s) * 1e3
    lo = np.concatenate([t[:-1] for t in times])
    hi = np.concatenate([t[1:] for t in times])
    mids = (hi + lo) / 2
    # decoding at a moment: requests past their first token and not past their last
    batch = np.searchsorted(starts, mids, side="right") - np.searchsorted(ends, mids,
                                                                          side="left")
    # a gap that is no positive time, or whose place is unknown (after a NaN), is no step
    batch[~(np.isfinite(gaps) & (gaps > 0) & np.isfinite(mids))] = 0
    prompt = np.concatenate([_holds_first(t, starts) for t in times])
    return _Gaps(gaps, batch, prompt & (batch > 0))


def _holds_first(t: np.ndarray, firsts: np.ndarray) -> np.ndarray:
    """Which of one request's gaps (between its token times ``t``) ended the step that
    gave another request its first token: the gap ending at the token nearest that first
    token (one step emits both, and the client reads them in either order). A first
    token nearest this request's own first token, or past its last token by over half
    its last gap, marks none."""
    out = np.zeros(len(t) - 1, bool)
    if len(t) < 2:
        return out
    j = np.clip(np.searchsorted(t, firsts), 1, len(t) - 1)
    nearest = np.where(firsts - t[j - 1] < t[j] - firsts, j - 1, j)
    inside = (firsts <= t[-1] + (t[-1] - t[-2]) / 2) & (nearest > 0)
    out[nearest[inside] - 1] = True
    return out


def by_batch(gaps: np.ndarray, batch: np.ndarray) -> dict[int, np.ndarray]:
    """``gaps`` grouped by their ``batch`` (0: left out)."""
    ok = batch > 0
    return {int(b): gaps[ok & (batch == b)] for b in np.unique(batch[ok])}


def pooled_gaps(runs: list[BenchRun], gaps=decode_gaps) -> dict[int, np.ndarray]:
    """The runs' gaps (``gaps``: :func:`decode_gaps` or :func:`step_gaps`) by batch,
    pooled."""
    pooled: dict[int, list[np.ndarray]] = {}
    for r in runs:
        for b, g in gaps(r).items():
            pooled.setdefault(b, []).append(g)
    return {b: np.concatenate(g) for b, g in pooled.items()}


def step_model(runs: list[BenchRun], max_batched_tokens: int) -> StepModel:
    """A knot at each batch the none runs decode often enough to price it: from their
    per-request timings, every batch with :data:`MIN_GAPS` token gaps or more, the
    open-loop runs' included; without timings, each closed-loop concurrency. Two knots
    or more, within the token budget; else the linear model."""
    knots = {b for b, g in pooled_gaps(runs).items() if len(g) >= MIN_GAPS}
    knots |= {r.concurrency for r in runs if r.k == 0 and r.concurrency and
              r.itl_s is None}
    knots = tuple(sorted(b for b in knots if b < max_batched_tokens))
    return StepModel(knots if len(knots) >= 2 else ())


def measured_decode_steps(runs: list[BenchRun], model: StepModel) -> dict[int, float]:
    """Each knot's decode step as the none runs measured it (ms): the median token gap
    at that batch over all of them (:func:`decode_gaps`); knots without timings are
    left out."""
    pooled = pooled_gaps(runs)
    return {b: float(np.median(pooled[b])) for b in model.knots if b in pooled}


def knot_starts(runs: list[BenchRun], model: StepModel) -> dict[int, float]:
    """Each knot's measured step (ms): :func:`measured_decode_steps`, else the median
    TPOT of the none run whose concurrency it is."""
    out = measured_decode_steps(runs, model)
    for r in runs:
        if r.k == 0 and r.concurrency in model.knots and r.concurrency not in out:
            out[r.concurrency] = r.measured["median_tpot_ms"]
    return out


# -- the lone requests' TTFT line -------------------------------------------------------
def lone_requests(run: BenchRun) -> np.ndarray:
    """Which of a none run's requests were alone from their send to their first token:
    no other request of the run sent before that token and not finished by its send
    (closed loop at C = 1, every one; open loop, one sent to an idle server). Such a
    request's TTFT is the fixed per-request overhead and its own prompt's prefill, with
    nothing queued before it or batched beside it. All False without the run's
    per-request timings (``--save-detailed``)."""
    n = len(run.prompt_tokens)
    if run.k or run.ttft_s is None or run.itl_s is None or run.send_s is None:
        return np.zeros(n, bool)
    first = run.send_s + run.ttft_s
    end = first + np.array([float(np.sum(g)) for g in run.itl_s])
    # requests sent before i's first token, less those finished by i's send (each of
    # them was sent before it too): 1 where i is the only one in flight
    in_flight = np.searchsorted(np.sort(run.send_s), first, side="left") \
        - np.searchsorted(np.sort(end), run.send_s, side="right")
    return (in_flight == 1) & np.isfinite(run.ttft_s) & (run.ttft_s > 0)


def theil_sen(x: np.ndarray, y: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """``(slope, intercept)`` of the Theil-Sen line: the median of the slopes between
    pairs of points of distinct ``x``, and the median of ``y - slope x``; robust to
    outliers in ``y`` (up to 29 % of the points). Past :data:`MAX_PAIRS` pairs, a seeded
    sample of them. NaN without two distinct ``x``."""
    x = np.asarray(x, float)
    y = np.asarray(y, float)
    n = x.size
    if n * (n - 1) // 2 <= MAX_PAIRS:
        i, j = np.triu_indices(n, 1)
    else:
        rng = np.random.default_rng(seed)
        i, j = rng.integers(0, n, MAX_PAIRS), rng.integers(0, n, MAX_PAIRS)
    dx = x[j] - x[i]
    ok = dx != 0
    if not ok.any():
        return math.nan, math.nan
    slope = float(np.median((y[j] - y[i])[ok] / dx[ok]))
    return slope, float(np.median(y - slope * x))


@dataclass(frozen=True, eq=False)
class TtftLine:
    """The lone requests' TTFT against their prompt length (:func:`ttft_line`):
    ``intercept_ms + slope_ms x prompt``, the fixed per-request overhead and the
    per-token prefill cost, apart."""

    prompt: np.ndarray  # the lone requests' prompt tokens
    ttft_ms: np.ndarray
    slope_ms: float
    intercept_ms: float

    @property
    def requests(self) -> int:
        return int(self.prompt.size)

    @property
    def ends(self) -> np.ndarray:
        """The prompt lengths the line is held at (:data:`LINE_QUANTILES` of its
        prompts): inside the data, where it is measured, not extrapolated."""
        if not self.prompt.size:
            return np.zeros(2, np.int64)
        return np.round(np.quantile(self.prompt, LINE_QUANTILES)).astype(np.int64)

    @property
    def spread(self) -> float:
        """The prompts' 10th to 90th percentile range over their median."""
        if not self.prompt.size:
            return 0.0
        lo, hi = np.quantile(self.prompt, LINE_QUANTILES)
        return float((hi - lo) / np.median(self.prompt))

    def at(self, prompt) -> np.ndarray:
        return self.intercept_ms + self.slope_ms * np.asarray(prompt, float)

    @property
    def unused(self) -> str:
        """Why the fit leaves the line out ("" where it fits it)."""
        if self.requests < MIN_LONE:
            return (f"{self.requests} request{'' if self.requests == 1 else 's'} alone in "
                    f"the engine, fewer than {MIN_LONE} (a closed loop at C = 1, or an "
                    "open loop's requests sent to an idle server, with --save-detailed)")
        if self.spread < MIN_PROMPT_SPREAD:
            return (f"their prompt lengths spread by {self.spread:.0%} of the median, under "
                    f"{MIN_PROMPT_SPREAD:.0%}: the slope cannot be told from the noise")
        if not self.slope_ms > 0 or not (self.at(self.ends) > 0).all():
            return "its slope is not positive: the noise outweighs the prefill"
        return ""

    def resampled(self, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> np.ndarray:
        """``samples`` x 2: the line's ``(slope, intercept)`` over a seeded bootstrap of
        its lone requests."""
        rng = np.random.default_rng(seed)
        out = np.empty((samples, 2))
        for b in range(samples):
            idx = rng.integers(0, self.requests, self.requests)
            out[b] = theil_sen(self.prompt[idx], self.ttft_ms[idx], seed)
        return out

    def standard_errors(self, seed: int = 0) -> tuple[float, float]:
        """The bootstrap standard errors (ms) of the slope and the intercept."""
        sl, ic = self.resampled(seed=seed).T
        ok = np.isfinite(sl)
        return float(np.std(sl[ok], ddof=1)), float(np.std(ic[ok], ddof=1))

    def shifts(self, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> np.ndarray:
        """``samples`` x 2: over a seeded bootstrap of the lone requests, how each end's
        log residual (simulated over measured) moves: ``log(end / resampled end)``."""
        ends = self.ends
        base = self.at(ends)
        out = np.zeros((samples, 2))
        for b, (slope, intercept) in enumerate(self.resampled(samples, seed)):
            v = intercept + slope * ends
            if np.isfinite(v).all() and (v > 0).all():
                out[b] = np.log(base / v)
        return out


def ttft_line(runs: list[BenchRun], seed: int = 0) -> TtftLine:
    """The Theil-Sen line (:func:`theil_sen`) of TTFT against prompt length over every
    none run's lone requests (:func:`lone_requests`), repeats pooled: each such TTFT is
    the overhead plus its own prompt's prefill, so the slope is the per-token prefill
    cost and the intercept the fixed overhead (API server, HTTP, the step's fixed part),
    which a run's median TTFT alone cannot tell apart. :attr:`TtftLine.unused` says
    where the runs do not support it."""
    x, y = [], []
    for r in runs:
        lone = lone_requests(r)
        x.append(r.prompt_tokens[lone])
        y.append(1e3 * r.ttft_s[lone] if lone.any() else np.zeros(0))
    prompt = np.concatenate(x) if x else np.zeros(0, np.int64)
    ttft = np.concatenate(y) if y else np.zeros(0)
    slope, intercept = theil_sen(prompt, ttft, seed) if prompt.size > 1 \
        else (math.nan, math.nan)
    return TtftLine(prompt.astype(np.int64), ttft, slope, intercept)


def lone_ttft_ms(profile: EngineProfile, prompt, max_batched_tokens: int) -> np.ndarray:
    """A lone request's TTFT (ms) as the simulator prices it with a fitted profile: the
    API server's time, then its prompt's prefill a chunk of at most the step's token
    budget a step; the last chunk's step computes its first token (a logit row), and
    each chunk after the first continues a request with a context (a request's cost).
    A fitted profile has no KV or attention terms."""
    budget = max(1, int(max_batched_tokens))
    out = []
    for p in np.atleast_1d(np.asarray(prompt, np.int64)):
        full, rest = divmod(int(p), budget)
        chunks = np.array([budget] * full + ([rest] if rest else []), np.int64)
        out.append(profile.frontend_s_per_request + float(profile.target_time_s(chunks).sum())
                   + profile.logits_s_per_row + profile.request_s * (len(chunks) - 1))
    return 1e3 * np.array(out)


def make_profile(theta: np.ndarray, *, name: str, max_batched_tokens: int,
                 limits: EngineLimits, parameters: dict | None = None,
                 model: StepModel = StepModel()) -> EngineProfile:
    """A profile from the step-cost parameters (ms, ``model.names``): the target table
    (:class:`StepModel`), ``request_us``, ``logits_us_per_row``, and a ``[draft.vllm]``
    table of ``draft_step + draft_request * n`` for ``n`` decoding requests: what
    speculation adds to a step beyond its verify rows (the proposer's search, which
    runs for every request whether or not it finds a match, and the rejection sampler),
    whatever ``k`` is, hence a block-priced table (``gamma_slope`` 0). Missing drafter
    parameters are 0."""
    theta = model.full(theta)
    request, logit, frontend, d_step, d_req = (float(x) for x in theta[-5:])
    top = max(2, max_batched_tokens)
    tokens, step_ms = model.target_table(theta, top)
    batch = np.array([1.0, 4096.0])
    draft = DraftCost(batch=batch, time_s=(d_step + d_req * batch) / 1e3, gamma_ref=1,
                      gamma_slope=0.0, block=True)
    table = "fixed + token x B" if not model.knots else \
        f"a table at B = {', '.join(map(str, model.knots))}, then token x B"
    return EngineProfile(
        # the runs measured one server: a run on the profile simulates one unless told
        name=name, kind="measured", gpus_per_replica=1, default_replicas=1,
        tokens=tokens, step_s=step_ms / 1e3,
        request_s=request / 1e3, logits_s_per_row=logit / 1e3,
        frontend_s_per_request=frontend / 1e3, interpolation="linear",
        drafts={DRAFTER: draft}, limits=limits,
        description="Fitted to vLLM bench serve runs by simulation (dspark-sim calibrate "
                    f"vllm): step = {table} + request x decoding requests + "
                    "logit_row x logit rows (+ draft_step + draft_request x decoding "
                    "requests when speculating); frontend per request before the engine, "
                    "serially",
        parameters=dict(parameters or {}), source=f"<fit {name}>")


@dataclass(frozen=True, eq=False)
class FitResult:
    profile: EngineProfile
    trace: AcceptanceTrace | None
    theta_ms: dict[str, float]
    residuals: list[dict]  # per fitted point: measured (median), simulated, relative error
    iterations: int
    engine: EngineConfig
    # per constant: value (ms), relative standard error, flag (vllm_repeats)
    uncertainty: dict[str, dict] | None = None
    points: int = 0  # fitted points (a point's repeats count once)
    traces: SettingTraces | None = None  # what each speculative setting replayed
    steps: int = 0  # tabled batches whose decode step the runs measured, also fitted
    # the none runs' lone requests' TTFT line, fitted too unless its ``unused`` says why
    line: TtftLine | None = None
    # the fitted profile's own line (:func:`profile_line`), with standard errors (ms)
    line_fit: dict | None = None

    @property
    def worst_error(self) -> float:
        return max((abs(r["error"]) for r in self.residuals), default=0.0)

    @property
    def lone(self) -> int:
        """The lone requests behind a fitted TTFT line; 0 where none was fitted."""
        return 0 if self.line is None or self.line.unused else self.line.requests

    def line_record(self) -> dict | None:
        """The lone requests' TTFT line for a manifest: its requests, slope and intercept
        (ms, with bootstrap standard errors), ends (tokens), whether it was fitted (else
        why not), and the fitted profile's own; None without lone requests."""
        line = self.line
        if line is None or line.requests == 0:
            return None
        usable = math.isfinite(line.slope_ms)
        slope_sd, intercept_sd = line.standard_errors() if usable else (None, None)
        rec = {"requests": line.requests, "slope_ms": line.slope_ms if usable else None,
               "slope_sd_ms": slope_sd, "intercept_ms": line.intercept_ms if usable else None,
               "intercept_sd_ms": intercept_sd, "prompt_ends": [int(x) for x in line.ends],
               "spread": line.spread, "fitted": not line.unused, "unused": line.unused}
        if self.line_fit is not None:
            rec["profile"] = self.line_fit
        return rec

    def line_sentence(self) -> str:
        """The lone requests' TTFT line, measured and as the fitted profile has it, or
        why the fit leaves it out."""
        line = self.line
        head = "**Lone requests' TTFT** (none runs, each request alone in the engine from " \
               "its send to its first token)"
        if line is None or line.requests == 0:
            return f"{head}: no such request; the fixed overhead and the per-token " \
                   "prefill cost are told apart by the points' figures alone."
        if line.unused:
            return f"{head}: not fitted: {line.unused}."
        lo, hi = (int(x) for x in line.ends)
        slope_sd, intercept_sd = line.standard_errors()
        text = (f"{head}: {line.requests} requests, prompts of {lo}-{hi} tokens (10th-90th "
                f"percentile); their Theil-Sen line is {line.intercept_ms:.3g} ±"
                f"{intercept_sd:.2g} ms a request + {line.slope_ms:.3g} ±{slope_sd:.2g} ms "
                "a prompt token (± a bootstrap standard error), fitted at both ends")
        f = self.line_fit
        if f is None:
            return text + "."
        return (text + f"; the fitted profile gives {f['intercept_ms']:.3g} ±"
                f"{f['intercept_sd_ms']:.2g} ms + {f['slope_ms']:.3g} ±{f['slope_sd_ms']:.2g}"
                " ms.")


def pooled_trace(runs: list[BenchRun], seed: int = 0) -> AcceptanceTrace | None:
    """The acceptance trace of the speculative runs with the largest ``k``, their
    counters summed (one bench-serve-shaped file through the vLLM counters importer)."""
    spec = [r for r in runs if r.k]
    if not spec:
        return None
    k = max(r.k for r in spec)
    pool = [r for r in spec if r.k == k]
    drafts = sum(float(r.counters.get("spec_decode_num_drafts", 0)) for r in pool)
    if drafts <= 0:
        raise InputError(str(pool[0].path), "spec_decode_num_drafts is 0: no drafts to fit")
    rates = np.zeros(k)
    for r in pool:
        rates += np.asarray(r.counters["spec_decode_per_position_acceptance_rates"], float) \
            * float(r.counters["spec_decode_num_drafts"])
    accepted = sum(float(r.counters.get("spec_decode_accepted_tokens", 0)) for r in pool)
    doc = {"spec_decode_num_drafts": int(drafts),
           "spec_decode_per_position_acceptance_rates": (rates / drafts).tolist(),
           "spec_decode_accepted_tokens": int(accepted),
           "spec_decode_draft_tokens": int(sum(float(r.counters.get(
               "spec_decode_draft_tokens", 0)) for r in pool)),
           "spec_decode_acceptance_length": 1.0 + accepted / drafts,
           "completed": int(sum(len(r.output_tokens) for r in pool)),
           "total_output_tokens": int(sum(int(r.output_tokens.sum()) for r in pool))}
    from dspark_sim.traces.importers import import_vllm_counters, per_request_trace

    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "pooled-bench-serve.json"
        f.write_text(json.dumps(doc), encoding="utf-8")
        trace = import_vllm_counters(f, seed=seed, drafter=DRAFTER)
    names = ", ".join(r.name for r in pool)
    extra = {**trace.meta.extra, "pooled_runs": names}
    detailed = [r for r in pool if r.decode_steps is not None]
    if detailed:
        # each request's own acceptance, from the run that served the most of them, its
        # step counts scaled to the counters' request-steps (a chunk per step, give or
        # take the last)
        run = max(detailed, key=lambda r: len(r.output_tokens))
        steps = run.decode_steps * (_request_steps(run) / max(1, int(run.decode_steps.sum())))
        surv = np.asarray(trace.meta.generator["survival_per_step"], float)
        trace = per_request_trace(surv, run.output_tokens, np.maximum(1, np.round(steps)),
                                  seed=seed, drafter=DRAFTER, source=str(run.path),
                                  generator={"pooled_counters": trace.meta.generator})
        # the rows are the bench's own requests: with their lengths, `--lengths trace`
        # replays the deployment's traffic rather than a chat distribution
        trace = replace(trace, req_prompt_tokens=np.asarray(run.prompt_tokens, np.int64),
                        req_output_tokens=np.asarray(run.output_tokens, np.int64))
        extra |= {"request_rows_from": run.name,
                  "request_input_lens": [int(x) for x in run.prompt_tokens]}
    meta = replace(trace.meta, extra=extra)
    return replace(trace, meta=meta, source_path=f"<vllm counters of {names}>")


def _request_steps(run: BenchRun) -> int:
    c = run.counters
    return int(c["total_output_tokens"]) - int(c.get("spec_decode_accepted_tokens", 0)) \
        - int(c["completed"])


def paired_rows(run: BenchRun, trace: AcceptanceTrace) -> np.ndarray | None:
    """Request ``i`` of ``run`` replays trace row ``i`` when the trace's rows are the same
    prompts in the same order (``vllm bench serve`` samples a seeded dataset, so every
    load sends a prefix of one order: checked on the prompt lengths); else None (rows
    drawn at random, as in any simulation)."""
    lens = trace.meta.extra.get("request_input_lens")
    n = len(run.prompt_tokens)
    if not lens or n > len(lens) or list(run.prompt_tokens) != list(lens[:n]):
        return None
    return np.arange(n, dtype=np.int64)


def _initial_theta(runs: list[BenchRun], model: StepModel = StepModel(),
                   starts: dict[int, float] | None = None) -> np.ndarray:
    """A start from the none runs (TPOT at the smallest and largest concurrency, TTFT at
    the smallest): the fixed cost from the lightest load, the per-token slope from the
    TPOT's growth with the batch, split between tokens, requests and logit rows; each
    knot's step from its measured step (:func:`knot_starts`), less that split."""
    base = sorted((r for r in runs if r.k == 0 and r.concurrency), key=lambda r: r.concurrency)
    pool = base or [r for r in runs if r.concurrency] or runs
    lo, hi = pool[0], pool[-1]
    tpot_lo = lo.measured["median_tpot_ms"]
    c_lo, c_hi = lo.concurrency or 1, hi.concurrency or 1
    slope = (hi.measured["median_tpot_ms"] - tpot_lo) / max(1, c_hi - c_lo) \
        if c_hi > c_lo else 0.1 * tpot_lo
    slope = max(slope, 0.02 * tpot_lo)
    fixed = max(tpot_lo - slope * c_lo, 0.2 * tpot_lo)
    starts = starts or {}
    table = [max(starts.get(b, fixed + slope * b) - 0.5 * slope * b,
                 0.2 * starts.get(b, fixed + slope * b)) for b in model.knots] \
        if model.knots else [fixed]
    theta = [*table, 0.5 * slope, 0.3 * slope, 0.2 * slope, 0.05 * fixed]
    if any(r.k for r in runs):
        theta += [0.1 * fixed, 0.1 * slope]
    return np.array(theta)


def _candidate(theta: np.ndarray, name: str, model: StepModel, engine: EngineConfig
               ) -> EngineProfile:
    """The profile of a parameter vector, at the runs' scheduler limits."""
    return make_profile(theta, name=name, model=model,
                        max_batched_tokens=int(engine.max_num_batched_tokens),
                        limits=EngineLimits(max_num_seqs=engine.max_num_seqs,
                                            max_num_batched_tokens=engine.max_num_batched_tokens,
                                            kv_capacity_tokens=engine.kv_capacity_tokens,
                                            prefill="chunked"))


def profile_line(theta: np.ndarray, name: str, model: StepModel, engine: EngineConfig,
                 ends) -> np.ndarray:
    """``(slope, intercept)`` (ms) of the lone TTFT the profile of ``theta`` gives at the
    line's two ``ends`` (:func:`lone_ttft_ms`): what it charges a prompt token and a
    request, to hold against the measured line."""
    lo, hi = (int(x) for x in ends)
    v = lone_ttft_ms(_candidate(theta, name, model, engine), [lo, hi],
                     engine.max_num_batched_tokens)
    slope = (v[1] - v[0]) / (hi - lo)
    return np.array([slope, v[0] - slope * lo])


def _line_fit(fit: _Fit, cov: np.ndarray, name: str, engine: EngineConfig) -> dict:
    """The fitted profile's lone TTFT line (:func:`profile_line`) with the standard
    errors its constants' covariance (in ``log theta``) gives it, by the delta method."""
    theta = np.asarray(fit.theta, float)
    ends = fit.line.ends
    base = profile_line(theta, name, fit.model, engine, ends)
    h = 1e-4
    step = np.exp(h * np.eye(theta.size))  # row j: constant j a factor e^h up
    grad = np.column_stack([(profile_line(theta * step[j], name, fit.model, engine, ends)
                             - base) / h for j in range(theta.size)])
    sd = np.sqrt(np.maximum(np.diag(grad @ cov @ grad.T), 0.0))
    return {"slope_ms": float(base[0]), "slope_sd_ms": float(sd[0]),
            "intercept_ms": float(base[1]), "intercept_sd_ms": float(sd[1])}


class _Objective:
    """Residuals of the fitted runs for a parameter vector (log space), each run's
    workload written once."""

    def __init__(self, runs: list[BenchRun], trace: AcceptanceTrace | SettingTraces | None,
                 engine: EngineConfig, folder: Path, seed: int, name: str,
                 model: StepModel, steps: dict[int, float] | None = None,
                 line: TtftLine | None = None) -> None:
        self.runs, self.trace, self.engine, self.seed, self.name = runs, trace, engine, seed, name
        self.model = model
        self.steps = {b: v for b, v in (steps or {}).items() if b in model.knots}
        self.line = line
        self.files = [workload_file(r, folder) for r in runs]
        self.weights = np.sqrt(np.array([METRICS[m] for _ in runs for m in METRICS]))
        self.evaluations = 0

    def profile(self, theta: np.ndarray) -> EngineProfile:
        return _candidate(theta, self.name, self.model, self.engine)

    def simulated(self, theta: np.ndarray) -> list[dict[str, float]]:
        prof = self.profile(theta)
        self.evaluations += 1
        return [simulate_run(r, prof, self.trace, self.engine, f, self.seed)
                for r, f in zip(self.runs, self.files, strict=True)]

    def residuals(self, log_theta: np.ndarray) -> np.ndarray:
        theta = np.exp(log_theta)
        sims = self.simulated(theta)
        res = np.array([math.log(s[m] / r.measured[m]) if s[m] > 0 else math.nan
                        for r, s in zip(self.runs, sims, strict=True) for m in METRICS])
        res = np.nan_to_num(res, nan=UNSIMULATED) * self.weights
        prof = self.profile(theta)
        parts = [res]
        if self.steps:
            # each tabled batch's decode step against its measured median token gap,
            # after the points' residuals (the constants' uncertainty reads the points'
            # first)
            batch = np.array(list(self.steps), np.int64)
            step_ms = 1e3 * (prof.target_time_s(batch)
                             + (prof.request_s + prof.logits_s_per_row) * batch)
            parts.append(math.sqrt(STEP_WEIGHT) * np.log(
                step_ms / np.array(list(self.steps.values()))))
        if self.line is not None:
            # a lone request's TTFT at the line's two ends, last (the constants'
            # uncertainty bootstraps the lone requests for these)
            ends = self.line.ends
            sim = lone_ttft_ms(prof, ends, self.engine.max_num_batched_tokens)
            parts.append(math.sqrt(LINE_WEIGHT) * np.log(sim / self.line.at(ends)))
        return np.concatenate(parts)


def levenberg_marquardt(fun, x0: np.ndarray, *, max_iterations: int = 12,
                        step: float = 0.05, tol: float = 1e-4
                        ) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """Minimise ``|fun(x)|^2`` with a forward-difference Jacobian: a maintained solver
    (scipy's least_squares) would add a dependency for this one ~20-evaluation fit.
    Returns ``x``, the iterations, and the residuals and Jacobian of the last iterate
    (for the constants' uncertainty; the Jacobian of the iterate before a final small
    step, which saves a whole extra round of simulations)."""
    x = np.asarray(x0, float)
    r = fun(x)
    lam = 1e-2
    jac = np.zeros((r.size, x.size))
    for it in range(1, max_iterations + 1):
        jac = np.empty((r.size, x.size))
        for j in range(x.size):
            dx = np.zeros_like(x)
            dx[j] = step
            jac[:, j] = (fun(x + dx) - r) / step
        g = jac.T @ r
        h = jac.T @ jac
        improved = False
        while lam < 1e6:
            delta = np.linalg.solve(h + lam * np.diag(np.diag(h) + 1e-9), -g)
            delta = np.clip(delta, -MAX_LOG_STEP, MAX_LOG_STEP)
            r_new = fun(x + delta)
            if r_new @ r_new < r @ r:
                gain = r @ r - r_new @ r_new
                x, r, lam, improved = x + delta, r_new, max(lam / 3, 1e-6), True
                break
            lam *= 4
        if not improved or gain < tol * max(r @ r, 1e-12) or np.abs(delta).max() < 1e-3:
            return x, it, r, jac
    return x, max_iterations, r, jac


@dataclass(frozen=True, eq=False)
class _Fit:
    model: StepModel
    theta: np.ndarray
    sims: list[dict[str, float]]
    res: np.ndarray
    jac: np.ndarray
    iterations: int
    evaluations: int
    profile: EngineProfile
    steps: dict[int, float]  # the measured decode steps it was fitted to (ms by batch)
    line: TtftLine | None = None  # the lone requests' TTFT line it was fitted to


def _fit(runs: list[BenchRun], traces: SettingTraces, engine: EngineConfig, folder: Path,
         seed: int, name: str, model: StepModel, max_iterations: int,
         starts: dict[int, float] | None = None, steps: dict[int, float] | None = None,
         line: TtftLine | None = None) -> _Fit:
    obj = _Objective(runs, traces, engine, folder, seed, name, model, steps, line)
    log_theta, its, res, jac = levenberg_marquardt(
        obj.residuals, np.log(_initial_theta(runs, model, starts)),
        max_iterations=max_iterations)
    theta = np.exp(log_theta)
    sims = obj.simulated(theta)
    return _Fit(model, theta, sims, res, jac, its, obj.evaluations, obj.profile(theta),
                 obj.steps, obj.line)


def _linear_misses(fit: _Fit, points: list) -> bool:
    """Whether the linear step model misses a repeated none closed-loop point's median
    TPOT (its decode step) by more than :data:`NOISE_MULTIPLE` times the point's own
    spread: a miss no noise explains, so the step time is not linear in the batch."""
    for p, sim in zip(points, fit.sims, strict=True):
        r = p.run
        if r.k or not r.concurrency or p.repeats < 3 or not sim["median_tpot_ms"] > 0:
            continue
        miss = abs(math.log(sim["median_tpot_ms"] / r.measured["median_tpot_ms"]))
        if miss > NOISE_MULTIPLE * max(p.spread("median_tpot_ms") or 0.0, MIN_SPREAD):
            return True
    return False


def _gap_misses(repeats: list[BenchRun], model: StepModel) -> bool:
    """Whether the none runs' decode steps, measured directly, are not linear in the
    batch: at each knot, each round's median token gap (:func:`decode_gaps`, thousands
    a round, so what scatters them across rounds is the host's drift), their median over
    the rounds against the least-squares line through those medians (the decode step a
    linear step can price), a miss beyond :data:`NOISE_MULTIPLE` times the rounds'
    spread at that knot (or :data:`MIN_SPREAD`). Needs three rounds at three knots or
    more; False without them (single runs, runs without timings)."""
    per: dict[int, dict[int, list[np.ndarray]]] = {}
    for r in repeats:
        if r.round is None:
            continue
        for b, g in decode_gaps(r).items():
            if b in model.knots:
                per.setdefault(b, {}).setdefault(r.round, []).append(g)
    knots, medians, spreads = [], [], []
    for b in model.knots:
        rounds = per.get(b, {})
        if len(rounds) < 3:
            continue
        m = np.array([np.median(np.concatenate(g)) for g in rounds.values()])
        knots.append(b)
        medians.append(float(np.median(m)))
        spreads.append(relative_half_range(m))
    if len(knots) < 3:
        return False
    x, y = np.array(knots, float), np.array(medians)
    slope, intercept = np.polyfit(x, y, 1)
    line = np.maximum(intercept + slope * x, 1e-9 * y)
    miss = np.abs(np.log(line / y))
    return bool((miss > NOISE_MULTIPLE * np.maximum(spreads, MIN_SPREAD)).any())


def fit_profile(runs: list[BenchRun], *, engine: EngineConfig, name: str = "vllm-fitted",
                seed: int = 0, trace: AcceptanceTrace | None = None,
                traces: SettingTraces | None = None, max_iterations: int = 12,
                step_table: str = "auto") -> FitResult:
    """Fit the step-cost parameters to ``runs`` (see the module docstring). Repeats of a
    point (the same setting and load) are fitted as one point at the median of each
    figure (:mod:`dspark_sim.validation.vllm_repeats`: robust to a disturbed repeat, and
    one simulation per point); the repeats set the constants' uncertainty. Acceptance:
    ``trace`` for every ``k`` when given, else ``traces`` (default: each setting's
    measured trace, else the runs' pooled counters, :func:`setting_traces`).
    ``step_table``: ``by-batch`` fits a step time at each batch size a none run decodes
    (:func:`step_model`), ``linear`` one fixed cost and one per token, ``auto`` (the
    default) the table only where the repeats show the step is not linear in the batch:
    the none runs' token gaps, round by round, miss a line (:func:`_gap_misses`), or
    the linear fit misses a none point's TPOT (:func:`_linear_misses`), by more than
    the rounds explain; with single runs the per-batch steps would fit each run's noise.
    The none runs' lone requests' TTFT line (:func:`ttft_line`) is fitted too where they
    support it, and its bootstrap widens the constants' uncertainty."""
    if not runs:
        raise InputError("FILES", "no runs to fit")
    if step_table not in STEP_TABLES:
        raise InputError("--step-table", f"must be one of {', '.join(STEP_TABLES)}, "
                                         f"not {step_table!r}")
    points = group_points(runs)
    if trace is not None:
        traces = SettingTraces(pooled=trace)
    elif traces is None:
        traces = setting_traces(runs, runs, seed)
    headline_trace = traces.headline(runs)
    runs = [p.run for p in points]
    repeats = [r for p in points for r in p.runs]
    table = step_model(repeats, engine.max_num_batched_tokens)
    starts = knot_starts(repeats, table)
    measured_steps = measured_decode_steps(repeats, table)
    line = ttft_line(repeats, seed)
    fitted_line = None if line.unused else line
    with tempfile.TemporaryDirectory() as tmp:
        def fit_with(model: StepModel) -> _Fit:
            return _fit(runs, traces, engine, Path(tmp), seed, name, model, max_iterations,
                        starts, measured_steps, fitted_line)

        if step_table == "by-batch" or (step_table == "auto" and table.knots
                                        and _gap_misses(repeats, table)):
            fit = fit_with(table)
        else:
            fit = fit_with(StepModel())
            if step_table == "auto" and table.knots and _linear_misses(fit, points):
                fit = fit_with(table)
    model, theta, sims, res, jac = fit.model, fit.theta, fit.sims, fit.res, fit.jac
    its = fit.iterations
    names = model.names[:len(theta)]
    tail = None if fitted_line is None else math.sqrt(LINE_WEIGHT) * fitted_line.shifts(
        BOOTSTRAP_SAMPLES, seed)
    unc = constant_uncertainty(jac, res, theta, names, points, METRICS, seed, tail)
    line_fit = None if fitted_line is None else _line_fit(
        fit, log_covariance(jac, res, points, METRICS, seed, tail)[0], name, engine)
    residuals = [{"run": r.name, "file": r.path.name, "metric": m,
                  "measured": r.measured[m], "simulated": s[m],
                  "error": s[m] / r.measured[m] - 1.0, "repeats": p.repeats,
                  "spread": p.spread(m)}
                 for p, r, s in zip(points, runs, sims, strict=True) for m in METRICS]
    params = {"fitted_runs": [r.name for r in runs],
              **{f"fit_{p}": round(float(v), 6) for p, v in zip(names, theta, strict=True)},
              "fit_worst_relative_error": round(max(abs(x["error"]) for x in residuals), 6),
              "fit_evaluations": fit.evaluations}
    if fitted_line is not None:
        params |= {"fit_lone_requests": fitted_line.requests,
                   "fit_lone_ttft_slope_ms": round(fitted_line.slope_ms, 6),
                   "fit_lone_ttft_intercept_ms": round(fitted_line.intercept_ms, 6)}
    profile = fit.profile
    profile = replace(profile, parameters={**profile.parameters, **params},
                      source=f"<fit {name}>")
    return FitResult(profile, headline_trace,
                     dict(zip(names, map(float, theta), strict=True)),
                     residuals, its, engine, unc, len(points), traces,
                     len(fit.steps), line, line_fit)
