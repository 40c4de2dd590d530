"""Synthetic acceptance traces (labelled ``source = "synthetic"``).

Two kinds:

* ``iid``: every draft token is accepted with probability ``alpha`` independently
  (Leviathan et al.); confidences equal ``alpha`` (perfectly calibrated, no signal).
* ``drafter``: a latent model of a real drafter, calibrated per domain to the
  published figures (``shared/reference/PUBLISHED_FIGURES.md``). For output position
  ``t`` of request ``r`` and draft depth ``k``::

      q[t,k] = sigmoid(mu_k + u_r + z_t + eps[t,k])       true conditional acceptance
      mu_k   = mu_1 - decay * (k - 1)                     suffix decay of parallel drafters
      z_t    = AR(1) over positions (rho, sigma_z)         easy/hard stretches of text
      m_t    = number of leading Bernoulli(q[t,k]) successes

  Raw confidences carry an imperfect, over-confident signal::

      c[t,k] = sigmoid(overconfidence * (logit(q[t,k]) + noise * N(0,1)))

  ``noise`` lowers AUC, ``overconfidence > 1`` pushes confidences towards 0/1 the
  way an uncalibrated head does (ECE of several %, as the paper reports before STS).

Calibration targets are **served** tau: tokens per verify step of a fixed-``k`` chain
replayed through each request (:meth:`AcceptanceTrace.served_tau`), the definition of
DSpark Table 1 and vLLM's acceptance length. Because easy and hard stretches of text
come in runs (``rho``), a chain spends more steps in hard stretches than a position
average weights them, so served tau sits below the per-position mean
(:meth:`AcceptanceTrace.tau`). Per domain, ``mu_1`` is set from the published
position-1 acceptance ``p1`` (DSpark Fig. 2) in expectation, and the one free
parameter left (``decay``; or ``mu_1`` itself when ``p1`` is not published) is solved
by bisection so that the *generated* trace serves the target tau: the latent draws are
made once and reused at every bisection step (common random numbers), so the solve is
exact up to the bisection tolerance whatever the size of the trace.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np

from dspark_sim.errors import InputError, check_seed
from dspark_sim.traces.schema import AcceptanceTrace, TraceMeta, _served_chain, concat_traces

MAX_CELLS = 30_000_000  # requests x positions x draft width: ~240 MB per float64 latent


def _check_shape(gamma: int, requests: int, positions: int, width: int,
                 max_gamma: int = 127) -> None:
    """A trace the generators can build: 1 <= gamma <= ``max_gamma`` (accepted lengths are
    int8), at least one request and position, and a latent block of ``width`` columns
    within MAX_CELLS."""
    if gamma < 1:
        raise InputError("--gamma", f"must be >= 1, got {gamma}")
    if requests < 1:
        raise InputError("--requests", f"must be >= 1, got {requests}")
    if positions < 1:
        raise InputError("--positions", f"must be >= 1, got {positions}")
    if gamma > max_gamma:
        raise InputError("--gamma", f"must be <= {max_gamma}, got {gamma}")
    cells = requests * positions * width
    if cells > MAX_CELLS:
        wide = "" if width == gamma else f" (the latent block is {width} wide: the curves' k)"
        raise InputError("--requests x --positions x --gamma",
                         f"{requests:,} x {positions:,} x {width:,} = {cells:,} exceeds "
                         f"{MAX_CELLS:,}{wide}; generate fewer or concatenate traces")


@dataclass(frozen=True)
class DomainCurve:
    domain: str
    p1: float | None  # conditional acceptance at position 1 (Fig. 2); None: solved from tau
    tau: float | None  # target served tau at verify length k, incl. bonus; None: decay given
    k: int = 7  # verify length the target was published at (Table 1: block 7)
    decay: float = 0.0  # logit decay per position (solved from tau when p1 is given)
    # None: p1 is DSpark Fig. 2's rate over every position, met in expectation. An int:
    # p1 is vLLM's per-position counter (num_accepted_tokens_per_pos / num_drafts) of a
    # run at num_speculative_tokens = p1_k, i.e. P(m >= 1) over the verify steps that
    # fixed-k chain visits (AcceptanceTrace.served_survival), solved on the sample like tau.
    p1_k: int | None = None


# DSpark on Qwen3-4B: Table 1 domain means (served tau, block 7, temperature 1) and the
# position-1 acceptance of Fig. 2 (math 0.93 published; code and chat read off the
# figure's ordering between DFlash and DSpark).
DSPARK_CURVES = (
    DomainCurve("math", p1=0.93, tau=5.57, k=7),
    DomainCurve("code", p1=0.90, tau=5.12, k=7),
    DomainCurve("chat", p1=0.78, tau=3.49, k=7),
)
# MTP-1 head, served at one speculative token: InferenceX's golden AL 1.92 on the
# SPEED-Bench coding split (DeepSeek-V4, thinking off) for code; math and chat are not
# published per domain: DeepSeek-V3's second-token acceptance of 85-90 % puts chat at
# the low end (1.85) and math at the top (1.90), so the three-domain pool serves ~0.89.
MTP1_CURVES = (
    DomainCurve("math", p1=None, tau=1.90, k=1),
    DomainCurve("code", p1=None, tau=1.92, k=1),
    DomainCurve("chat", p1=None, tau=1.85, k=1),
)


# DSpark on DeepSeek-V4-Pro, vLLM's adaptive-verification benchmark (SPEED-Bench
# qualitative prompts, temperature 1, block 7; vllm-project.github.io 2026-08-14): fixed
# arms serve ~3.4 whatever k >= 5 and the whole block 3.44; the first draft survives
# > 70 % of the time, the seventh < 10 % (unconditional, V4-Flash). p1 = 0.84 meets both.
V4PRO_SPEEDBENCH_CURVES = (DomainCurve("speedbench", p1=0.84, tau=3.44, k=7),)
# The same post's primary figure (Figure 3, fig3-pareto.svg): DeepSeek-V4-Flash on 4x B300,
# SPEED-Bench qualitative prompts, temperature 1. Per-position survival is not published;
# the post says the first of 7 drafts survives > 70 % of the time and the last < 10 %
# (p1 = 0.78 puts them at ~76 % and ~4 %). The served tau at k = 7 is FITTED with the
# v4flash-b300 profile to the figure's fixed k = 5 points at concurrency 1-64 (at c = 1
# fixed 5 and 7 run 426 and 419 tok/s/user against none's 171: tau ~3 on a step that
# costs ~1.2 x none's; benchmarks/fit_published.py); fixed k = 7 is held out.
V4FLASH_SPEEDBENCH_CURVES = (DomainCurve("speedbench", p1=0.78, tau=3.2, k=7),)
# DSpark-5 on DeepSeek-V4-Flash's live traffic (DSpark §5.4): not published as tau; Fig. 7
# spans ~225 tok/s/user for DSpark against MTP-1's ~125 at the smallest batches, where
# both run a near-equal step: served tau at k = 5 ~ 1.8 x MTP-1's 1.9 = 3.4 (fitted, see
# validation/published.py); position 1 as the MTP head's (both read the target's state).
V4FLASH_LIVE_CURVES = (DomainCurve("live", p1=0.9, tau=3.6, k=5),)
# A DSpark drafter for Llama-3.2-1B (vllm-project/speculators#1135), eight speculative
# tokens: vLLM's unconditional per-position rates, HumanEval ("code", tau 4.57) 83.7 %
# first and writing (tau 2.64) 61.7 % first. Both are vLLM's counters of an 8-token run
# (served, p1_k = 8); positions 2-8 are held out (tests/traces/test_published_acceptance.py).
# GLM-4.7-FP8's MTP layer drafting autoregressively in SGLang (PR #23336, its "transition"
# workload of low- and high-acceptance phases): served tau 1.85 at one step, 4.52 at
# seven; tau 3.04 at three steps is held out (tests/traces/test_published_acceptance.py).
GLM47_MTP_CURVES = (DomainCurve("transition", p1=0.85, tau=4.52, k=7, p1_k=1),)
LLAMA32_1B_CURVES = (DomainCurve("code", p1=0.837, tau=4.57, k=8, p1_k=8),
                     DomainCurve("writing", p1=0.617, tau=2.64, k=8, p1_k=8))


@dataclass(frozen=True)
class SignalModel:
    # Defaults reproduce the paper's confidence quality: raw ECE 3-7 %, AUC 0.83-0.87,
    # ~1 % ECE after sequential temperature scaling.
    sigma_request: float = 0.3
    sigma_position: float = 1.0
    rho: float = 0.8
    sigma_token: float = 1.2
    noise: float = 0.35
    overconfidence: float = 1.3

    def __post_init__(self) -> None:
        # NaN or a negative spread would write a trace of NaN confidences (or flip their
        # order) that fails only later, in calibration or the scheduler: refuse it here.
        # The CLI exposes noise and overconfidence; the rest are the library's.
        for name in ("sigma_request", "sigma_position", "sigma_token", "noise"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0.0):
                raise InputError(f"--{name}", f"must be a finite number >= 0, got {v}")
        if not (math.isfinite(self.overconfidence) and self.overconfidence > 0.0):
            raise InputError("--overconfidence", f"must be a finite number > 0, got "
                                                 f"{self.overconfidence}")
        if not -1.0 < self.rho < 1.0:  # AR(1) stationary only for |rho| < 1
            raise InputError("--rho", f"must lie in (-1, 1), got {self.rho}")


def _sigmoid(x):
    with np.errstate(over="ignore"):  # exp(-x) = inf for x << 0 gives exactly 0: fine
        return 1.0 / (1.0 + np.exp(-x))


def _logit(p):
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return np.log(p / (1 - p))


def _latent_noise(n_req: int, n_pos: int, gamma: int, s: SignalModel,
                  rng: np.random.Generator) -> np.ndarray:
    """``u_r + z_t + eps[t,k]`` (zero-mean part of the logits), shape [n_req, n_pos, gamma]."""
    u = s.sigma_request * rng.standard_normal((n_req, 1))
    # AR(1) over positions, stationary variance sigma_position^2.
    e = rng.standard_normal((n_req, n_pos))
    if s.rho == 0.0:
        z = e * s.sigma_position
    else:
        z = np.empty((n_req, n_pos))
        z[:, 0] = e[:, 0] * s.sigma_position
        innov = s.sigma_position * np.sqrt(1 - s.rho**2)
        for t in range(1, n_pos):  # generation only, not the simulator's hot path
            z[:, t] = s.rho * z[:, t - 1] + innov * e[:, t]
    eps = s.sigma_token * rng.standard_normal((n_req, n_pos, gamma))
    return (u + z)[:, :, None] + eps


def _leading_successes(q: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return _leading(rng.random(q.shape) < q)


def _leading(ok: np.ndarray) -> np.ndarray:
    # index of the first failure = run length of leading successes
    return np.where(ok.all(-1), ok.shape[-1], np.argmin(ok, axis=-1))


def _solve_mu1(p1: float, s: SignalModel) -> float:
    """Logit offset whose marginal P(accept at k=1) equals p1 under the latent spread."""
    rng = np.random.default_rng(7)
    sd = np.sqrt(s.sigma_request**2 + s.sigma_position**2 + s.sigma_token**2)
    draws = sd * rng.standard_normal(200_000)
    return _bisect(lambda mid: float(_sigmoid(mid + draws).mean()), p1, -10.0, 15.0, 60)


def _bisect(f, target: float, lo: float, hi: float, iters: int) -> float:
    """Root of increasing ``f(x) = target`` on [lo, hi] (clamped to the ends)."""
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


class _Sample:
    """One domain's latent draws, reused for every candidate (mu_1, decay)."""

    def __init__(self, n_req: int, n_pos: int, width: int, s: SignalModel,
                 rng: np.random.Generator) -> None:
        self.noise = _latent_noise(n_req, n_pos, width, s, rng)
        self.u = rng.random(self.noise.shape)
        self.offsets = np.arange(0, n_req * n_pos + 1, n_pos, dtype=np.int64)

    def logits(self, mu1: float, decay: float) -> np.ndarray:
        return mu1 - decay * np.arange(self.noise.shape[-1]) + self.noise

    def accept_len(self, mu1: float, decay: float) -> np.ndarray:
        return _leading(self.u < _sigmoid(self.logits(mu1, decay))).reshape(-1)

    def served_tau(self, mu1: float, decay: float, k: int) -> float:
        tokens, steps = _served_chain(self.accept_len(mu1, decay), self.offsets, k)
        return float(tokens.sum() / steps.sum())

    def served_p1(self, mu1: float, decay: float, k: int) -> float:
        """P(m >= 1) over the verify steps a fixed-``k`` chain visits (vLLM's counter)."""
        hist = np.zeros(k + 1, np.int64)
        _served_chain(self.accept_len(mu1, decay), self.offsets, k, hist)
        return float(1.0 - hist[0] / hist.sum())


def _fit_curve(c: DomainCurve, sample: _Sample, s: SignalModel) -> tuple[float, float]:
    """(mu_1, decay) for one domain: mu_1 from p1 in expectation, then the free parameter
    solved on the sample's served tau at verify length ``c.k``."""
    if c.p1 is None and c.tau is None:
        raise InputError("traces synth", f"domain {c.domain!r} needs p1 or a tau target")
    if c.tau is not None and not 1.0 <= c.tau <= c.k + 1:
        raise InputError("traces synth", f"domain {c.domain!r}: tau {c.tau} outside [1, k+1]")
    if c.p1 is not None and c.p1_k is not None:
        return _fit_served(c, sample, s)
    if c.p1 is not None:
        mu1 = _solve_mu1(c.p1, s)
        if c.tau is None:
            return mu1, c.decay
        # served tau falls as decay grows: bisect on -decay
        decay = -_bisect(lambda d: sample.served_tau(mu1, -d, c.k), c.tau, -6.0, 2.0, 40)
        return mu1, decay
    mu1 = _bisect(lambda mu: sample.served_tau(mu, c.decay, c.k), c.tau, -10.0, 15.0, 50)
    return mu1, c.decay


def _fit_served(c: DomainCurve, sample: _Sample, s: SignalModel) -> tuple[float, float]:
    """(mu_1, decay) meeting a served first-position rate (at verify length ``p1_k``) and,
    if given, the served tau at ``k``: for each candidate mu_1 the decay is solved on tau,
    and mu_1 by bisection on the first rate that pair serves. Solving each in turn with the
    other held cycles instead: the sample's chain visits jump as either moves."""
    if not 0.0 < c.p1 < 1.0:
        raise InputError("traces synth", f"domain {c.domain!r}: p1 {c.p1} outside (0, 1)")
    if c.p1_k < 1:  # at k = 0 no draft is verified: the first rate is 0 whatever mu_1
        raise InputError("traces synth", f"domain {c.domain!r}: p1_k must be >= 1, got {c.p1_k}")

    def decay_for(mu1: float) -> float:
        if c.tau is None:
            return c.decay
        return -_bisect(lambda d: sample.served_tau(mu1, -d, c.k), c.tau, -6.0, 2.0, 30)

    mu1 = _bisect(lambda mu: sample.served_p1(mu, decay_for(mu), c.p1_k), c.p1, -10.0, 15.0, 30)
    return mu1, decay_for(mu1)


def synth_drafter(
    curves: tuple[DomainCurve, ...] = DSPARK_CURVES,
    *,
    gamma: int = 7,
    requests_per_domain: int = 64,
    positions: int = 512,
    signal: SignalModel | None = None,
    drafter: str = "dspark-synthetic",
    target: str = "qwen3-4b-like (published figures)",
    seed: int = 0,
    extra: dict | None = None,
) -> AcceptanceTrace:
    """A latent-model drafter trace, one domain block per curve, each domain's served tau
    at its curve's ``k`` solved to the curve's target (see the module docstring). The
    latent block is ``max(gamma, k)`` wide so a target published at ``k`` holds for a
    trace drafting fewer tokens too (``m`` is then cut at ``gamma``)."""
    _check_shape(gamma, requests_per_domain, positions, max([gamma, *(c.k for c in curves)]))
    check_seed(seed)
    s = signal or SignalModel()
    rng = np.random.default_rng(seed)
    parts, params = [], {}
    for c in curves:
        width = max(gamma, c.k)
        sample = _Sample(requests_per_domain, positions, width, s, rng)
        mu1, decay = _fit_curve(c, sample, s)
        m = np.minimum(sample.accept_len(mu1, decay), gamma)
        x = sample.logits(mu1, decay)[..., :gamma]
        noisy = x + s.noise * rng.standard_normal(x.shape)
        conf = _sigmoid(s.overconfidence * noisy).reshape(-1, gamma)
        # 4 decimals: enough for survival products, and compresses well
        conf = np.round(conf, 4).astype(np.float32)
        n = requests_per_domain
        meta = TraceMeta(drafter=drafter, target=target, gamma_max=gamma, domains=(c.domain,))
        part = AcceptanceTrace(
            meta=meta,
            accept_len=m.astype(np.int8),
            conf=conf,
            req_offsets=sample.offsets,
            req_domain=np.full(n, c.domain),
            req_ids=np.arange(n, dtype=np.int32),
        )
        parts.append(part)
        params[c.domain] = {"p1": c.p1, "tau_served_target": c.tau, "k": c.k,
                            "mu1": round(mu1, 6), "decay": round(decay, 6)}
        if c.p1_k is not None:
            params[c.domain]["p1_k"] = c.p1_k
        if c.tau is not None and c.k <= gamma:
            params[c.domain]["tau_served"] = round(part.served_tau(c.k), 4)
    gen = {"kind": "drafter", "seed": seed, "gamma": gamma, "positions": positions,
           "requests_per_domain": requests_per_domain, "signal": asdict(s), "domains": params,
           "tau_definition": "served: tokens per verify step of a fixed-k chain, incl. bonus"}
    meta = TraceMeta(drafter=drafter, target=target, gamma_max=gamma, source="synthetic",
                     domains=tuple(c.domain for c in curves), generator=gen,
                     extra=dict(extra or {}))
    return concat_traces(parts, meta)


def synth_iid(
    alpha: float,
    gamma: int,
    *,
    num_requests: int = 64,
    positions: int = 512,
    seed: int = 0,
    domain: str = "iid",
) -> AcceptanceTrace:
    """i.i.d. acceptance ``alpha`` per draft token; confidences are exactly ``alpha``."""
    if not 0.0 <= alpha <= 1.0:
        raise InputError("--alpha", f"must lie in [0, 1], got {alpha}")
    _check_shape(gamma, num_requests, positions, gamma)
    check_seed(seed)
    rng = np.random.default_rng(seed)
    n = num_requests * positions
    m = _leading_successes(np.full((n, gamma), alpha), rng)
    meta = TraceMeta(
        drafter=f"iid-alpha{alpha:g}", target="synthetic", gamma_max=gamma, source="synthetic",
        domains=(domain,),
        generator={"kind": "iid", "alpha": alpha, "gamma": gamma, "seed": seed,
                   "positions": positions, "requests": num_requests},
    )
    return AcceptanceTrace(
        meta=meta,
        accept_len=m.astype(np.int8),
        conf=np.full((n, gamma), alpha, dtype=np.float32),
        req_offsets=np.arange(0, n + 1, positions, dtype=np.int64),
        req_domain=np.full(num_requests, domain),
        req_ids=np.arange(num_requests, dtype=np.int32),
    )


def default_dspark_trace(seed: int = 0) -> AcceptanceTrace:
    """The shipped ``dspark-synthetic`` trace; its STS map ``dspark-synthetic-sts`` is
    fitted on it (:func:`dspark_sim.calibration.fit.write_shipped_synthetic`,
    which regenerates both)."""
    return synth_drafter(DSPARK_CURVES, gamma=7, drafter="dspark-synthetic", seed=seed,
                         extra={"calibration": "dspark-synthetic-sts"})


def default_mtp1_trace(seed: int = 1) -> AcceptanceTrace:
    """The shipped ``mtp1-synthetic`` trace (the ``mtp1`` policy reads no confidences)."""
    return synth_drafter(MTP1_CURVES, gamma=1, drafter="mtp1-synthetic",
                         target="deepseek-v3/v4-like (published figures)", seed=seed,
                         signal=SignalModel(noise=1.0))


def v4pro_speedbench_trace(seed: int = 3) -> AcceptanceTrace:
    """The DSpark drafter of vLLM's DeepSeek-V4-Pro benchmark, as published (served tau
    3.44 at block 7): the trace the ``v4pro-b300`` profile's published points replay."""
    return synth_drafter(V4PRO_SPEEDBENCH_CURVES, gamma=7, requests_per_domain=48,
                         drafter="dspark-v4pro-synthetic",
                         target="deepseek-v4-pro-like (vLLM adaptive-verification blog)",
                         seed=seed, extra={"calibration": "dspark-v4pro-synthetic-sts"})


def v4flash_speedbench_trace(seed: int = 8, tau: float | None = None) -> AcceptanceTrace:
    """The DSpark drafter of vLLM's DeepSeek-V4-Flash benchmark (the post's Figure 3,
    block 7): the trace the ``v4flash-b300`` profile's published points replay. ``tau``
    overrides the curve's served tau (the fit's candidates)."""
    curves = V4FLASH_SPEEDBENCH_CURVES if tau is None else tuple(
        replace(c, tau=tau) for c in V4FLASH_SPEEDBENCH_CURVES)
    return synth_drafter(curves, gamma=7, requests_per_domain=48,
                         drafter="dspark-v4flash-speedbench-synthetic",
                         target="deepseek-v4-flash-like (vLLM adaptive-verification blog, Fig. 3)",
                         seed=seed,
                         extra={"calibration": "dspark-v4flash-speedbench-synthetic-sts"})


def v4flash_live_trace(seed: int = 4) -> AcceptanceTrace:
    """DSpark-5 on V4-Flash live traffic (served tau 3.4 at k = 5, fitted to Fig. 7's
    interactivity span): the trace the ``v4flash-h200`` case study and published points
    replay."""
    return synth_drafter(V4FLASH_LIVE_CURVES, gamma=5, requests_per_domain=96,
                         drafter="dspark-v4flash-synthetic",
                         target="deepseek-v4-flash-like (DSpark §5.4 live traffic)",
                         seed=seed, extra={"calibration": "dspark-v4flash-synthetic-sts"})


def llama32_1b_trace(seed: int = 5) -> AcceptanceTrace:
    """The DSpark drafter of vllm-project/speculators#1135 for Llama-3.2-1B (8 tokens;
    HumanEval as ``code``, and ``writing``), fitted to each domain's first-position rate
    and tau as vLLM counts them; the other seven positions are left to the model."""
    return synth_drafter(LLAMA32_1B_CURVES, gamma=8, drafter="dspark-llama32-1b-synthetic",
                         target="llama-3.2-1b-like (vllm-project/speculators#1135)", seed=seed,
                         extra={"calibration": "dspark-llama32-1b-synthetic-sts"})


def glm47_mtp_trace(seed: int = 6) -> AcceptanceTrace:
    """GLM-4.7-FP8's MTP layer as an SGLang chain (PR #23336), up to seven steps: fitted
    to tau 1.85 at one step and 4.52 at seven; the trace the ``glm47-h20`` profile's
    published points replay (1,024 positions per request: the benchmark's outputs)."""
    return synth_drafter(GLM47_MTP_CURVES, gamma=7, positions=1024, drafter="glm47-mtp",
                         target="glm-4.7-fp8-like (SGLang PR #23336)", seed=seed,
                         extra={"calibration": "glm47-mtp-synthetic-sts"})


# synth_kind's kind-specific options: the kinds that read each, and its default there
SYNTH_OPTIONS = {"alpha": (("iid",), 0.8), "gamma": (("iid", "dspark"), 7),
                 "overconfidence": (("dspark", "mtp1"), 1.3), "noise": (("dspark", "mtp1"), 0.35)}


def _synth_options(kind: str, **given) -> tuple:
    """Each of ``given`` (in SYNTH_OPTIONS' order) for ``kind``: its default when not
    given; given to a kind that never reads it (``--kind dspark --alpha 0.9``), refused
    naming both options, since the trace would be written as if it were not there."""
    out = []
    for name, (kinds, default) in SYNTH_OPTIONS.items():
        v = given[name]
        if v is not None and kind in ("iid", "dspark", "mtp1") and kind not in kinds:
            raise InputError(f"--{name}", f"is read by --kind {' and '.join(kinds)} only, not "
                                          f"--kind {kind}: leave it out")
        out.append(default if v is None else v)
    return tuple(out)


def synth_kind(kind: str, *, alpha: float | None = None, gamma: int | None = None,
               requests: int = 64, positions: int = 512, overconfidence: float | None = None,
               noise: float | None = None, seed: int = 0) -> AcceptanceTrace:
    """``traces synth``'s trace: ``iid`` (``alpha``, ``gamma``), or the ``dspark`` / ``mtp1``
    latent-model drafter (``requests`` per domain; ``gamma``: dspark's block, mtp1
    drafts 1). An option left None takes its default; one the kind never reads is
    refused, as is an unknown kind."""
    alpha, gamma, overconfidence, noise = _synth_options(
        kind, alpha=alpha, gamma=gamma, overconfidence=overconfidence, noise=noise)
    if kind == "iid":
        return synth_iid(alpha, gamma, num_requests=requests, positions=positions, seed=seed)
    if kind not in ("dspark", "mtp1"):
        raise InputError("--kind", f"must be iid, dspark or mtp1, got {kind!r}")
    if gamma < 1:
        raise InputError("--gamma", "must be >= 1")
    curves = DSPARK_CURVES if kind == "dspark" else MTP1_CURVES
    return synth_drafter(curves, gamma=gamma if kind == "dspark" else 1,
                         requests_per_domain=requests, positions=positions,
                         signal=SignalModel(noise=noise, overconfidence=overconfidence),
                         drafter=f"{kind}-synthetic", seed=seed)
