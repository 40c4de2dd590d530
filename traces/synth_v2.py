"""Synthetic schema-v2 tree fields (``alt_prob``, ``true_rank``, ``true_prob``) on top of
the latent drafter model of :mod:`dspark_sim.traces.synth`.

The chain part is ``synth.py``'s model unchanged: ``q[t,j] = sigmoid(mu_j + u_r + z_t +
eps)`` is the conditional acceptance of depth ``j`` teacher-forced on the true prefix,
``ok[t,j] = U[t,j] < q[t,j]`` says whether the drafter's greedy token there is the target's,
and ``accept_len`` is the run of leading ``ok``. ``ok`` beyond the first miss is what the
drafter re-run on the *true* token would get (schema v2's teacher forcing), drawn from the
same ``q``. So by construction ``true_rank[t,j] == 0`` exactly where ``ok``: 0 for every
depth ``<= accept_len``, non-zero at ``accept_len + 1``.

The rest of the drafter's distribution at a cell, its top-4 ``alt_prob``:

* ``p_0 = sigmoid(logit(q) + prob_noise * N(0,1))`` -- the drafter's top-1 probability, an
  honest but noisy estimate of ``q`` (what a margin or a joint probability can read);
* the rejected mass ``1 - p_0`` is spread geometrically over the runner-up ranks,
  ``p_r = (1 - p_0)(1 - h) h^(r-1)``, with a per-cell spread ``h = sigmoid(logit(h_mean) +
  spread_sd * N(0,1))`` (small ``h``: one clear runner-up; large: a flat tail); ``h`` is
  raised where needed so ``p_1 <= p_0`` (``alt_prob`` is descending);
* where the greedy token is rejected, the target's rank follows the drafter's own split of
  the rejected mass (a calibrated drafter): ``P(rank = r | rank >= 1) = (1 - h) h^(r-1)``,
  drawn by inverse CDF from one uniform per cell; ``true_prob = p_rank``.

``h_mean`` sets how often the runner-ups hold the target's token, i.e. the whole tree gain.
It is not written in: :func:`synth_tree` can solve it by bisection so that a *reference
tree* (a callable evaluated on the generated trace; the caller passes a policy's static
replay, e.g. the PCTree paper's tree) serves a published tau, with common random numbers
(the same draws at every bisection step: served tau is monotone in ``h_mean``). Every other
tree, budget and load is then a prediction. Parameters and the solved values go into the
trace's ``generator`` metadata.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import numpy as np

from dspark_sim.errors import InputError
from dspark_sim.traces.schema import AcceptanceTrace, TraceMeta, concat_traces
from dspark_sim.traces.schema_v2 import RANK_CAP, TOPK, V2Fields
from dspark_sim.traces.synth import (
    DomainCurve,
    SignalModel,
    _bisect,
    _check_shape,
    _fit_curve,
    _leading,
    _logit,
    _Sample,
    _sigmoid,
)


@dataclass(frozen=True)
class RankModel:
    """How the drafter's probability mass sits on its alternatives (module docstring)."""

    h_mean: float = 0.5  # median geometric spread of the rejected mass over ranks >= 1
    spread_sd: float = 1.0  # logit-scale spread of h across cells
    prob_noise: float = 0.5  # logit noise of the drafter's top-1 probability around q


# The papers' settings (../shared/reference/PUBLISHED_FIGURES.md).
# PCTree (arXiv 2608.02123): DSpark-style drafter on Qwen3-4B, GSM8K, block 16, served tau
# 9.41 for the matched DSpark chain, 11.16 for the parent-conditioned tree. Position-1
# acceptance 0.93 is DSpark's on math (Fig. 2). The tree's tau is the *reference* the rank
# spread is solved to (sim/tree_synth.py), never the outcome of anything else.
PCTREE_CURVES = (DomainCurve("gsm8k", p1=0.93, tau=9.41, k=16),)
PCTREE_TREE_TAU = 11.16
# CURE (arXiv 2608.00531): block-parallel drafter on Qwen3-8B, block 16; it publishes
# speedups (2.66-3.49x over target-only) and gains (+4.2-7.5 % tau over the unrepaired
# draft), not tau. At concurrency 1 on the qwen3-8b-h100 profile a block-16 step costs
# ~1.28x a target-only step (8.03 ms target + 2.1 ms block-16 draft + LM-head rows), so the
# speedups put the *repaired* tau at ~3.4 and ~4.5; dividing by the mid gain (1.06) puts
# the unrepaired chain at ~3.2 and ~4.2: two domains, a hard and an easy one. Position 1
# is the parallel drafter's (DFlash, Fig. 2: 0.88 on math, 0.72 on chat).
CURE_CURVES = (DomainCurve("cure-low", p1=0.72, tau=3.2, k=16),
               DomainCurve("cure-high", p1=0.88, tau=4.2, k=16))


def _cells(sample: _Sample, mu1: float, decay: float, rm: RankModel,
           draws: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
    """(accept_len, ok, alt_prob, true_rank, true_prob) for one domain's latent draws."""
    x = sample.logits(mu1, decay)
    q = _sigmoid(x)
    ok = sample.u < q
    m = _leading(ok)
    p0 = _sigmoid(x + rm.prob_noise * draws["p0"])
    h = _sigmoid(_logit(np.clip(rm.h_mean, 1e-6, 1 - 1e-6)) + rm.spread_sd * draws["h"])
    # p_1 = (1 - p_0)(1 - h) <= p_0  <=>  h >= 1 - p_0 / (1 - p_0)
    h = np.clip(np.maximum(h, 1.0 - p0 / np.maximum(1.0 - p0, 1e-9)), 1e-6, 1 - 1e-6)
    r = np.arange(1, TOPK)
    alt = np.empty(q.shape + (TOPK,))
    alt[..., 0] = p0
    alt[..., 1:] = ((1.0 - p0) * (1.0 - h))[..., None] * h[..., None] ** (r - 1)
    # rank >= 1 by inverse CDF of the geometric: P(rank > r) = h^r
    miss_rank = 1 + np.floor(np.log(draws["rank"]) / np.log(h)).astype(np.int64)
    miss_rank = np.minimum(miss_rank, RANK_CAP)
    rank = np.where(ok, 0, miss_rank)
    true_prob = np.where(ok, p0, (1.0 - p0) * (1.0 - h) * h ** (np.maximum(rank, 1) - 1))
    return m, ok, alt, rank, true_prob


def synth_tree(
    curves: tuple[DomainCurve, ...],
    *,
    gamma: int = 16,
    requests_per_domain: int = 32,
    positions: int = 256,
    rank_model: RankModel | None = None,
    signal: SignalModel | None = None,
    reference: tuple[float, Callable[[AcceptanceTrace], float]] | None = None,
    drafter: str = "dspark-tree-synthetic",
    target: str = "synthetic (published figures)",
    seed: int = 0,
    extra: dict | None = None,
) -> AcceptanceTrace:
    """A v2 trace with tree fields, one domain block per curve (chain fitted per curve as
    in :func:`~dspark_sim.traces.synth.synth_drafter`). ``reference = (tau, served)``:
    solve ``rank_model.h_mean`` so that ``served(trace) == tau`` (``served`` must fall as
    ``h_mean`` grows: a tree's tau does)."""
    _check_shape(gamma, requests_per_domain, positions, gamma * TOPK, max_gamma=RANK_CAP)
    if any(c.k > gamma for c in curves):
        raise InputError("--gamma", "every curve's k must be <= gamma for tree fields")
    s = signal or SignalModel()
    rm = rank_model or RankModel()
    rng = np.random.default_rng(seed)
    domains = []
    for c in curves:
        sample = _Sample(requests_per_domain, positions, gamma, s, rng)
        mu1, decay = _fit_curve(c, sample, s)
        shape = sample.noise.shape
        draws = {"p0": rng.standard_normal(shape), "h": rng.standard_normal(shape),
                 "rank": 1.0 - rng.random(shape), "conf": rng.standard_normal(shape)}
        domains.append((c, sample, mu1, decay, draws))

    def build(model: RankModel) -> AcceptanceTrace:
        parts, params = [], {}
        for c, sample, mu1, decay, draws in domains:
            m, ok, alt, rank, tprob = _cells(sample, mu1, decay, model, draws)
            x = sample.logits(mu1, decay)
            conf = _sigmoid(s.overconfidence * (x + s.noise * draws["conf"]))
            n_rows = m.size
            v2 = V2Fields(
                # 3 decimals: float16 probabilities barely compress otherwise; rounding is
                # monotone, so alt_prob stays descending
                alt_prob=np.round(alt.reshape(n_rows, gamma, TOPK), 3).astype(np.float16),
                true_rank=rank.reshape(n_rows, gamma).astype(np.int8),
                true_prob=np.round(tprob.reshape(n_rows, gamma), 3).astype(np.float16))
            meta = TraceMeta(drafter=drafter, target=target, gamma_max=gamma,
                             domains=(c.domain,))
            parts.append(AcceptanceTrace(
                meta=meta, accept_len=m.reshape(-1).astype(np.int8),
                conf=np.round(conf.reshape(n_rows, gamma), 4).astype(np.float32),
                req_offsets=sample.offsets, req_domain=np.full(requests_per_domain, c.domain),
                req_ids=np.arange(requests_per_domain, dtype=np.int32), v2=v2))
            params[c.domain] = {"p1": c.p1, "tau_served_target": c.tau, "k": c.k,
                                "mu1": round(mu1, 6), "decay": round(decay, 6),
                                "tau_served": round(parts[-1].served_tau(c.k), 4)}
        gen = {"kind": "tree", "seed": seed, "gamma": gamma, "positions": positions,
               "requests_per_domain": requests_per_domain, "signal": asdict(s),
               "rank_model": asdict(model), "domains": params,
               "tau_definition": "served: tokens per verify step, incl. bonus"}
        meta = TraceMeta(drafter=drafter, target=target, gamma_max=gamma, source="synthetic",
                         domains=tuple(c.domain for c in curves), generator=gen,
                         extra=dict(extra or {}))
        return concat_traces(parts, meta)

    if reference is None:
        return build(rm)
    tau, served = reference
    # served tau falls as h_mean grows: bisect on -logit(h_mean)
    z = _bisect(lambda v: served(build(replace(rm, h_mean=float(_sigmoid(-v))))),
                tau, -8.0, 8.0, 30)
    out = build(replace(rm, h_mean=float(_sigmoid(-z))))
    gen = dict(out.meta.generator, reference={"tau": tau, "tau_served": round(served(out), 4)})
    return replace(out, meta=replace(out.meta, generator=gen))
