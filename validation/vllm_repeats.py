"""Repeated measurements of one point, and what they and a fit say about its constants.

A *point* is one (setting, load): ``ngram-k3@c1``. ``vllm measure --rounds R`` measures
every point ``R`` times, in rounds that alternate the order of the settings, because on a
shared host a point measured twice half an hour apart differs by far more than the
effects being measured, and only repeats taken close together show how much. A point's
figure is the **median** of its repeats (robust to the one repeat a co-tenant slowed,
where a mean or a least-squares fit to every repeat is pulled by it); its **spread** is
the relative half-range ``(max - min) / 2 / median``. The run's **noise floor** is the
median spread over its points: the error below which no prediction can be told from a
remeasurement.

:func:`constant_uncertainty` puts an uncertainty on each constant a fit found, from the
fit's Jacobian at its solution (log space, weighted residuals) and the repeats:
``Cov(log theta) = s^2 (J'J)^+`` for the misfit the constants leave (``s^2`` = residual
sum of squares over (residuals - constants)), plus the scatter of the constants over a
seeded bootstrap of each point's repeats, propagated through the same linearisation (no
refit per sample: a fit is a few hundred simulations). It flags a constant the runs do
not identify (a direction of ``J`` with no weight, or an uncertainty beyond a factor of
2) and one pushed to its bound 0 (under a thousandth of the largest: the runs ask for
none of it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from dspark_sim.errors import InputError

if TYPE_CHECKING:
    from dspark_sim.validation.vllm_fit import BenchRun

FIGURES = ("output_throughput", "median_tpot_ms", "median_ttft_ms", "acceptance_length")
LABELS = {"output_throughput": "output tok/s", "median_tpot_ms": "TPOT",
          "median_ttft_ms": "TTFT", "acceptance_length": "tau"}
BOOTSTRAP_SAMPLES = 200
NOT_IDENTIFIED_LOG_SD = math.log(2.0)  # uncertain by more than a factor of 2
AT_BOUND = 1e-3  # a constant below this share of the largest one
NULL_WEIGHT = 0.3  # a constant this much in a direction the runs do not see


def relative_half_range(values: np.ndarray) -> float:
    """``(max - min) / 2 / median`` of a non-empty array: the spread of repeats (0 where
    the median is 0, so that an all-zero figure is not noise)."""
    med = float(np.median(values))
    return float((values.max() - values.min()) / 2.0 / med) if med else 0.0


@dataclass(frozen=True, eq=False)
class Point:
    """One (setting, load) and its repeats."""

    name: str
    runs: tuple[BenchRun, ...]

    @property
    def repeats(self) -> int:
        return len(self.runs)

    def values(self, fig: str) -> np.ndarray:
        return np.array([r.measured[fig] for r in self.runs if fig in r.measured], float)

    def median(self, fig: str) -> float | None:
        v = self.values(fig)
        return float(np.median(v)) if v.size else None

    def spread(self, fig: str) -> float | None:
        """Relative half-range of the repeats (0 with one); None where not measured."""
        v = self.values(fig)
        return relative_half_range(v) if v.size else None

    @property
    def run(self) -> BenchRun:
        """The repeat whose output throughput is nearest the median, carrying every
        figure's median: what a fit simulates (repeats serve the same requests)."""
        med = self.median("output_throughput")
        rep = min(self.runs, key=lambda r: abs(r.measured["output_throughput"] - med))
        measured = {f: self.median(f) for f in rep.measured}
        return rep if self.repeats == 1 else replace(rep, measured=measured)


def group_points(runs: list[BenchRun]) -> list[Point]:
    """The runs by point, in first-seen order; repeats of a point must serve the same
    requests (the same prompt set, seed, load and lengths), else they are not repeats."""
    groups: dict[str, list[BenchRun]] = {}
    for r in runs:
        groups.setdefault(r.name, []).append(r)
    for name, rs in groups.items():
        first = rs[0]
        for r in rs[1:]:
            if len(r.output_tokens) != len(first.output_tokens) \
                    or int(r.output_tokens.sum()) != int(first.output_tokens.sum()) \
                    or int(r.prompt_tokens.sum()) != int(first.prompt_tokens.sum()):
                raise InputError(str(r.path), f"a repeat of {name} (as {first.path.name}) "
                                              f"that served other requests "
                                              f"({len(r.output_tokens)} against "
                                              f"{len(first.output_tokens)}, or other "
                                              "lengths): a point's repeats must send the "
                                              "same requests")
    return [Point(name, tuple(rs)) for name, rs in groups.items()]


def noise_floor(points: list[Point]) -> dict[str, float | None]:
    """Per figure, the median spread over the points measured more than once (None
    without repeats)."""
    out: dict[str, float | None] = {}
    for fig in FIGURES:
        s = [p.spread(fig) for p in points if p.repeats > 1 and p.spread(fig) is not None]
        out[fig] = float(np.median(s)) if s else None
    return out


def noise_line(points: list[Point]) -> str | None:
    """The headline: the noise floor per figure, or None without repeats."""
    repeated = [p for p in points if p.repeats > 1]
    if not repeated:
        return None
    n = [p.repeats for p in repeated]
    return format_noise(noise_floor(points), len(repeated), min(n), max(n))


def format_noise(floor: dict, points: int, fewest: int, most: int) -> str:
    figs = ", ".join(f"{LABELS[f]} ±{v:.1%}" for f, v in floor.items() if v is not None)
    reps = str(fewest) if fewest == most else f"{fewest}-{most}"
    return (f"Noise floor (median relative half-range over {points} points of {reps} "
            f"repeats): {figs}.")


def points_summary(points: list[Point]) -> dict:
    """The manifest's ``points``: each point's files, and per figure its median, spread,
    min and max."""
    out = {}
    for p in points:
        figs = {}
        for f in FIGURES:
            v = p.values(f)
            if v.size:
                figs[f] = {"median": p.median(f), "spread": round(p.spread(f), 6),
                           "min": float(v.min()), "max": float(v.max())}
        out[p.name] = {"repeats": p.repeats, "files": [r.path.name for r in p.runs], **figs}
    return out


def points_markdown(points: list[Point]) -> str:
    """One row per point: repeats, and each figure's median ± spread."""
    lines = []
    head = noise_line(points)
    if head:
        lines += [head, ""]
    lines += ["| point | repeats | output tok/s | median TPOT ms | median TTFT ms | tau |",
              "|---|---|---|---|---|---|"]
    for p in points:
        cells = [p.name, str(p.repeats)]
        for f in FIGURES:
            m = p.median(f)
            cells.append("" if m is None else f"{m:.3g} ±{p.spread(f):.1%}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# -- the constants' uncertainty ---------------------------------------------------------
def log_covariance(jac: np.ndarray, residuals: np.ndarray, points: list[Point],
                   metrics: dict, seed: int = 0, tail: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """``Cov(log theta)`` of a fit's constants (the misfit they leave and the bootstrap,
    as :func:`constant_uncertainty` says), and which constants lie in a direction no
    residual moves."""
    J = np.asarray(jac, float)
    r = np.asarray(residuals, float)
    n, p = J.shape
    u, s, vt = np.linalg.svd(J, full_matrices=False)
    tol = (s.max() if s.size else 0.0) * 1e-6
    keep = s > tol
    inv_s = np.where(keep, 1.0 / np.where(keep, s, 1.0), 0.0)
    pinv_jtj = (vt.T * inv_s**2) @ vt
    pinv_j = (vt.T * inv_s) @ u.T
    cov = np.zeros((p, p))
    if n > p:
        cov += float(r @ r) / (n - p) * pinv_jtj
    if any(pt.repeats > 1 for pt in points) or tail is not None:
        cov += _bootstrap_cov(pinv_j, points, metrics, seed, tail)
    null = vt[~keep]  # directions no residual moves along
    unseen = np.abs(null).max(axis=0) > NULL_WEIGHT if null.size else np.zeros(p, bool)
    return cov, unseen


def constant_uncertainty(jac: np.ndarray, residuals: np.ndarray, theta: np.ndarray,
                         names: tuple[str, ...], points: list[Point], metrics: dict,
                         seed: int = 0, tail: np.ndarray | None = None) -> dict[str, dict]:
    """Per constant: its value, its relative standard error (of ``log theta``; None where
    nothing measures it) and a flag (``""``, ``"at its bound 0"``, ``"not identified"``).
    ``jac``/``residuals``: the fit's weighted log residuals and their Jacobian in
    ``log theta``, rows in ``points`` order, ``metrics`` (name: weight) within each.
    ``tail``: :data:`BOOTSTRAP_SAMPLES` rows of how the last residuals move over a
    bootstrap of what they measure (a fit's lone requests' TTFT line), added to the
    points' bootstrap."""
    n, p = np.shape(jac)
    cov, unseen = log_covariance(jac, residuals, points, metrics, seed, tail)
    sd = np.sqrt(np.maximum(np.diag(cov), 0.0))
    theta = np.asarray(theta, float)
    measured = n > p or any(pt.repeats > 1 for pt in points) or tail is not None
    out = {}
    for j, name in enumerate(names):
        flag = ""
        if theta[j] < AT_BOUND * theta.max():
            flag = "at its bound 0"
        elif unseen[j] or sd[j] > NOT_IDENTIFIED_LOG_SD:
            flag = "not identified"
        out[name] = {"value": float(theta[j]),
                     "relative_sd": float(sd[j]) if measured and not unseen[j] else None,
                     "flag": flag}
    return out


def _bootstrap_cov(pinv_j: np.ndarray, points: list[Point], metrics: dict, seed: int,
                   tail: np.ndarray | None = None) -> np.ndarray:
    """Covariance of ``log theta`` over a seeded bootstrap of each point's repeats: a
    resample moves each point's medians, so its weighted log residuals, and the
    linearised fit moves the constants by ``-J^+ dr``; ``tail``'s rows move the last
    residuals in the same samples."""
    rng = np.random.default_rng(seed)
    w = np.sqrt(np.array(list(metrics.values()), float))
    shifts = np.empty((BOOTSTRAP_SAMPLES, pinv_j.shape[0]))
    for b in range(BOOTSTRAP_SAMPLES):
        dr = []
        for pt in points:
            idx = rng.integers(0, pt.repeats, size=pt.repeats)
            for m, wm in zip(metrics, w, strict=True):
                v = pt.values(m)
                med = float(np.median(v))
                # residual = w log(sim / measured): a higher resampled median lowers it
                dr.append(wm * math.log(med / float(np.median(v[idx]))) if v.size == pt.repeats
                          else 0.0)
        # residuals past the points' (a fit's measured step times) hold their value,
        # but for the tail's
        dr = np.pad(np.array(dr), (0, pinv_j.shape[1] - len(dr)))
        if tail is not None:
            dr[len(dr) - tail.shape[1]:] = tail[b]
        shifts[b] = -pinv_j @ dr
    return np.cov(shifts, rowvar=False).reshape(pinv_j.shape[0], pinv_j.shape[0])


def constants_line(unc: dict[str, dict], points: int, steps: int = 0, lone: int = 0
                   ) -> str:
    """``step_fixed_ms 71.2 ±4 %, ..., draft_step_ms 0 (at its bound 0); 7 constants from
    4 points``; ``steps``: the batches whose decode step the runs measured directly (each
    one more figure a constant answers to); ``lone``: the requests behind a fitted TTFT
    line (two more figures: its ends), 0 without one."""
    parts = []
    for name, u in unc.items():
        v = f"{name} {u['value']:.4g}"
        if u["relative_sd"] is not None and u["flag"] != "at its bound 0":
            v += f" ±{u['relative_sd']:.0%}"
        if u["flag"]:
            v += f" ({u['flag']})"
        parts.append(v)
    n = len(unc)
    sources = [f"{points} points"] + ([f"{steps} measured decode steps"] if steps else []) \
        + ([f"the TTFT line of {lone} lone requests"] if lone else [])
    tail = f"{n} constants from " + (", ".join(sources[:-1]) + " and " + sources[-1]
                                     if len(sources) > 1 else sources[0])
    flagged = [k for k, u in unc.items() if u["flag"]]
    if points + steps + (2 if lone else 0) < n:
        tail += ": fewer points than constants, some are set by their start, not by the runs"
    elif flagged:
        tail += f"; {len(flagged)} not set by these runs"
    return ", ".join(parts) + f"; {tail}"
