"""Synthetic lossy schema-v2 fields for a trace: what ``asd`` needs (``tgt_top1_logit``,
``draft_tgt_logit``, ``draft_prob``) and a per-request answer label (``req_correct``),
generated *consistent with the trace's* ``accept_len`` (greedy decoding):

* depths ``j <= accept_len``: the draft is the target's argmax, regret exactly 0
  (``draft_tgt_logit == tgt_top1_logit``, bit for bit in float16);
* depth ``accept_len + 1`` (the first mismatch): regret ``r > 0``;
* deeper depths hang off a rejected draft: the draft equals the greedy token there with
  probability ``deep_match * c_j`` (``c_j`` the trace's conditional acceptance at depth
  ``j``: a block drafter's later drafts are partly independent of the earlier ones;
  ``deep_match < 1`` because they were drafted from a wrong parent), else ``r > 0``.

The model, per row ``t`` and depth ``j``::

    tgt_top1_logit  = L_t,  L_t ~ N(logit_mean, logit_sd)          (level only: regret is a gap)
    r (mismatch)    = regret_median * exp(regret_sigma * z),  z ~ N(0, 1)   (lognormal, nats)
    draft_tgt_logit = L_t - r                                      (stored float16; a gap
                                                                    below the float16 step at
                                                                    L_t reads as r > 0 anyway)
    draft_prob q    = sigmoid(logit(conf_tj) + q_noise * N(0, 1))  (drafter's own-token
                                                                    probability tracks its
                                                                    confidence head)
    req_correct     = Bernoulli(accuracy) per request              (the greedy output's label)

``regret_median`` is the free parameter: :func:`dspark_sim.validation.lossy.fit_regret_median`
solves it so that ``asd`` at its default setting serves ASD's reported tau gain
(DeepSeek-V4-Flash-DSpark, serial GSM8K: 4.65 -> 4.93) on the trace (common random
numbers: ``z`` is drawn once). ``accuracy`` is an assumption (the paper's greedy accuracy
is not in our references); the labels only say what strict decoding scores, the lossy
policies are bounded against them. See docs/lossy.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

from dspark_sim.errors import InputError
from dspark_sim.traces.schema import AcceptanceTrace
from dspark_sim.traces.schema_v2 import V2Fields


@dataclass(frozen=True)
class LossyModel:
    regret_median: float = 1.0  # nats: median target logit gap at a mismatch (fitted)
    regret_sigma: float = 1.0  # lognormal spread of the gap
    deep_match: float = 0.5  # P(deeper draft = greedy token) / the depth's acceptance
    q_noise: float = 0.5  # logit noise between confidence and own-token probability
    logit_mean: float = 18.0  # target top-1 logit level (float16 step 1/64 near it)
    logit_sd: float = 2.0
    accuracy: float = 0.95  # greedy answer accuracy of the labels (assumed)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _logit(p):
    p = np.clip(p, 1e-4, 1 - 1e-4)
    return np.log(p / (1 - p))


@dataclass(frozen=True, eq=False)
class LossyDraws:
    """The model's random draws for one trace, reused for every ``regret_median``."""

    z: np.ndarray  # [N, gamma] lognormal exponent
    deep: np.ndarray  # [N, gamma] bool: a deeper draft equals the greedy token
    top: np.ndarray  # [N] float16 target top-1 logit
    q: np.ndarray  # [N, gamma] float16 draft_prob
    correct: np.ndarray  # [R] int8 labels


def draw(trace: AcceptanceTrace, model: LossyModel, rng: np.random.Generator) -> LossyDraws:
    n, g = trace.num_positions, trace.gamma_max
    m = trace.accept_len.astype(np.int64)
    j = np.arange(g)[None, :]
    # [g] P(depth j accepted | prefix accepted); 0 at a depth no chain reached (NaN there)
    cond = np.nan_to_num(trace.conditional_acceptance(), nan=0.0)
    deep = (j > m[:, None]) & (rng.random((n, g)) < model.deep_match * cond[None, :])
    z = rng.standard_normal((n, g))
    top = (model.logit_mean + model.logit_sd * rng.standard_normal(n)).astype(np.float16)
    conf = trace.conf if trace.conf is not None else np.tile(cond, (n, 1))
    q = _sigmoid(_logit(conf) + model.q_noise * rng.standard_normal((n, g)))
    q = np.clip(q, 1e-3, 1.0).astype(np.float16)
    correct = (rng.random(trace.num_requests) < model.accuracy).astype(np.int8)
    return LossyDraws(z, deep, top, q, correct)


def fields(trace: AcceptanceTrace, model: LossyModel, d: LossyDraws) -> V2Fields:
    """The v2 columns for ``model`` from the draws (float16, as a capture stores them)."""
    g = trace.gamma_max
    m = trace.accept_len.astype(np.int64)
    j = np.arange(g)[None, :]
    zero = (j < m[:, None]) | d.deep  # the draft is the target's (recorded) argmax
    r = model.regret_median * np.exp(model.regret_sigma * d.z)
    top = np.repeat(d.top[:, None], g, axis=1)
    low = (top.astype(np.float64) - r).astype(np.float16)
    # a mismatch keeps a positive stored gap: one float16 step below a rounded-up tie
    tie = ~zero & (low >= top)
    low[tie] = np.nextafter(top[tie], np.float16(-np.inf))
    return V2Fields(tgt_top1_logit=top, draft_tgt_logit=np.where(zero, top, low),
                    draft_prob=d.q, req_correct=d.correct)


def add_lossy_fields(trace: AcceptanceTrace, model: LossyModel | None = None, *,
                     seed: int = 0, draws: LossyDraws | None = None) -> AcceptanceTrace:
    """``trace`` with the synthetic lossy columns (other v2 columns kept) and the model
    recorded in its generator metadata."""
    if trace.meta.temperature != 0.0 and trace.meta.source != "synthetic":
        raise InputError(trace.source_path, "lossy fields model greedy decoding; this trace "
                                            f"is at temperature {trace.meta.temperature:g}")
    model = model or LossyModel()
    if not (model.regret_median > 0 and 0 <= model.deep_match <= 1 and 0 <= model.accuracy <= 1):
        raise InputError("synth-lossy", "regret_median > 0, deep_match and accuracy in [0, 1]")
    d = draws or draw(trace, model, np.random.default_rng(seed))
    f = fields(trace, model, d)
    keep = {} if trace.v2 is None else {n: getattr(trace.v2, n) for n in trace.v2.present()}
    keep.update({n: getattr(f, n) for n in f.present()})
    gen = dict(trace.meta.generator)
    gen["lossy"] = {"model": asdict(model), "seed": seed}
    return replace(trace, v2=V2Fields(**keep), meta=replace(trace.meta, generator=gen))
