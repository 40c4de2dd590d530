"""Synthetic acceptance traces (labelled ``source = "synthetic"``).

Two kinds:

* ``iid``: every draft token is accepted with probability ``alpha`` independently
  (Leviathan et al.); confidences equal ``alpha`` (perfectly calibrated, no signal).
* ``drafter``: a latent model of a real drafter, calibrated per domain to the
  published figures (``shared/reference/PUBLISHED_FIGURES.md``). For output position
  ``t`` of request ``r`` and draft depth ``k``::

      q[t,k] = sigmoid(mu_k + u_r + z_t + eps[t,k])       true conditional acceptance
      mu_k   = logit(p1) - decay * (k - 1)                 suffix decay of parallel drafters
      z_t    = AR(1) over positions (rho, sigma_z)         easy/hard stretches of text
      m_t    = number of leading Bernoulli(q[t,k]) successes

  Raw confidences carry an imperfect, over-confident signal::

      c[t,k] = sigmoid(overconfidence * (logit(q[t,k]) + noise * N(0,1)))

  ``noise`` lowers AUC, ``overconfidence > 1`` pushes confidences towards 0/1 the
  way an uncalibrated head does (ECE of several %, as the paper reports before STS).
  ``decay`` is solved per domain so the mean tau at gamma = 7 matches the target.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from dspark_sim.errors import InputError
from dspark_sim.traces.schema import AcceptanceTrace, TraceMeta, concat_traces


@dataclass(frozen=True)
class DomainCurve:
    domain: str
    p1: float  # conditional acceptance at position 1 (Fig. 2)
    tau7: float | None  # target tau at gamma = 7 incl. bonus (Table 1); None: decay given
    decay: float = 0.0  # logit decay per position (solved from tau7 when given)


# DSpark on Qwen3-4B (Table 1 domain means, Fig. 2 position-1 acceptance).
DSPARK_CURVES = (
    DomainCurve("math", p1=0.93, tau7=5.57),
    DomainCurve("code", p1=0.90, tau7=5.12),
    DomainCurve("chat", p1=0.78, tau7=3.49),
)
# MTP-1 head: second-token acceptance 85-90% (DeepSeek-V3), AL 1.92 (InferenceX).
MTP1_CURVES = (
    DomainCurve("math", p1=0.93, tau7=None),
    DomainCurve("code", p1=0.92, tau7=None),
    DomainCurve("chat", p1=0.86, tau7=None),
)


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


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _logit(p):
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return np.log(p / (1 - p))


def _latent_logits(n_req: int, n_pos: int, gamma: int, mu: np.ndarray, s: SignalModel,
                   rng: np.random.Generator) -> np.ndarray:
    u = s.sigma_request * rng.standard_normal((n_req, 1))
    # AR(1) over positions, stationary variance sigma_position^2.
    e = rng.standard_normal((n_req, n_pos))
    z = np.empty((n_req, n_pos))
    z[:, 0] = e[:, 0] * s.sigma_position
    innov = s.sigma_position * np.sqrt(1 - s.rho**2)
    if s.rho == 0.0:
        z = e * s.sigma_position
    else:
        for t in range(1, n_pos):  # generation only, not the simulator's hot path
            z[:, t] = s.rho * z[:, t - 1] + innov * e[:, t]
    eps = s.sigma_token * rng.standard_normal((n_req, n_pos, gamma))
    return mu[None, None, :] + (u + z)[:, :, None] + eps


def _leading_successes(q: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    ok = rng.random(q.shape) < q
    # index of the first failure = run length of leading successes
    return np.where(ok.all(-1), q.shape[-1], np.argmin(ok, axis=-1))


def replace_rho(s: SignalModel) -> SignalModel:
    # for expectation solving, positions can be independent (same marginals)
    return SignalModel(s.sigma_request, s.sigma_position, 0.0, s.sigma_token, s.noise,
                       s.overconfidence)


def _solve_mu1(p1: float, s: SignalModel) -> float:
    """Logit offset whose marginal P(accept at k=1) equals p1 under the latent spread."""
    rng = np.random.default_rng(7)
    sd = np.sqrt(s.sigma_request**2 + s.sigma_position**2 + s.sigma_token**2)
    draws = sd * rng.standard_normal(200_000)
    lo, hi = -10.0, 15.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if _sigmoid(mid + draws).mean() < p1:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _solve_decay(c: DomainCurve, mu1: float, gamma: int, s: SignalModel) -> float:
    lo, hi = 0.0, 4.0
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        tau = _mean_tau_mu(mu1, mid, gamma, s)
        if tau > c.tau7:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _mean_tau_mu(mu1: float, decay: float, gamma: int, s: SignalModel, n: int = 30_000) -> float:
    rng = np.random.default_rng(12345)
    mu = mu1 - decay * np.arange(gamma)
    x = _latent_logits(n, 1, gamma, mu, replace_rho(s), rng)[:, 0]
    return float(_leading_successes(_sigmoid(x), rng).mean() + 1.0)


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
) -> AcceptanceTrace:
    """A latent-model drafter trace, one domain block per curve."""
    if gamma < 1 or requests_per_domain < 1 or positions < 1:
        raise InputError("traces synth", "gamma, requests and positions must be >= 1")
    s = signal or SignalModel()
    rng = np.random.default_rng(seed)
    parts, params = [], {}
    for c in curves:
        mu1 = _solve_mu1(c.p1, s)
        decay = c.decay if c.tau7 is None else _solve_decay(c, mu1, 7, s)
        mu = mu1 - decay * np.arange(gamma)
        x = _latent_logits(requests_per_domain, positions, gamma, mu, s, rng)
        q = _sigmoid(x)
        m = _leading_successes(q, rng).reshape(-1)
        noisy = x + s.noise * rng.standard_normal(x.shape)
        conf = _sigmoid(s.overconfidence * noisy).reshape(-1, gamma)
        # 4 decimals: enough for survival products, and compresses well
        conf = np.round(conf, 4).astype(np.float32)
        n = requests_per_domain
        meta = TraceMeta(drafter=drafter, target=target, gamma_max=gamma, domains=(c.domain,))
        parts.append(AcceptanceTrace(
            meta=meta,
            accept_len=m.astype(np.int8),
            conf=conf,
            req_offsets=np.arange(0, n * positions + 1, positions, dtype=np.int64),
            req_domain=np.full(n, c.domain),
            req_ids=np.arange(n, dtype=np.int32),
        ))
        params[c.domain] = {"p1": c.p1, "tau7_target": c.tau7, "mu1": round(mu1, 6),
                            "decay": round(decay, 6)}
    gen = {"kind": "drafter", "seed": seed, "gamma": gamma, "positions": positions,
           "requests_per_domain": requests_per_domain, "signal": asdict(s), "domains": params}
    meta = TraceMeta(drafter=drafter, target=target, gamma_max=gamma, source="synthetic",
                     domains=tuple(c.domain for c in curves), generator=gen)
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
    if gamma < 1:
        raise InputError("--gamma", f"must be >= 1, got {gamma}")
    if num_requests < 1 or positions < 1:
        raise InputError("traces synth", "requests and positions must be >= 1")
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
    return synth_drafter(DSPARK_CURVES, gamma=7, drafter="dspark-synthetic", seed=seed)


def default_mtp1_trace(seed: int = 1) -> AcceptanceTrace:
    return synth_drafter(MTP1_CURVES, gamma=1, drafter="mtp1-synthetic",
                         target="deepseek-v3/v4-like (published figures)", seed=seed,
                         signal=SignalModel(noise=1.0))
