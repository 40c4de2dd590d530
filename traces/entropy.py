"""Synthetic per-position entropies (schema v2 ``draft_entropy``, ``target_entropy``) for a
trace that has none, correlated with acceptance the way a real drafter's are; and the
shipped long-context self-speculation trace ``selfspec-synthetic``.

A real drafter is unsure (high entropy) where it is about to be wrong, but not always:
entropy is an untrained signal, weaker than a confidence head trained against the
target. The generator draws, for row ``t`` and depth ``j``, the drafter's top-1
probability ``pi`` from the outcome the trace records and sets the entropy of a
distribution with that top-1 mass and the rest spread over ``alternatives`` tokens::

    o[t,j]  = 1 if j < m_t (accepted), 0 if j = m_t (the first rejection),
              Bernoulli(qbar_j) past it (the chain hangs off a rejected token: the
              drafter's state there is as at any depth-j position)
    pi      = sigmoid(logit(qbar_j) + separation * (2 o - 1) + noise * N(0, 1))
    H       = -pi ln pi - (1 - pi) ln((1 - pi) / alternatives)             (nats)

``qbar_j`` is the trace's conditional acceptance at depth ``j`` (DSpark Fig. 2's
definition), so the depth profile is the trace's own. ``separation`` and ``noise`` set
how well entropy separates accepted from rejected drafts: the defaults give an AUC of
about 0.8 on the drafts a chain reaches (the generator records it in the trace's
metadata, beside the AUC of the trace's confidences when it has them); DSpark reports
0.81-0.90 for its trained confidence head. The target's entropy at ``t`` is drawn the same
way from depth 1's outcome (the target being unsure is when the first draft misses).
``H`` is monotone in ``pi`` only while ``pi > 1 / (alternatives + 1)``, which the clip to
``pi >= 0.02`` keeps (``alternatives <= 48``).

Generation cost: a few vectorised passes over the [N, gamma] arrays.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from dspark_sim.errors import InputError
from dspark_sim.traces.schema import AcceptanceTrace
from dspark_sim.traces.schema_v2 import V2Fields


def entropy_of(pi: np.ndarray, alternatives: int) -> np.ndarray:
    """Entropy (nats) of a distribution with top-1 mass ``pi`` and the rest spread evenly
    over ``alternatives`` tokens."""
    pi = np.clip(np.asarray(pi, dtype=np.float64), 1e-9, 1.0 - 1e-9)
    rest = 1.0 - pi
    return -pi * np.log(pi) - rest * np.log(rest / alternatives)


def rank_auc(score: np.ndarray, label: np.ndarray) -> float:
    """Area under the ROC curve of ``score`` for binary ``label`` (Mann-Whitney, ties
    counted half)."""
    score = np.asarray(score, dtype=np.float64).reshape(-1)
    label = np.asarray(label, dtype=bool).reshape(-1)
    pos, neg = int(label.sum()), int((~label).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(score, kind="stable")
    s = score[order]
    ranks = np.empty(s.size)
    # average ranks over ties
    _, first, counts = np.unique(s, return_index=True, return_counts=True)
    avg = first + (counts - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[label].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def _reached_rates(trace: AcceptanceTrace) -> np.ndarray:
    """The conditional acceptance per depth, 0 at a depth no chain reached (its NaN):
    what the synthetic outcomes past the recorded chain are drawn with."""
    return np.nan_to_num(trace.conditional_acceptance(), nan=0.0)


def _outcomes(trace: AcceptanceTrace, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(o [N, gamma] in {0, 1}, reached [N, gamma]: the chain reaches depth j)."""
    m = trace.accept_len.astype(np.int64)[:, None]
    j = np.arange(trace.gamma_max)[None, :]
    qbar = np.clip(_reached_rates(trace), 0.02, 0.98)
    past = rng.random((m.shape[0], trace.gamma_max)) < qbar[None, :]
    o = np.where(j < m, True, np.where(j == m, False, past))
    return o, j <= m


def synth_entropy(trace: AcceptanceTrace, *, seed: int = 0, separation: float = 0.6,
                  noise: float = 1.0, alternatives: int = 16) -> AcceptanceTrace:
    """``trace`` with synthetic ``draft_entropy`` [N, gamma] and ``target_entropy`` [N]
    (float16 nats) added to its v2 columns (other v2 columns kept)."""
    if not (separation >= 0 and noise >= 0 and 1 <= alternatives <= 48):
        raise InputError("traces entropy", "need separation >= 0, noise >= 0 and "
                                           "1 <= alternatives <= 48")
    rng = np.random.default_rng(seed)
    o, reached = _outcomes(trace, rng)
    qbar = np.clip(_reached_rates(trace), 0.02, 0.98)
    base = np.log(qbar / (1.0 - qbar))[None, :]
    x = base + separation * (2.0 * o - 1.0) + noise * rng.standard_normal(o.shape)
    pi = np.clip(1.0 / (1.0 + np.exp(-x)), 0.02, 1.0)
    draft_h = entropy_of(pi, alternatives)
    xt = base[:, 0] + separation * (2.0 * o[:, 0] - 1.0) + noise * rng.standard_normal(o.shape[0])
    target_h = entropy_of(np.clip(1.0 / (1.0 + np.exp(-xt)), 0.02, 1.0), alternatives)
    v2 = replace(trace.v2 or V2Fields(), draft_entropy=draft_h.astype(np.float16),
                 target_entropy=target_h.astype(np.float16))
    auc = {"draft_entropy": round(rank_auc(-draft_h[reached], o[reached]), 4)}
    if trace.conf is not None:
        auc["conf"] = round(rank_auc(trace.conf[reached], o[reached]), 4)
    gen = dict(trace.meta.generator)
    gen["entropy"] = {"kind": "synthetic (dspark_sim.traces.entropy)", "seed": seed,
                      "separation": separation, "noise": noise, "alternatives": alternatives,
                      "auc_on_reached_drafts": auc}
    return replace(trace, v2=v2, meta=replace(trace.meta, generator=gen))


def selfspec_trace(seed: int = 5) -> AcceptanceTrace:
    """The shipped ``selfspec-synthetic`` trace: the target drafting for itself over a
    sparse KV (SparseSpec-L, MagicDec's StreamingLLM drafts). An autoregressive drafter
    does not decay along the block (DSpark Fig. 2: autoregressive drafters stay flat), and
    a sparse-KV copy of the target agrees with it most of the time: position-1 acceptance
    0.90 / 0.88 / 0.80 (math / code / chat), no decay, gamma 8, with entropies."""
    from dspark_sim.traces.synth import DomainCurve, synth_drafter

    curves = (DomainCurve("math", p1=0.90, tau=None, decay=0.0),
              DomainCurve("code", p1=0.88, tau=None, decay=0.0),
              DomainCurve("chat", p1=0.80, tau=None, decay=0.0))
    base = synth_drafter(curves, gamma=8, requests_per_domain=16, positions=256,
                         drafter="selfspec",
                         target="any (self-speculation: the target over a sparse KV)",
                         seed=seed)
    return synth_entropy(base, seed=seed)
