"""Per-request and per-run metrics, under vLLM ``bench serve`` names where one exists.

Definitions (stated because sources differ: vLLM, InferenceX/AIPerf and the DSpark
paper each define some of them their own way):

* TPOT = (E2E - TTFT) / (output_tokens - 1) (vLLM); interactivity = 1000 / TPOT_ms
  tokens/s/user (InferenceX, AIPerf).
* ITL = time between successive token-emitting steps of a request (a speculative
  step emits several tokens at once, as vLLM's streamed chunks do).
* ``spec_decode_acceptance_length`` = 1 + accepted / drafts, tau per proposal (vLLM: a
  draft is a request-step whose drafter proposed, so an n-gram drafter's steps without
  a match do not count; includes the
  bonus token, = DSpark's tau; a lossy policy that skips the verifier adds the drafts
  it committed unjudged); ``tokens_per_request_step`` = 1 + accepted / request-steps,
  tau per request-step, every decoding step of every request counted (what a step
  without a proposal serves: one token). The two agree when the drafter proposes at
  every step; each ``steady_`` twin holds the same definition over the window;
  ``acceptance_per_position[k]`` is vLLM's *unconditional*
  ``num_accepted_tokens_per_pos / num_drafts``. Accepted tokens are the verifier's:
  never more than it verified.
* ``mean_verify_tokens_per_request_step`` counts the bonus slot, so MTP-1 is 2
  (DSpark Fig. 8's "verification budget").
* ``verification_waste`` = rejected draft tokens / verified draft tokens.
* Whole-run throughputs are over the benchmark duration: first arrival to last
  completion (vLLM ``bench serve``).
* ``*_per_gpu`` divides by the decode GPUs (``num_gpus`` = replicas x
  ``gpus_per_replica``: what the policies run on, and what the fronts compare); with
  disaggregated prefill ``*_per_gpu_incl_prefill`` divides by those and the prefill
  instances' GPUs (``num_prefill_gpus``) together.

Steady state (the ``steady_*`` fields)
--------------------------------------

Whole-run figures mix three regimes: *warm-up* (the system starts empty; a closed
loop starts all its clients at once, so the first cohort prefills together and
decodes in lockstep), the *steady state*, and the *drain* (no new requests, the batch
empties, steps get cheaper and throughput falls). Their weights depend on the request
count, so whole-run figures move with ``--num-requests`` (``none`` at 1,024 clients
rises 11 % from 8xC to 32xC requests). The steady-state window
``[start_s, end_s]`` excludes both ends:

* **end** = the *drain start*: the time of the last request's arrival. Open loop
  (Poisson, gamma, replay) this is the last arrival; closed loop it is the moment the
  last request is issued (the (N-C)-th completion), after which the client count only
  falls. Both are ``max(arrival_s)``.
* **start** = the later of two warm-up ends, each found on ``[0, end]`` cut into ``K``
  equal time bins (``K`` = steps/10 clipped to 4..200; per bin the time-averaged decode
  batch, summed over replicas, and the output tokens per second):

  - *fill*: the end of the first bin whose decode batch reaches 90 % of the *steady
    occupancy*, the median bin over the second half of ``[0, end]`` (what "the system
    has filled" / "the batch first reaches its steady occupancy" means, for both
    loops; 90 %, the usual settling band, because a noisy stationary batch crosses its
    own median only at random: at 200 req/s the median is first reached after half
    the run);
  - *MSER*: the truncation point that minimises the marginal standard error of the
    binned output throughput, ``d* = argmin_{d <= K/2} sum_{i>=d}(z_i - mean)^2 /
    (K-d)^2`` (White 1997; MSER-5 is the best of the automatic warm-up rules compared by
    Hoad, Robinson & Davies 2010). It catches transients that outlast the fill, such as
    the closed loop's lockstep first cohort.

* **figures over the window**: throughputs count the tokens of steps ending in the
  window and the requests completing in it, divided by its length; tau, verify tokens
  per request-step and waste sum the window's steps; latencies (TTFT, TPOT, E2E,
  interactivity) are over the requests *arriving* in ``[start, end - H]``, whatever
  their finish time, where ``H`` is the p99 lifetime (E2E) of the requests arriving in
  the window. Selecting by arrival does not favour short requests (selecting those that
  also *finish* in the window would: a request of lifetime ``E`` would be kept with
  odds ``(W - E) / W``, and E2E percentiles came out 2-4 % low); stopping arrivals ``H``
  before the drain keeps all but the 1 % longest requests clear of it, and those only
  for their last part. The window is flagged **short** (``steady_window_short``) when it
  spans fewer than ``MIN_WINDOW_LIFETIMES`` p90 lifetimes or the latency sample holds
  fewer than ``MIN_WINDOW_REQUESTS`` requests: run more requests (sweeps: ``Sizing``).
* **stability** (:func:`stability_verdict`, stated in ``stability_note``): over the
  window, the requests in the system (arrived, not finished) must not grow. The run is
  unstable when their least-squares growth across the window, or the window's arrivals
  less its completions, exceeds ``STABLE_SLACK + STABLE_FRACTION`` (10 + 2 %) of the
  window's arrivals; or requests were left unfinished at the horizon; or none completed
  (all refused at arrival: a run that served nothing shows nothing about keeping up). A
  closed loop holds ``C`` requests in the system by construction, so it is stable unless
  requests are unfinished.
* **precision**: ``steady_output_throughput_rse`` and ``steady_median_interactivity_rse``
  are relative standard errors by batch means (the window cut into ``RSE_BATCHES`` equal
  spans, the latency sample into as many arrival-ordered groups; SE = sd of the batch
  figures / sqrt(batches)), which keeps the serial correlation of a queue's output out
  of the error bar. Sweeps can size points until they fall below a target.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass

import numpy as np

from dspark_sim.io import LazyModule
from dspark_sim.sim.engine import ITL_EDGES_S, REJECT_REASONS, STEP_FIELDS, RequestLog, StepStats

pl = LazyModule("polars")  # imported when a frame is built: a run writing no files needs none

# The window is "short" below either bound (see the module docstring).
MIN_WINDOW_LIFETIMES = 10.0  # window length in p90 request lifetimes (E2E)
MIN_WINDOW_REQUESTS = 100  # requests in the latency sample
MAX_WINDOW_BINS = 200
RSE_BATCHES = 20  # batch means for the steady figures' relative standard errors
FILL_FRACTION = 0.9  # "filled": the decode batch within 10 % of its steady occupancy
# A run keeps up when neither the least-squares growth of the requests in the system
# across the steady window nor its arrivals less its completions exceed STABLE_SLACK +
# STABLE_FRACTION x its arrivals. The slack absorbs the count's own noise on a small
# window; 2 % is a trend no run well below capacity showed over its window (the largest
# seen on the defaults: 0.7 of it), while a saturated one exceeds it (no speculation at
# 200 req/s: every seat full, +5.8 requests/s, 3 % of its arrivals).
STABLE_SLACK = 10
STABLE_FRACTION = 0.02


def requests_frame(log: RequestLog, first_id: int = 0) -> pl.DataFrame:
    """requests.parquet's rows; ``first_id``: the id of the log's first request (a
    streamed run's chunk, ``sim.stream``)."""
    finished = ~np.isnan(log.finish_s)
    ttft = log.first_token_s - log.arrival_s
    e2e = log.finish_s - log.arrival_s
    n = log.generated
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(n > 1, (e2e - ttft) / np.maximum(n - 1, 1), np.nan)
        inter = np.where(tpot > 0, 1.0 / tpot, np.nan)
    return pl.DataFrame({
        "request_id": np.arange(first_id, first_id + len(n), dtype=np.int64),
        "replica": log.replica,
        "arrival_s": log.arrival_s,
        "prompt_tokens": log.prompt_tokens,
        "output_tokens": log.output_tokens,
        "generated_tokens": n,
        "finished": finished,
        "ttft_ms": ttft * 1e3,
        "tpot_ms": tpot * 1e3,
        "e2e_ms": e2e * 1e3,
        "interactivity_tok_s": inter,
        # exact event times (the ms columns are differences): window membership needs them
        "first_token_s": log.first_token_s,
        "finish_s": log.finish_s,
        "steps": log.steps,
        "draft_tokens_verified": log.draft_tokens_verified,
        "accepted_tokens": log.accepted_tokens,
        "preemptions": log.preemptions,
        "trace_row": log.trace_row,
        "rejected_reason": pl.Series([REJECT_REASONS.get(int(c)) for c in log.rejected],
                                     dtype=pl.String),
        "changed_tokens": log.changed_tokens,
        # with the prefix cache only: a run without it writes the table it always wrote
        **({} if log.cached_prompt_tokens is None
           else {"cached_prompt_tokens": log.cached_prompt_tokens}),
    }).with_columns(
        pl.col(c).fill_nan(None) for c in ("ttft_ms", "tpot_ms", "e2e_ms", "interactivity_tok_s",
                                           "first_token_s", "finish_s")
    )


# Each latency sample's summary fields, spelled out (not built from prefixes) so that
# grepping a field name finds where it is computed: (mean, median, p90, p99).
LATENCY_FIELDS = {
    "ttft_ms": ("mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms"),
    "tpot_ms": ("mean_tpot_ms", "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms"),
    "e2el_ms": ("mean_e2el_ms", "median_e2el_ms", "p90_e2el_ms", "p99_e2el_ms"),
}
STEADY_LATENCY_FIELDS = {
    "ttft_ms": ("steady_mean_ttft_ms", "steady_median_ttft_ms", "steady_p90_ttft_ms",
                "steady_p99_ttft_ms"),
    "tpot_ms": ("steady_mean_tpot_ms", "steady_median_tpot_ms", "steady_p90_tpot_ms",
                "steady_p99_tpot_ms"),
    "e2el_ms": ("steady_mean_e2el_ms", "steady_median_e2el_ms", "steady_p90_e2el_ms",
                "steady_p99_e2el_ms"),
}
# (median, p90, p10) of tokens/s per user: p10 is the slow tail, interactivity being a rate
INTERACTIVITY_FIELDS = ("median_interactivity", "p90_interactivity", "p10_interactivity")
STEADY_INTERACTIVITY_FIELDS = ("steady_median_interactivity", "steady_p90_interactivity",
                               "steady_p10_interactivity")


def _stats(names: tuple[str, str, str, str], v: np.ndarray) -> dict[str, float | None]:
    """The finite values of ``v``: ``names`` = (mean, median, p90, p99) fields."""
    finite = np.isfinite(v)
    # the order statistics partition the finite values in place where they are a copy
    # already (not ``v``, which the caller reads on), sparing a streamed day's summary a
    # copy of its largest samples; the mean, which summation order changes, comes first
    own = not finite.all()
    if own:
        v = v[finite]
    del finite
    if v.size == 0:
        return dict.fromkeys(names)
    values = (v.mean(), np.median(v, overwrite_input=own),
              np.percentile(v, 90, overwrite_input=own),
              np.percentile(v, 99, overwrite_input=own))
    return {name: float(x) for name, x in zip(names, values, strict=True)}


# -- steady state -------------------------------------------------------------------------
class StepSeries:
    """The engine's per-step series (``sim.engine.STEP_FIELDS``), one entry per step of
    any replica, in completion order. Build from the recorder with :meth:`from_columns`
    or by hand with :meth:`of` (missing fields are zeros; ``drafting_requests`` the
    ``decode_batch``). Each field reads as float64; the columns are kept as given (the
    recorder's counts as int32) and converted on each read, so a field no figure reads
    never costs its float64 copy."""

    __slots__ = ("_cols",)

    def __init__(self, **cols: np.ndarray) -> None:
        if set(cols) != set(STEP_FIELDS):
            raise TypeError(f"step fields: {', '.join(sorted(set(cols) ^ set(STEP_FIELDS)))}")
        object.__setattr__(self, "_cols", cols)

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            col = object.__getattribute__(self, "_cols")[name]
        except KeyError:
            raise AttributeError(name) from None
        return np.asarray(col, dtype=np.float64)

    def __setattr__(self, name: str, value) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    @classmethod
    def from_columns(cls, cols: dict[str, np.ndarray]) -> StepSeries:
        return cls(**{f: cols[f] for f in STEP_FIELDS})

    @classmethod
    def of(cls, end_s, dt_s, **cols) -> StepSeries:
        end = np.asarray(end_s, dtype=np.float64)
        dt = np.broadcast_to(np.asarray(dt_s, dtype=np.float64), end.shape)
        out = {"end_s": end, "dt_s": dt}
        # every decoding row drafts unless told otherwise
        cols.setdefault("drafting_requests", cols.get("decode_batch", 0.0))
        for f in STEP_FIELDS[2:]:
            v = cols.pop(f, 0.0)
            out[f] = np.broadcast_to(np.asarray(v, dtype=np.float64), end.shape)
        if cols:
            raise TypeError(f"unknown step fields: {', '.join(cols)}")
        return cls(**out)

    def __len__(self) -> int:
        return len(self._cols["end_s"])

    def __reduce__(self):
        return _step_series, (self._cols,)


def _step_series(cols: dict[str, np.ndarray]) -> StepSeries:
    return StepSeries(**cols)


@dataclass(frozen=True)
class SteadyWindow:
    start_s: float
    end_s: float
    drain_start_s: float  # last arrival / last request issued
    fill_s: float | None  # warm-up end by occupancy
    mser_s: float | None  # warm-up end by MSER on the throughput bins
    occupancy: float | None  # steady decode batch (all replicas)
    bins: int
    rule: str

    @property
    def duration_s(self) -> float:
        return max(0.0, self.end_s - self.start_s)


def mser_truncation(z: np.ndarray) -> int:
    """MSER (White 1997): the ``d`` in ``0..len(z)//2`` minimising
    ``sum_{i>=d} (z_i - mean(z[d:]))^2 / (n - d)^2``; the smallest on ties."""
    z = np.asarray(z, dtype=np.float64)
    n = z.size
    if n < 2:
        return 0
    s1 = np.cumsum(z[::-1])[::-1]  # suffix sums
    s2 = np.cumsum((z * z)[::-1])[::-1]
    d = np.arange(n // 2 + 1)
    m = n - d
    sse = np.maximum(s2[d] - s1[d] ** 2 / m, 0.0)
    crit = sse / m.astype(np.float64) ** 2
    # ties (a flat series) within rounding go to the smallest truncation
    scale = float(np.max(crit)) if crit.size else 0.0
    return int(np.flatnonzero(crit <= crit.min() + 1e-12 * max(scale, 1e-300))[0])


def steady_window(steps: StepSeries, arrival_s: np.ndarray, *, closed: bool) -> SteadyWindow:
    """The steady-state window of a run (rule in the module docstring)."""
    arr = np.asarray(arrival_s, dtype=np.float64)
    arr = arr[np.isfinite(arr)]
    t_d = float(arr.max()) if arr.size else 0.0
    loop = "closed loop" if closed else "open loop"
    end_text = ("last request issued" if closed else "last arrival") + f" at {t_d:.3f} s"
    sel = steps.end_s <= t_d
    n_sel = int(sel.sum())
    if t_d <= 0 or n_sel < 8:
        why = ("all requests were issued at once (num_requests <= concurrency)" if closed
               and t_d <= 0 else f"only {n_sel} engine steps before the {end_text}")
        return SteadyWindow(t_d, t_d, t_d, None, None, None, 0,
                            f"{loop}: no steady state ({why})")
    k = int(np.clip(n_sel // 10, 4, MAX_WINDOW_BINS))
    width = t_d / k
    b = np.minimum((steps.end_s[sel] / width).astype(np.int64), k - 1)
    thr = np.bincount(b, steps.emitted_tokens[sel], k) / width
    occ = np.bincount(b, steps.decode_batch[sel] * steps.dt_s[sel], k) / width
    level = float(np.median(occ[k // 2:]))
    j = int(np.argmax(occ >= FILL_FRACTION * level))
    fill = (j + 1) * width
    mser = mser_truncation(thr) * width
    start = min(max(fill, mser), t_d)
    rule = (f"{loop}: from the later of fill (the decode batch first reaches "
            f"{FILL_FRACTION * 100:.0f} % of its steady level of {level:.1f} requests, "
            f"at {fill:.3f} s) and MSER on {k} output-throughput bins (cut at {mser:.3f} s) "
            f"to the drain start ({end_text})")
    return SteadyWindow(start, t_d, t_d, fill, mser, level, k, rule)


def in_system(arrival_s: np.ndarray, finish_s: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Requests arrived and not finished at each time ``t`` (a request finishing at
    ``t`` has left)."""
    a = np.sort(arrival_s[np.isfinite(arrival_s)])
    f = np.sort(finish_s[np.isfinite(finish_s)])
    return (np.searchsorted(a, t, side="right") - np.searchsorted(f, t, side="right")).astype(
        np.float64)


def mean_in_system(arrival_s: np.ndarray, finish_s: np.ndarray, t0: float, t1: float) -> float:
    """Time-average of :func:`in_system` over ``[t0, t1]`` (each request's overlap with
    the window; unfinished requests stay to the end)."""
    if t1 <= t0:
        return float("nan")
    a = arrival_s[np.isfinite(arrival_s)]
    f = np.where(np.isfinite(finish_s), finish_s, np.inf)[np.isfinite(arrival_s)]
    overlap = np.clip(np.minimum(f, t1) - np.maximum(a, t0), 0.0, None)
    return float(overlap.sum() / (t1 - t0))


def queue_growth(arrival_s: np.ndarray, finish_s: np.ndarray, t0: float, t1: float,
                 samples: int = 200) -> float:
    """Least-squares slope (requests/s) of the requests in the system over ``[t0, t1]``."""
    if t1 <= t0:
        return 0.0
    t = np.linspace(t0, t1, samples)
    return float(np.polyfit(t, in_system(arrival_s, finish_s, t), 1)[0])


def _latencies(log: RequestLog, mask: np.ndarray) -> dict[str, np.ndarray]:
    # in place where the operation allows it (the same operations on the same values):
    # a streamed day's summary has its peak here, with every request's samples
    ttft = log.first_token_s[mask]
    ttft -= log.arrival_s[mask]
    ttft *= 1e3
    e2e = log.finish_s[mask]
    e2e -= log.arrival_s[mask]
    e2e *= 1e3
    n = log.generated[mask]
    tpot = np.full(n.size, np.nan)
    multi = n > 1
    per = e2e[multi]
    per -= ttft[multi]
    per /= n[multi] - 1
    tpot[multi] = per
    del per, n, multi
    with np.errstate(divide="ignore"):
        inter = np.where(tpot > 0, 1000.0 / tpot, np.nan)
    return {"ttft_ms": ttft, "tpot_ms": tpot, "e2el_ms": e2e, "interactivity": inter}


def _interactivity(names: tuple[str, str, str], inter: np.ndarray) -> dict[str, float | None]:
    """The finite interactivities: ``names`` = (median, p90, p10) fields."""
    fi = inter[np.isfinite(inter)]  # a copy: partitioned in place by each statistic
    if fi.size == 0:
        return dict.fromkeys(names)
    values = (np.median(fi, overwrite_input=True), np.percentile(fi, 90, overwrite_input=True),
              np.percentile(fi, 10, overwrite_input=True))
    return {name: float(x) for name, x in zip(names, values, strict=True)}


def _steady_step_figures(steps: StepSeries, in_win: np.ndarray) -> dict:
    """The ``steady_*`` figures of the steps ending in the window: acceptance, verify
    and draft tokens per request-step, waste, mean batch and step time."""
    rs = float(steps.decode_batch[in_win].sum())
    ver = float(steps.verified_drafts[in_win].sum())
    acc = float(steps.accepted_tokens[in_win].sum())
    committed = acc + float(steps.unverified_tokens[in_win].sum())
    drafts = float(steps.drafting_requests[in_win].sum())
    n_steps = int(in_win.sum())
    return {
        "steady_spec_decode_acceptance_length": 1.0 + committed / drafts if drafts else None,
        "steady_tokens_per_request_step": 1.0 + committed / rs if rs else None,
        "steady_mean_verify_tokens_per_request_step": (rs + ver) / rs if rs else None,
        "steady_mean_draft_tokens_per_request_step": ver / rs if rs else None,
        "steady_verification_waste": (ver - acc) / ver if ver else (0.0 if rs else None),
        "steady_mean_decode_batch": rs / n_steps if n_steps else None,
        "steady_mean_step_ms": float(steps.dt_s[in_win].mean()) * 1e3 if n_steps else None,
        "steady_mean_batch_tokens": (float(steps.batch_tokens[in_win].mean())
                                     if n_steps else None),
    }


def steady_state(log: RequestLog, steps: StepSeries, window: SteadyWindow, *,
                 gpus: int, prefill_gpus: int | None = None) -> dict:
    """The ``steady_*`` fields over ``window`` (definitions in the module docstring)."""
    t0, t1 = window.start_s, window.end_s
    w = window.duration_s
    s: dict = {
        "steady_window_start_s": t0,
        "steady_window_end_s": t1,
        "steady_window_s": w,
        "steady_window_rule": window.rule,
        "steady_window_fill_s": window.fill_s,
        "steady_window_mser_s": window.mser_s,
        "steady_occupancy": window.occupancy,
    }
    in_win = (steps.end_s > t0) & (steps.end_s <= t1)
    fin = np.isfinite(log.finish_s)
    # lifetimes of the requests arriving in the window (finished at all): the yardsticks
    # for the latency cut-off (p99) and for "short" (p90)
    came = fin & (log.arrival_s >= t0) & (log.arrival_s <= t1)
    life_s = (log.finish_s - log.arrival_s)[came]
    p90_life_s = float(np.percentile(life_s, 90)) if life_s.size else None
    cutoff = t1 - float(np.percentile(life_s, 99)) if life_s.size else None
    del life_s
    if cutoff is not None and cutoff < t0:
        cutoff = None  # the window is shorter than a p99 lifetime: no latency sample
    # None, not a time before the window (it came out negative on short closed loops)
    s["steady_latency_arrivals_end_s"] = cutoff
    lived = (came & (log.arrival_s <= cutoff)) if cutoff is not None else np.zeros_like(fin)
    done_in = fin & (log.finish_s > t0) & (log.finish_s <= t1)
    s["steady_window_steps"] = int(in_win.sum())
    s["steady_window_requests"] = int(lived.sum())
    s["steady_window_completions"] = int(done_in.sum())
    lat = _latencies(log, lived)
    ok = w > 0 and in_win.any()
    tokens = float(steps.emitted_tokens[in_win].sum())
    s["steady_request_throughput"] = done_in.sum() / w if ok else None
    s["steady_output_throughput"] = tokens / w if ok else None
    s["steady_output_throughput_per_gpu"] = tokens / w / gpus if ok else None
    if prefill_gpus is not None:
        s["steady_output_throughput_per_gpu_incl_prefill"] = \
            tokens / w / (gpus + prefill_gpus) if ok else None
    for sample, names in STEADY_LATENCY_FIELDS.items():
        s |= _stats(names, lat[sample])
    inter = lat["interactivity"]
    del lat  # only the interactivities are read on (a streamed day's summary's peak)
    s |= _interactivity(STEADY_INTERACTIVITY_FIELDS, inter)
    s |= _steady_step_figures(steps, in_win)
    s["steady_mean_running"] = (float((steps.running * steps.dt_s)[in_win].sum()) / w
                                if ok else None)
    s["steady_mean_in_system"] = mean_in_system(log.arrival_s, log.finish_s, t0, t1) if ok \
        else None
    notes = []
    if not ok:
        notes.append(window.rule.split(": ", 1)[-1])
    else:
        if p90_life_s is not None and w < MIN_WINDOW_LIFETIMES * p90_life_s:
            notes.append(f"window {w:.2f} s is under {MIN_WINDOW_LIFETIMES:g} p90 request "
                         f"lifetimes ({p90_life_s:.2f} s)")
        if lived.sum() < MIN_WINDOW_REQUESTS:
            notes.append(f"{int(lived.sum())} requests in the latency sample "
                         f"(< {MIN_WINDOW_REQUESTS})")
    s["steady_output_throughput_rse"] = (
        _rse_throughput(steps, t0, t1) if ok else None)
    s["steady_median_interactivity_rse"] = _rse_median(inter, log.arrival_s[lived])
    s["steady_window_short"] = bool(notes)
    s["steady_window_note"] = "; ".join(notes) + ": run more requests" if notes else None
    return s


def _rse_throughput(steps: StepSeries, t0: float, t1: float,
                    batches: int = RSE_BATCHES) -> float | None:
    """Batch-means relative standard error of the output rate over ``(t0, t1]``."""
    sel = (steps.end_s > t0) & (steps.end_s <= t1)
    if t1 <= t0 or sel.sum() < 5 * batches:
        return None
    k = np.minimum(((steps.end_s[sel] - t0) / (t1 - t0) * batches).astype(np.int64),
                   batches - 1)
    rate = np.bincount(k, steps.emitted_tokens[sel], batches)
    mean = rate.mean()
    return float(rate.std(ddof=1) / np.sqrt(batches) / mean) if mean > 0 else None


def _rse_median(values: np.ndarray, order_by: np.ndarray,
                batches: int = RSE_BATCHES) -> float | None:
    """Batch-medians relative standard error of the median of ``values`` (groups of
    consecutive requests in ``order_by`` order; non-finite values dropped)."""
    ok = np.isfinite(values)
    v, keys = values[ok], order_by[ok]
    del ok
    # requests already in arrival order (an open loop's): the stable sort would leave
    # them as they are, and costs a streamed day's summary two sample-sized arrays
    if not (keys[1:] >= keys[:-1]).all():
        v = v[np.argsort(keys, kind="stable")]
    del keys
    if v.size < 5 * batches:
        return None
    groups = np.array([np.median(g) for g in np.array_split(v, batches)])
    med = float(np.median(v, overwrite_input=True))  # v is a copy, its groups taken
    return float(groups.std(ddof=1) / np.sqrt(batches) / med) if med > 0 else None


def _hist_percentile(hist: np.ndarray, q: float) -> float | None:
    total = hist.sum()
    if total == 0:
        return None
    k = int(np.searchsorted(np.cumsum(hist), q / 100.0 * total))
    k = min(max(k, 1), len(ITL_EDGES_S) - 1)
    return float(np.sqrt(ITL_EDGES_S[k - 1] * ITL_EDGES_S[k]))  # geometric bin centre


def summarize(
    log: RequestLog,
    stats: StepStats,
    *,
    gpus: int,
    prefill_gpus: int | None = None,
    slo_ttft_ms: float | None,
    slo_tpot_ms: float | None,
    stable: bool | None = None,
    queue_growth_per_s: float | None = None,
    steps: StepSeries | None = None,
    closed: bool = False,
) -> dict:
    """Whole-run figures, and with ``steps`` (the engine's per-step series) the
    ``steady_*`` figures and the stability verdict over the steady window. ``stable`` /
    ``queue_growth_per_s`` given explicitly win (a real server's log has no series).
    ``gpus``: the decode GPUs (every ``*_per_gpu`` figure divides by them);
    ``prefill_gpus``: those of disaggregated prefill instances, for the
    ``*_per_gpu_incl_prefill`` figures beside them (None: no prefill instances, no such
    figures).

    Built in phases, in the order the summary lists them: the request accounting and
    throughputs, the latency percentiles, speculation, goodput, then steady state and
    stability."""
    fin = ~np.isnan(log.finish_s)
    lat = _latencies(log, fin)
    s = _accounting(log, fin, gpus, prefill_gpus)
    for sample, names in LATENCY_FIELDS.items():
        s |= _stats(names, lat[sample])
    s |= _itl(stats)
    s |= _interactivity(INTERACTIVITY_FIELDS, lat["interactivity"])
    s |= _speculation(log, stats)
    s |= _goodput(lat, s["duration"], slo_ttft_ms, slo_tpot_ms)
    del lat  # five floats a request: a streamed day's steady state needs the room
    s |= _stability(log, steps, s["unfinished"], s["completed"], gpus=gpus, closed=closed,
                    stable=stable, queue_growth_per_s=queue_growth_per_s,
                    prefill_gpus=prefill_gpus)
    return s


def _accounting(log: RequestLog, fin: np.ndarray, gpus: int,
                prefill_gpus: int | None = None) -> dict:
    """Where every request ended up, the token totals and the whole-run throughputs
    (first arrival to last finish)."""
    n_done = int(fin.sum())
    start = float(np.nanmin(log.arrival_s)) if len(log.arrival_s) else 0.0
    end = float(np.nanmax(log.finish_s)) if n_done else start
    duration = max(end - start, 1e-9)
    out_tokens = int(log.generated[fin].sum())
    in_tokens = int(log.prompt_tokens[fin].sum())
    s = {
        "completed": n_done,
        "num_requests": int(len(log.arrival_s)),
        "unfinished": int(len(log.arrival_s) - n_done - np.count_nonzero(log.rejected)),
        "rejected": int(np.count_nonzero(log.rejected)),
        "rejected_reasons": {name: int(np.count_nonzero(log.rejected == code))
                             for code, name in REJECT_REASONS.items()
                             if np.count_nonzero(log.rejected == code)},
        "preempted": int((log.preemptions > 0).sum()),
        "preemptions": int(log.preemptions.sum()),
        "duration": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        # every token generated, unfinished requests' included (= the requests' rows)
        "total_generated_tokens": int(log.generated.sum()),
        "request_throughput": n_done / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + in_tokens) / duration,
        "output_throughput_per_gpu": out_tokens / duration / gpus,
        "num_gpus": gpus,
    }
    if prefill_gpus is not None:
        s["output_throughput_per_gpu_incl_prefill"] = out_tokens / duration / (gpus + prefill_gpus)
    return s


def _itl(stats: StepStats) -> dict[str, float | None]:
    """Inter-token latency: the exact mean, percentiles from the step histogram."""
    itl_n = int(stats.itl_hist.sum())
    s: dict[str, float | None] = {
        "mean_itl_ms": stats.itl_sum_s / itl_n * 1e3 if itl_n else None}
    for q, name in ((50, "median_itl_ms"), (90, "p90_itl_ms"), (99, "p99_itl_ms")):
        p = _hist_percentile(stats.itl_hist, q)
        s[name] = None if p is None else p * 1e3
    return s


def _speculation(log: RequestLog, stats: StepStats) -> dict:
    """Drafts, acceptance (overall and per position), verification budget and waste,
    and the engine's step figures."""
    # vLLM's num_drafts: request-steps whose drafter proposed (all of them, unless the
    # trace says an n-gram drafter found no match at some positions)
    drafts = stats.request_steps - stats.unproposed_request_steps
    accepted = int((stats.accept_hist * np.arange(stats.accept_hist.size)).sum())
    verified = int((stats.ell_hist * np.arange(stats.ell_hist.size)).sum())
    total_emitted = int(log.generated.sum())
    s: dict = {
        "num_drafts": drafts,
        "num_draft_tokens_verified": verified,
        "num_accepted_tokens": accepted,
        # lossy policies: emitted tokens that differ from the target's greedy output
        "changed_tokens": int(stats.changed_tokens),
        "changed_token_fraction": stats.changed_tokens / total_emitted if total_emitted else 0.0,
        # drafts committed per drafting request-step: with a skipping policy's unjudged ones
        "spec_decode_acceptance_length":
            1.0 + (accepted + stats.unverified_tokens) / drafts if drafts else None,
        "spec_decode_acceptance_rate": accepted / verified if verified else None,
    }
    if drafts and stats.gamma:
        ge = stats.accept_hist[::-1].cumsum()[::-1]  # count of steps with accepted >= k
        s["acceptance_per_position"] = [float(x) / drafts for x in ge[1 : stats.gamma + 1]]
        vge = stats.ell_hist[::-1].cumsum()[::-1]
        s["verified_per_position"] = [float(x) / drafts for x in vge[1 : stats.gamma + 1]]
    else:
        s["acceptance_per_position"] = []
        s["verified_per_position"] = []
    rs = stats.request_steps
    s["tokens_per_request_step"] = \
        1.0 + (accepted + stats.unverified_tokens) / rs if rs else None
    s["mean_verify_tokens_per_request_step"] = stats.verify_tokens / rs if rs else None
    s["mean_draft_tokens_per_request_step"] = verified / rs if rs else None
    s["verification_waste"] = (verified - accepted) / verified if verified else 0.0
    s["engine_steps"] = stats.steps
    s["mean_step_ms"] = stats.busy_s / stats.steps * 1e3 if stats.steps else None
    s["mean_batch_tokens"] = stats.batch_tokens / stats.steps if stats.steps else None
    s["mean_decode_batch"] = rs / stats.steps if stats.steps else None
    s["budget_limited_steps"] = stats.budget_limited_steps
    s["kv_blocked_steps"] = stats.kv_blocked_steps
    return s


def _goodput(lat: dict[str, np.ndarray], duration: float, slo_ttft_ms: float | None,
             slo_tpot_ms: float | None) -> dict:
    """Finished requests per second that met every SLO given (None: no SLO given)."""
    ttft, tpot = lat["ttft_ms"], lat["tpot_ms"]
    ok = np.ones(ttft.size, bool)
    if slo_ttft_ms is not None:
        ok &= ttft <= slo_ttft_ms
    if slo_tpot_ms is not None:
        ok &= ~(tpot > slo_tpot_ms)  # single-token requests have no TPOT: they pass
    return {"slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms,
            "goodput": float(ok.sum()) / duration if (slo_ttft_ms or slo_tpot_ms) else None}


def _stability(log: RequestLog, steps: StepSeries | None, unfinished: int, completed: int,
               *, gpus: int, closed: bool, stable: bool | None,
               queue_growth_per_s: float | None, prefill_gpus: int | None = None) -> dict:
    """The ``steady_*`` figures (with a step series) and the verdict of
    :func:`stability_verdict` over the steady window. ``stable`` /
    ``queue_growth_per_s`` given explicitly win (a real server's log has no series)."""
    s: dict = {}
    queue = None
    if steps is not None:
        win = steady_window(steps, log.arrival_s, closed=closed)
        s |= steady_state(log, steps, win, gpus=gpus, prefill_gpus=prefill_gpus)
        if queue_growth_per_s is None:
            queue_growth_per_s = queue_growth(log.arrival_s, log.finish_s, win.start_s,
                                              win.end_s)
        arrived = int(((log.arrival_s >= win.start_s) & (log.arrival_s <= win.end_s)).sum())
        queue = QueueTrend(win.start_s, win.end_s, arrived, s["steady_window_completions"],
                           float(queue_growth_per_s) * win.duration_s)
    verdict, note = stability_verdict(queue, unfinished=unfinished, completed=completed,
                                      rejected=int(np.count_nonzero(log.rejected)))
    s["stable"] = bool(verdict if stable is None else stable)
    s["stability_note"] = note if stable is None else (
        f"given by the caller ({'stable' if stable else 'unstable'}); {note}")
    s["queue_growth_per_s"] = float(queue_growth_per_s or 0.0)
    return s


@dataclass(frozen=True)
class QueueTrend:
    """The queue over a steady window ``[start_s, end_s]``: its arrivals (both edges
    included), its completions, and the least-squares growth of the requests in the
    system across it (requests)."""

    start_s: float
    end_s: float
    arrived: int
    completions: int
    growth: float

    @property
    def limit(self) -> float:
        return STABLE_SLACK + STABLE_FRACTION * self.arrived


def stability_verdict(queue: QueueTrend | None, *, unfinished: int, completed: int,
                      rejected: int = 0) -> tuple[bool, str]:
    """Stable or not, and the sentence that says why (the summary's ``stability_note``).

    Unstable: nothing completed, requests left unfinished at the horizon, or over the
    steady window the requests in the system grew (least squares) or the completions
    fell short of the arrivals by more than ``STABLE_SLACK + STABLE_FRACTION`` x the
    arrivals. Without a window (``queue`` None: no step series) only the first two
    count."""
    if unfinished:
        return False, f"{unfinished:,} requests unfinished at the horizon" + (
            ", none completed" if completed == 0 else "")
    if completed == 0:
        return False, f"no request completed (all {rejected:,} rejected at arrival)"
    if queue is None:
        return True, "every request finished (no step series: the queue's trend not judged)"
    short = queue.arrived - queue.completions
    grows = max(queue.growth, short) > queue.limit
    said = (f"over the steady window ({queue.start_s:.2f}-{queue.end_s:.2f} s) the requests "
            f"in the system grew by {queue.growth:,.0f} (least squares) and {queue.arrived:,} "
            f"arrivals met {queue.completions:,} completions ("
            + (f"{short:,} short)" if short >= 0 else f"{-short:,} more)"))
    limit = (f"{STABLE_SLACK} + {STABLE_FRACTION:.0%} of the arrivals "
             f"({queue.limit:,.0f} requests)")
    return (not grows, f"{said}: more than {limit}, the queue grows" if grows
            else f"{said}: within {limit}")
