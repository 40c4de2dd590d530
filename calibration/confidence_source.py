"""Confidences for a trace that has none, and "what if I drafted more".

Traces imported from a real engine's aggregates (vLLM's ``/metrics`` counters, a ``vllm
bench serve`` result, SpecDecode-Bench's acceptance lists) carry no per-draft
confidences, so the policies that rank drafts by calibrated survival (``confidence``,
``vllm-adaptive``, ``dfly``, ``threshold:P`` ...) cannot replay them as they are.
:func:`apply_conf_source` gives a trace confidences from a named source:

* ``trace``: the trace's own ``conf`` (an error where it has none);
* ``position``: ``conf[t, k]`` = the trace's conditional acceptance at position ``k``
  (:func:`position_rates`, 0 where no chain reached ``k``): a
  calibrated estimate that knows the position and nothing about the text, so it cannot
  tell an easy row from a hard one (AUC near 0.5 within a position);
* with a ``draft_tokens`` column, a draft the drafter never proposed gets confidence 0
  from ``position`` and ``synthetic:AUC``: "no proposal" is carried by that column, a
  state of its own, not a rejection; the policies never rank such a draft, and the
  report scores only the drafts proposed;
* ``synthetic:AUC``: an exactly calibrated confidence head that separates accepted from
  rejected drafts with that AUC at every position. Per row ``t`` and draft ``k`` the
  outcome is the trace's (``accept_len[t] >= k`` given ``k - 1`` accepted; past the first
  rejection, where the chain never got, a Bernoulli(``p_k``) draw at the position's
  conditional rate), a score ``s ~ N(mu * label, 1)`` with ``mu = sqrt(2) *
  Phi^-1(AUC)`` (so ``P(s_accepted > s_rejected) = AUC``) and the confidence is the
  posterior ``P(label = 1 | s) = sigmoid(logit(p_k) + mu * s - mu^2 / 2)``, calibrated by
  construction. Pooled over positions whose rates differ, the measured AUC is a little
  above the stated one (the position itself separates too).

Every source's report gives the ECE (10 equal-width bins) and the rank AUC of the
confidences against the outcomes over the drafts a chain reaches (``k <= accept_len +
1``), the drafts a verifier can judge.

:func:`extend_gamma` extrapolates a trace past the positions it records: a row whose
whole draft was accepted (``accept_len == gamma_max``) goes on accepting positions
``gamma_max + 1 .. gamma`` each with the last recorded position's conditional acceptance
(a geometric tail). Both draw from ``np.random.default_rng([seed, tag])``, a stream of
their own, so a run's main stream (arrivals, lengths, trace rows) is the one it would be
without them.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

import numpy as np

from dspark_sim.calibration.fit import auc as rank_auc
from dspark_sim.calibration.fit import ece as binned_ece
from dspark_sim.errors import InputError
from dspark_sim.traces.schema import AcceptanceTrace

OPTION = "--conf-source"
SOURCES_TEXT = ("give trace (the trace's own conf), position (each position's acceptance "
                "rate) or synthetic:AUC (calibrated confidences of that AUC, 0.5 < AUC < 1)")
ECE_BINS = 10
CONF_CLIP = 1e-6
MAX_GAMMA = 127  # accept_len is int8
# the second word of each stream's seed: distinct streams for distinct jobs, none the run's
CONF_STREAM_TAG = 0x636F6E66  # "conf"
EXTEND_STREAM_TAG = 0x67616D6D  # "gamm"
# generator-metadata keys under which a run's trace records what was done to it
CONF_RECORD = "conf_source"
EXTEND_RECORD = "extrapolated"


@dataclass(frozen=True)
class ConfSource:
    """A parsed ``--conf-source``: ``kind`` is trace, position or synthetic."""

    kind: str
    auc: float | None = None

    @property
    def text(self) -> str:
        return f"synthetic:{self.auc:g}" if self.kind == "synthetic" else self.kind


@dataclass(frozen=True)
class ConfReport:
    """What the confidences are and how they score over the drafts a chain reaches."""

    source: str
    ece: float
    auc: float

    @property
    def text(self) -> str:
        return (f"{self.source} (measured over the drafts a chain reaches: ECE "
                f"{self.ece:.4f}, AUC {self.auc:.4f})")


@dataclass(frozen=True)
class ExtendReport:
    """Which draft positions (1-based) were extrapolated, from which position's rate."""

    from_gamma: int
    to_gamma: int
    rate: float

    @property
    def text(self) -> str:
        if self.to_gamma <= self.from_gamma:
            return f"none (the trace records {self.from_gamma} draft positions)"
        span = (f"position {self.to_gamma}" if self.to_gamma == self.from_gamma + 1
                else f"positions {self.from_gamma + 1}-{self.to_gamma}")
        return (f"{span} extrapolated from position {self.from_gamma}'s conditional "
                f"acceptance {self.rate:.2f}")


def parse_conf_source(spec: str) -> ConfSource:
    """``trace`` | ``position`` | ``synthetic:AUC``; anything else is one-line refused."""
    if not isinstance(spec, str) or not spec.strip():
        raise InputError(OPTION, f"is empty: {SOURCES_TEXT}")
    kind, sep, arg = spec.strip().partition(":")
    kind = kind.strip().lower()
    if kind in ("trace", "position"):
        if sep:
            raise InputError(OPTION, f"{kind} takes no argument, got {spec!r}")
        return ConfSource(kind)
    if kind != "synthetic":
        raise InputError(OPTION, f"unknown source {spec!r}; {SOURCES_TEXT}")
    try:
        value = float(arg)
    except ValueError:
        raise InputError(OPTION, f"synthetic:AUC needs a number, e.g. synthetic:0.85, got "
                                 f"{spec!r}") from None
    if not 0.5 < value < 1.0:  # NaN fails too
        raise InputError(OPTION, f"synthetic:AUC needs 0.5 < AUC < 1 (DSpark reports "
                                 f"0.81-0.90), got {arg.strip()}")
    return ConfSource("synthetic", value)


def _reached_outcomes(trace: AcceptanceTrace) -> tuple[np.ndarray, np.ndarray]:
    """(reached [N, gamma]: a chain gets to draft k and the drafter proposed it;
    accepted [N, gamma]: and the verifier accepts it)."""
    m = trace.accept_len.astype(np.int64)[:, None]
    j = np.arange(trace.gamma_max)[None, :]
    reached = j <= m
    if trace.draft_tokens is not None:  # a draft never proposed is never judged
        reached &= j < trace.draft_tokens.astype(np.int64)[:, None]
    return reached, j < m


def position_rates(trace: AcceptanceTrace) -> np.ndarray:
    """The conditional acceptance per draft position (DSpark Fig. 2,
    ``AcceptanceTrace.conditional_acceptance``; with a ``draft_tokens`` column, over the
    drafts proposed), 0 where no chain reached it."""
    reached, accepted = _reached_outcomes(trace)
    n = reached.sum(axis=0).astype(np.float64)
    return np.divide(accepted.sum(axis=0), n, out=np.zeros_like(n), where=n > 0)


def measure_conf(trace: AcceptanceTrace, conf: np.ndarray, source: str) -> ConfReport:
    """ECE (10 equal-width bins) and rank AUC of ``conf`` against the trace's outcomes,
    over the drafts a chain reaches."""
    reached, accepted = _reached_outcomes(trace)
    c, y = conf[reached], accepted[reached]
    return ConfReport(source, round(binned_ece(c, y, bins=ECE_BINS), 4),
                      round(rank_auc(c, y), 4))


def synthetic_conf(trace: AcceptanceTrace, auc: float, rng: np.random.Generator) -> np.ndarray:
    """Calibrated confidences [N, gamma] (float32) of the stated per-position AUC."""
    rates = position_rates(trace)
    reached, accepted = _reached_outcomes(trace)
    # past the first rejection the chain never got there: the outcome is a draw at the
    # position's rate, so the head's scores there look like anywhere else at that depth
    unreached_label = rng.random(accepted.shape) < rates[None, :]
    label = np.where(reached, accepted, unreached_label)
    mu = math.sqrt(2.0) * statistics.NormalDist().inv_cdf(auc)
    score = rng.standard_normal(label.shape) + mu * label
    p = np.clip(rates, CONF_CLIP, 1.0 - CONF_CLIP)
    x = np.log(p / (1.0 - p))[None, :] + mu * score - mu * mu / 2.0
    conf = 1.0 / (1.0 + np.exp(-x))
    return np.clip(conf, CONF_CLIP, 1.0 - CONF_CLIP).astype(np.float32)


def apply_conf_source(trace: AcceptanceTrace, spec: str | ConfSource, *,
                      seed: int = 0) -> tuple[AcceptanceTrace, ConfReport]:
    """``trace`` with confidences from ``spec`` (see the module) and their report; the
    report is also kept in the trace's generator metadata (``conf_source``)."""
    src = spec if isinstance(spec, ConfSource) else parse_conf_source(spec)
    if src.kind == "trace":
        if trace.conf is None:
            raise InputError(trace.source_path, f"the trace has no 'conf' column; {OPTION}: "
                             "give position or synthetic:AUC")
        conf = trace.conf
    elif src.kind == "position":
        conf = np.broadcast_to(position_rates(trace).astype(np.float32),
                               (trace.num_positions, trace.gamma_max)).copy()
    else:
        rng = np.random.default_rng([seed, CONF_STREAM_TAG])
        conf = synthetic_conf(trace, src.auc, rng)
    if trace.draft_tokens is not None and src.kind != "trace":
        # a draft the drafter never proposed has no confidence: 0, never ranked (the
        # policies read which drafts were proposed); drawn first, so the rows that
        # proposed get the confidences they would get without the column
        proposed = np.arange(trace.gamma_max)[None, :] < trace.draft_tokens[:, None]
        conf = np.where(proposed, conf, np.float32(0.0)).astype(np.float32)
    report = measure_conf(trace, conf, src.text)
    gen = dict(trace.meta.generator)
    gen[CONF_RECORD] = {"spec": src.text, "seed": int(seed), "gamma": trace.gamma_max,
                        "ece": report.ece, "auc": report.auc, "ece_bins": ECE_BINS}
    return replace(trace, conf=conf, meta=replace(trace.meta, generator=gen)), report


def extend_gamma(trace: AcceptanceTrace, gamma: int, *,
                 seed: int = 0) -> tuple[AcceptanceTrace, ExtendReport]:
    """``trace`` drafted ``gamma`` tokens per step: positions past its ``gamma_max``
    extrapolated with the last recorded position's conditional acceptance (a geometric
    tail on the rows that accepted the whole recorded draft); ``conf``, if any, takes
    that rate at the new positions. ``gamma <= gamma_max`` leaves the rows as they are.
    ``tv_accept`` (captured only, read by no policy) is dropped: it is per position and
    cannot be extrapolated; a trace with schema-v2 columns is refused for the same
    reason. The report is also kept in the generator metadata (``extrapolated``)."""
    if isinstance(gamma, bool) or not isinstance(gamma, int | np.integer) \
            or not 1 <= gamma <= MAX_GAMMA:
        raise InputError("--extrapolate-gamma", f"must be an integer in [1, {MAX_GAMMA}] "
                         f"(accept_len is int8), got {gamma!r}")
    g0 = trace.gamma_max
    rate = float(position_rates(trace)[g0 - 1]) if g0 >= 1 else 0.0
    report = ExtendReport(g0, max(int(gamma), g0), round(rate, 4))
    gen = dict(trace.meta.generator)
    gen[EXTEND_RECORD] = {"gamma": report.to_gamma, "from_gamma": g0, "rate": report.rate,
                          "seed": int(seed), "text": report.text}
    if gamma <= g0:
        return replace(trace, meta=replace(trace.meta, generator=gen)), report
    if trace.v2 is not None and not trace.v2.empty:
        raise InputError("--extrapolate-gamma", f"{trace.source_path} has schema-v2 columns "
                         "(tree, entropy or lossy fields), which cannot be extrapolated past "
                         f"the {g0} positions they record")
    extra = gamma - g0
    accept_len = trace.accept_len.astype(np.int64)
    full = np.flatnonzero(accept_len == g0)
    rng = np.random.default_rng([seed, EXTEND_STREAM_TAG])
    accept_len[full] += _geometric_runs(rng, full.size, rate, extra)
    conf = None
    if trace.conf is not None:
        tail = np.full((trace.num_positions, extra), rate, np.float32)
        conf = np.concatenate([trace.conf.astype(np.float32), tail], axis=1)
    proposed = trace.draft_tokens
    if proposed is not None:  # a drafter that proposed the whole block proposes the longer one
        proposed = np.where(proposed == g0, gamma, proposed).astype(np.int8)
    meta = replace(trace.meta, gamma_max=int(gamma), generator=gen)
    return replace(trace, accept_len=accept_len.astype(np.int8), conf=conf, tv_accept=None,
                   draft_tokens=proposed, meta=meta), report


def _geometric_runs(rng: np.random.Generator, n: int, rate: float, cap: int) -> np.ndarray:
    """``n`` runs of leading successes at ``rate`` each, capped at ``cap``."""
    if rate >= 1.0:
        return np.full(n, cap, np.int64)
    if rate <= 0.0:
        return np.zeros(n, np.int64)
    # failures before the first success of Bernoulli(1 - rate) = accepted run length
    return np.minimum(rng.geometric(1.0 - rate, size=n) - 1, cap)


def check_conf_source(spec: str | None) -> None:
    """``SimConfig.validate``'s check of a ``conf_source`` value (None: not given)."""
    if spec is not None:
        parse_conf_source(spec)
