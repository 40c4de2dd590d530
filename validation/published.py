"""Published points the shipped profiles are fitted to, or reproduce without being fitted.

Each :class:`Point` runs the simulator in the published setup (closed-loop concurrency,
prompt and output lengths, the drafter's acceptance as published) and reads one figure;
``band`` is the range the simulated figure must fall in. ``fitted`` points chose the
profile's free parameters (``benchmarks/fit_published.py``); the others are held out.
``tests/validation/test_published.py`` checks every point; ``docs/profiles.md`` lists them.

Sources (figures in ../shared/reference/PUBLISHED_FIGURES.md):

* ``v4pro-b300``: vLLM's adaptive-verification write-up (vllm-project.github.io,
  2026-08-14): DeepSeek-V4-Pro, TP8 + EP on 8x B300, SPEED-Bench qualitative prompts,
  512 output tokens, concurrency 1-256, ``num_speculative_tokens`` 7; its adaptive arm is
  ``vllm-adaptive`` here (one-step-old confidences, current ``T + B`` costs, global search).
* ``v4flash-b300``: the same post's Figure 3 (``fig3-pareto.svg``, read from its point
  coordinates: a primary source): DeepSeek-V4-Flash, TP4 + EP on 4x B300, 880 prompts
  (240 at c = 1) x 512 output tokens, concurrency 1-256, none / fixed k = 5 / fixed k = 7
  / adaptive (``vllm-adaptive`` here), throughput and per-user speed at every point.
* ``v4flash-h200``: DSpark §5.4 (Fig. 7, Fig. 8): DeepSeek-V4-Flash production decode
  (data-parallel attention ranks of an expert-parallel group, disaggregated prefill),
  DSpark-5 against MTP-1, per-rank concurrency 1-256.
* ``glm47-h20``: SGLang PR #23336 (GLM-4.7-FP8 with its MTP layer, concurrency 2, no
  speculation, fixed 1 / 3 / 7 steps and the adaptive arm) and AutoSpec (PR #22246: the
  best fixed step count at batch 1 and 64). The GPUs are not published: 8x H20 assumed
  (calibration/roofline.py). The adaptive arm is ``sparsespec:conf``: one step count per
  batch, k* = argmax expected tokens / step time from calibrated confidences and the
  profile's costs (SGLang's throughput-aware strategy, PR #28045); PR #23336's default
  controller (an EMA of accept lengths with hysteresis over 1 / 3 / 7) is not modelled.
* ``llama31-8b-h100``: the published linear cost fit of "Speculative Decoding:
  Performance or Illusion?" (arXiv 2601.11580): speedups over no speculation shrink as
  the batch grows from 1 to 128.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import polars as pl

from dspark_sim.calibration.profile import EngineProfile, load_profile
from dspark_sim.sim.api import prepare, simulate
from dspark_sim.sim.config import DeploymentConfig, SimConfig, WorkloadConfig
from dspark_sim.sim.frontier import headline


@dataclass
class Runner:
    """Runs (and caches) the simulations one profile's points read."""

    profile: EngineProfile
    base: SimConfig
    requests: Callable[[int], int]  # requests per point at a concurrency
    cache: dict = field(default_factory=dict)

    def summary(self, policy: str, concurrency: int) -> dict:
        key = (policy, concurrency)
        if key not in self.cache:
            w = replace(self.base.workload, max_concurrency=concurrency,
                        num_requests=self.requests(concurrency))
            cfg = replace(self.base, policy=policy, workload=w,
                          gamma_max=None if policy in ("mtp1", "none") else self.base.gamma_max)
            # a grid over the policies of one published setup: its trace is the speculative
            # arms', which `none` leaves unread (the lengths are the setup's own)
            inputs = prepare(cfg, profile=self.profile, grid_point=True)
            self.cache[key] = simulate(inputs).summary
        return self.cache[key]

    def steady(self, policy: str, concurrency: int, metric: str) -> float:
        s = self.summary(policy, concurrency)
        v = s.get(f"steady_{metric}")
        return float(v if v is not None else s[metric])

    def fronts(self, candidate: str, baseline: str, loads: list[int]):
        from dspark_sim.sim.frontier import Front

        out = []
        for pol in (candidate, baseline):
            x = [self.steady(pol, c, "median_interactivity") for c in loads]
            y = [self.steady(pol, c, "output_throughput_per_gpu") for c in loads]
            out.append(Front.from_points(pol, x, y))
        return out

    def matched_gain(self, candidate: str, baseline: str, loads: list[int],
                     floor_fraction: float = 0.25, ceil_fraction: float = 0.75) -> dict:
        from dspark_sim.sim.frontier import matched_throughput_gain

        a, b = self.fronts(candidate, baseline, loads)
        return matched_throughput_gain(a, b, floor_fraction=floor_fraction,
                                       ceil_fraction=ceil_fraction)

    def front_headline(self, candidate: str, baseline: str, loads: list[int],
                       tiers=(80.0, 120.0)) -> dict:
        rows = []
        for pol in (candidate, baseline):
            for c in loads:
                rows.append({"policy": pol, "policy_spec": pol, "concurrency": c,
                             "load": float(c), "load_kind": "concurrency", "seed": 0,
                             "point_id": f"{pol}@{c}", "stable": True,
                             "median_interactivity": self.steady(pol, c, "median_interactivity"),
                             "output_throughput_per_gpu":
                                 self.steady(pol, c, "output_throughput_per_gpu")})
        return headline(pl.DataFrame(rows), candidate=candidate, baseline=baseline,
                        tiers=list(tiers), basis="whole")[0]


@dataclass(frozen=True)
class Point:
    profile: str
    name: str
    published: float | str
    band: tuple[float, float]
    fitted: bool
    source: str
    measure: Callable[[Runner], float]

    def check(self, runner: Runner) -> tuple[float, bool]:
        value = float(self.measure(runner))
        return value, self.band[0] <= value <= self.band[1]


# -- setups -------------------------------------------------------------------------------------

V4PRO_LOADS = [1, 16, 32, 64, 128, 256]
V4FLASH_LOADS = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256]


V4FLASH_B300_TRACE = "dspark-v4flash-speedbench-synthetic"


def runner(profile_name: str, profile: EngineProfile | None = None,
           trace: str | None = None) -> Runner:
    """The published setup of ``profile_name`` (``profile`` overrides the shipped one,
    e.g. a candidate during fitting; ``trace`` the setup's trace, a path or name)."""
    prof = profile or load_profile(profile_name)
    if profile_name == "v4flash-b300":
        # vLLM's Figure 3 setup: SPEED-Bench qualitative, 880 prompts (240 at c = 1) of
        # ~250 tokens, 512 output tokens; the post's DSpark drafter (block 7)
        base = SimConfig(policy="none", trace=trace or V4FLASH_B300_TRACE,
                         deployment=DeploymentConfig(replicas=1, profile=profile_name),
                         workload=WorkloadConfig(arrival="closed", num_requests=880,
                                                 lengths="fixed:250:512"))
        return Runner(prof, base, lambda c: 240 if c == 1 else 880)
    if profile_name == "v4pro-b300":
        # SPEED-Bench qualitative: 880 prompts of ~1 kB (~250 tokens), 512 output tokens
        base = SimConfig(policy="none", trace="dspark-v4pro-synthetic",
                         deployment=DeploymentConfig(replicas=1, profile=profile_name),
                         workload=WorkloadConfig(arrival="closed", num_requests=880,
                                                 lengths="fixed:250:512"))
        return Runner(prof, base, lambda c: 240 if c == 1 else 880)
    if profile_name == "v4flash-h200":
        # live chat traffic: Azure-conversation lengths; DSpark-5 (gamma 5) vs MTP-1
        base = SimConfig(policy="none", gamma_max=5, trace="dspark-v4flash-synthetic",
                         deployment=DeploymentConfig(replicas=1, profile=profile_name),
                         workload=WorkloadConfig(arrival="closed", num_requests=400))
        return Runner(prof, base, lambda c: max(400, 12 * c))
    if profile_name == "glm47-h20":
        # ~1,024 output tokens per request: 447 tok/s x 4.58 s mean latency / 2 requests
        base = SimConfig(policy="none", trace="glm47-mtp-synthetic",
                         deployment=DeploymentConfig(replicas=1, profile=profile_name),
                         workload=WorkloadConfig(arrival="closed", num_requests=16,
                                                 lengths="fixed:200:1024"))
        return Runner(prof, base, lambda c: max(16, 2 * c))
    if profile_name == "llama31-8b-h100":
        base = SimConfig(policy="none", trace="dspark-synthetic",
                         deployment=DeploymentConfig(replicas=1, profile=profile_name),
                         workload=WorkloadConfig(arrival="closed", num_requests=200,
                                                 lengths="fixed:200:256", domain="chat"))
        return Runner(prof, base, lambda c: max(120, 4 * c))
    raise KeyError(profile_name)


def _ratio(policy: str, baseline: str, c: int, metric: str = "output_throughput"):
    return lambda r: r.steady(policy, c, metric) / r.steady(baseline, c, metric)


def _peak_load(policy: str, loads: list[int]):
    def measure(r: Runner) -> float:
        t = [r.steady(policy, c, "output_throughput") for c in loads]
        return float(loads[int(np.argmax(t))])

    return measure


def _budget(policy: str, c: int):
    return lambda r: r.steady(policy, c, "mean_verify_tokens_per_request_step")


def _best_fixed(c: int, ks=range(1, 8)):
    """The fixed step count with the highest output throughput at concurrency ``c``."""
    def measure(r: Runner) -> float:
        t = [r.steady(f"fixed:{k}", c, "output_throughput") for k in ks]
        return float(list(ks)[int(np.argmax(t))])

    return measure


def _over_best_fixed(policy: str, c: int, ks=(1, 3, 7)):
    return lambda r: r.steady(policy, c, "output_throughput") / max(
        r.steady(f"fixed:{k}", c, "output_throughput") for k in ks)


def _speedup(k: int, c: int):
    return _ratio(f"fixed:{k}", "none", c)


VLLM = ("vLLM adaptive verification, V4-Pro on 8x B300 (vllm-project.github.io 2026-08-14; "
        "secondary: a second-hand reading, no primary source found again)")
FIG3 = ("vLLM adaptive verification, Figure 3 (fig3-pareto.svg, PR #297), V4-Flash on 4x B300 "
        "(primary: read from the SVG's point coordinates)")
DSPARK = "DSpark §5.4 (Fig. 7, Fig. 8), DeepSeek-V4-Flash production"
SDB = "SpecDecode-Bench Llama-3.1-8B H100 fit (arXiv 2601.11580)"
SGL = "SGLang PR #23336, GLM-4.7-FP8 MTP, concurrency 2 (8x H20 assumed)"
AUTOSPEC = "SGLang AutoSpec (PR #22246), GLM-4.7-FP8 (8x H20 assumed)"
GLM_ADAPTIVE = "sparsespec:conf"  # one step count per batch from confidences and costs

# Figure 3, as digitised: (output tok/s, tok/s/user) per arm and concurrency. The arms
# here: none, fixed:5, fixed:7, vllm-adaptive (the post's adaptive verification).
FIG3_POINTS: dict[str, dict[int, tuple[float, float]]] = {
    "none": {1: (168, 171), 16: (1671, 108), 32: (2606, 84), 64: (3818, 62),
             128: (5490, 45), 256: (8455, 36)},
    "fixed:5": {1: (386, 426), 16: (2412, 165), 32: (3635, 123), 64: (5657, 98),
                128: (7406, 68), 256: (5295, 25)},
    "fixed:7": {1: (386, 419), 16: (2871, 192), 32: (4290, 146), 64: (6164, 110),
                128: (4239, 37), 256: (4792, 25)},
    "vllm-adaptive": {1: (378, 398), 16: (2903, 201), 32: (4555, 157), 64: (6748, 116),
                      128: (9884, 91), 256: (11155, 53)},
}
# The subset the v4flash-b300 profile (and its trace's tau) was fitted to: no speculation
# at every concurrency, fixed k = 5 at 1-64 and at 256 (the one eager arm it sees); the
# rest is held out.
FIG3_FITTED = {("none", c) for c in FIG3_POINTS["none"]} | {
    ("fixed:5", c) for c in (1, 16, 32, 64, 256)}
V4FLASH_B300_LOADS = [1, 16, 32, 64, 128, 256]
# Figure 3 points the v4flash-b300 profile does not reproduce within its band:
# (arm, concurrency, metric) -> why; they are checked as expected failures
# (tests/validation/test_published.py) and listed in docs/profiles.md. None today: every throughput
# and per-user figure falls in its band (the shape below does not).
FIG3_MISSES: dict[tuple[str, int, str], str] = {}


def _whole(arm: str, c: int, metric: str):
    """A figure over the whole run, as ``vllm bench serve`` reports it (output tokens over
    the benchmark's duration, the ramp-down included; the median TPOT over every request),
    not the steady window the other profiles' points read."""
    return lambda r: float(r.summary(arm, c)[metric])


def _fig3_points() -> list[Point]:
    out = []
    for arm, row in FIG3_POINTS.items():
        for c, (thr, user) in row.items():
            fitted = (arm, c) in FIG3_FITTED
            for metric, pub, (lo, hi), unit in (
                    ("output_throughput", thr, (0.8, 1.2), "output tok/s"),
                    ("median_interactivity", user, (0.75, 1.25), "tok/s/user")):
                if (arm, c, metric) in FIG3_MISSES:
                    continue
                out.append(Point("v4flash-b300", f"{arm} @ C={c}: {unit}", pub,
                                 (lo * pub, hi * pub), fitted, FIG3, _whole(arm, c, metric)))
    return out


def _fig3_misses() -> list[tuple[Point, str]]:
    fig = FIG3_POINTS
    out = [(Point("v4flash-b300", "shape: fixed:7 falls from C=64 to C=128 (4,239 / 6,164)",
                  round(fig["fixed:7"][128][0] / fig["fixed:7"][64][0], 2), (0.0, 0.9), False,
                  FIG3, lambda r: (_whole("fixed:7", 128, "output_throughput")(r)
                                   / _whole("fixed:7", 64, "output_throughput")(r))),
            "the simulator gives 0.92 (5,202 -> 4,760 tok/s) against vLLM's 0.69. The fall "
            "itself is modelled: 64 x 8 = 512 verify tokens plus the prompts joining stay in "
            "the captured graphs, 128 x 8 = 1,024 plus any prompt runs eager and pays the "
            "fitted 57.5 ms launch penalty, so C = 128's steps (91 ms) cost 2.4x C = 64's "
            "(38 ms) for twice the tokens. What is short is C = 64's level: fixed k = 7 runs "
            "13-17 % low at C = 16-64 (tau(7) / tau(5) is 1.05 on this trace, which the "
            "post's < 10 % survival of the 7th draft caps, where the figure's fixed 7 over "
            "fixed 5 asks for +9-19 %), and steps of 600-1,000 graph tokens run ~20 % slow "
            "per user (fixed 5 and adaptive at 128 too): one per-token cost, fitted up to "
            "475 tokens, cannot follow vLLM's flatter cost there")]
    for (arm, c, metric), why in FIG3_MISSES.items():
        thr, user = FIG3_POINTS[arm][c]
        pub, (lo, hi), unit = ((thr, (0.8, 1.2), "output tok/s") if metric == "output_throughput"
                               else (user, (0.75, 1.25), "tok/s/user"))
        out.append((Point("v4flash-b300", f"{arm} @ C={c}: {unit}", pub, (lo * pub, hi * pub),
                          (arm, c) in FIG3_FITTED, FIG3, _whole(arm, c, metric)), why))
    return out


def _fig3_shape() -> list[Point]:
    """Figure 3's shape, held out: fixed k = 7's cliff between 64 and 128 clients (at the
    1,024-token capture limit), fixed k = 5 below none only at 256, adaptive above every
    fixed k at 128 and 256."""
    thr = "output_throughput"

    def t(r, arm, c):
        return _whole(arm, c, thr)(r)

    def over_fixed(c):
        return lambda r: t(r, "vllm-adaptive", c) / max(t(r, "fixed:5", c), t(r, "fixed:7", c))

    fig = FIG3_POINTS
    return [
        Point("v4flash-b300", "shape: fixed:5 above none at C=1-128 (smallest ratio)",
              round(min(fig["fixed:5"][c][0] / fig["none"][c][0] for c in (1, 16, 32, 64, 128)),
                    2), (1.0, 10.0), False, FIG3,
              lambda r: min(t(r, "fixed:5", c) / t(r, "none", c) for c in (1, 16, 32, 64, 128))),
        Point("v4flash-b300", "shape: fixed:5 below none at C=256 (5,295 / 8,455)",
              round(fig["fixed:5"][256][0] / fig["none"][256][0], 2), (0.0, 1.0), False, FIG3,
              lambda r: t(r, "fixed:5", 256) / t(r, "none", 256)),
        Point("v4flash-b300", "shape: adaptive above every fixed k at C=128 (9,884 / 7,406)",
              round(fig["vllm-adaptive"][128][0] / fig["fixed:5"][128][0], 2), (1.0, 10.0),
              False, FIG3, over_fixed(128)),
        Point("v4flash-b300", "shape: adaptive above every fixed k at C=256 (11,155 / 5,295)",
              round(fig["vllm-adaptive"][256][0] / fig["fixed:5"][256][0], 2), (1.0, 10.0),
              False, FIG3, over_fixed(256)),
    ]


POINTS: list[Point] = [
    # -- v4pro-b300 (fitted: three free parameters, three points) --
    Point("v4pro-b300", "none @ C=256: output tok/s", 6267, (5640, 6890), True, VLLM,
          lambda r: r.steady("none", 256, "output_throughput")),
    Point("v4pro-b300", "fixed:7 @ C=256 vs none", 0.47, (0.40, 0.55), True, VLLM,
          _ratio("fixed:7", "none", 256)),
    Point("v4pro-b300", "fixed:7 @ C=1: output tok/s", 264, (238, 290), True, VLLM,
          lambda r: r.steady("fixed:7", 1, "output_throughput")),
    # -- v4pro-b300 held out --
    Point("v4pro-b300", "adaptive @ C=256 vs none", 1.41, (1.20, 1.65), False, VLLM,
          _ratio("vllm-adaptive", "none", 256)),
    Point("v4pro-b300", "adaptive TPOT @ C=256 vs none (26.0 / 33.8 ms)", 0.77, (0.60, 0.92),
          False, VLLM, _ratio("vllm-adaptive", "none", 256, "median_tpot_ms")),
    Point("v4pro-b300", "fixed:7 peaks at concurrency", 64, (32, 128), False, VLLM,
          _peak_load("fixed:7", V4PRO_LOADS)),
    Point("v4pro-b300", "adaptive tau @ C=256", 2.65, (2.35, 2.95), False, VLLM,
          lambda r: r.steady("vllm-adaptive", 256, "spec_decode_acceptance_length")),
    # the shape (tau falls with load) without the C = 1 level (NOT_REPRODUCED below)
    Point("v4pro-b300", "adaptive tau falls with load: C=256 / C=1", 2.65 / 3.44, (0.70, 0.92),
          False, VLLM, lambda r: r.steady("vllm-adaptive", 256, "spec_decode_acceptance_length")
          / r.steady("vllm-adaptive", 1, "spec_decode_acceptance_length")),
    # -- v4flash-h200 (fitted: MTP-1's boundary, the budget at ~200 concurrent) --
    Point("v4flash-h200", "mtp1 @ C=1: tok/s/user (its 120 tok/s/user boundary)", "~125",
          (115, 135), True, DSPARK, lambda r: r.steady("mtp1", 1, "median_interactivity")),
    Point("v4flash-h200", "DSpark-5 @ C=1: tok/s/user (Fig. 7's span; fits the trace's tau)",
          "~225", (205, 245), True, DSPARK,
          lambda r: r.steady("confidence", 1, "median_interactivity")),
    # -- v4flash-h200 held out --
    Point("v4flash-h200", "verification budget @ C=32 (Fig. 8: 4-6 below ~200)", "4-6",
          (4.0, 6.0), False, DSPARK, _budget("confidence", 32)),
    Point("v4flash-h200", "budget shrinks: @ C=256 minus @ C=8", "< 0", (-6.0, -0.5), False,
          DSPARK, lambda r: _budget("confidence", 256)(r) - _budget("confidence", 8)(r)),
    # "at matched practical throughput levels": the middle of the shared range, 25-75 % of
    # its top (below, MTP-1 serves a handful of requests and the ratio is just the
    # drafters' tau; above, MTP-1 saturates the GPU, which production avoids, §5.3)
    Point("v4flash-h200", "per-user TPS gain at matched practical throughput, min", "+60 %",
          (0.40, 0.80), False, DSPARK,
          lambda r: r.matched_gain("confidence", "mtp1", V4FLASH_LOADS)["gain_min"]),
    Point("v4flash-h200", "per-user TPS gain at matched practical throughput, max", "+85 %",
          (0.65, 1.10), False, DSPARK,
          lambda r: r.matched_gain("confidence", "mtp1", V4FLASH_LOADS)["gain_max"]),
    Point("v4flash-h200", "throughput gain at 80 tok/s/user", "+51 %", (0.25, 0.90), False,
          DSPARK, lambda r: next(t["gain"] for t in r.front_headline(
              "confidence", "mtp1", V4FLASH_LOADS)["tiers"] if t["tier"] == 80.0)),
    # -- glm47-h20 (fitted: overhead, memory efficiency, per-row sampling; three points) --
    Point("glm47-h20", "none @ C=2: output tok/s", 447, (402, 492), True, SGL,
          lambda r: r.steady("none", 2, "output_throughput")),
    Point("glm47-h20", "fixed:1 @ C=2: output tok/s", 595, (535, 655), True, SGL,
          lambda r: r.steady("fixed:1", 2, "output_throughput")),
    Point("glm47-h20", "fixed:3 @ C=2: output tok/s", 768, (691, 845), True, SGL,
          lambda r: r.steady("fixed:3", 2, "output_throughput")),
    # -- glm47-h20 held out --
    Point("glm47-h20", "fixed:7 @ C=2: output tok/s", 732, (659, 805), False, SGL,
          lambda r: r.steady("fixed:7", 2, "output_throughput")),
    Point("glm47-h20", "fixed:7 below fixed:3 @ C=2 (732 / 768)", 0.95, (0.85, 1.0), False,
          SGL, _ratio("fixed:7", "fixed:3", 2)),
    Point("glm47-h20", "fixed:3 tau @ C=2 (the trace is fitted at 1 and 7)", 3.04,
          (2.89, 3.19), False, SGL,
          lambda r: r.steady("fixed:3", 2, "spec_decode_acceptance_length")),
    Point("glm47-h20", "adaptive vs best of fixed 1/3/7 @ C=2 (791 / 768)", 1.03,
          (1.0, 1.15), False, SGL, _over_best_fixed(GLM_ADAPTIVE, 2)),
    Point("glm47-h20", "best fixed step count @ batch 64", 3, (2, 4), False, AUTOSPEC,
          _best_fixed(64)),
    Point("glm47-h20", "best fixed step count falls: @ batch 1 minus @ batch 64", "7 - 3",
          (1, 6), False, AUTOSPEC, lambda r: _best_fixed(1)(r) - _best_fixed(64)(r)),
    # -- llama31-8b-h100 (transcribed, nothing fitted) --
    Point("llama31-8b-h100", "fixed:3 speedup @ batch 1 minus @ batch 128", "> 0", (0.05, 3.0),
          False, SDB, lambda r: _speedup(3, 1)(r) - _speedup(3, 128)(r)),
    Point("llama31-8b-h100", "fixed:1 speedup @ batch 128 minus @ batch 1", "< 0", (-3.0, -0.01),
          False, SDB, lambda r: _speedup(1, 128)(r) - _speedup(1, 1)(r)),
    # -- v4flash-b300: every Figure 3 point (fitted or held out, FIG3_FITTED) and its shape --
    *_fig3_points(),
    *_fig3_shape(),
]


# Published figures the shipped profiles do NOT reproduce, with what the simulator gives
# and why; printed by benchmarks/fit_published.py and listed in docs/profiles.md. Each is
# an expected failure (tests/validation/test_published.py): one that starts to fall in its band
# fails that test, so it moves to POINTS instead of staying listed as a miss.
NOT_REPRODUCED: list[tuple[Point, str]] = [
    (Point("v4pro-b300", "fixed:5 @ C=256 vs none (k=6 the same)", 0.74, (0.55, 0.92), False,
           VLLM, _ratio("fixed:5", "none", 256)),
     "the simulator gives ~0.52, like fixed:7: both run 1,536+ verify tokens, past the "
     "1,024-token CUDA-graph limit, on the same eager rule; vLLM's k = 5 and 6 stay at -26 % "
     "while k = 7 falls to -53 %, a cliff between 1,792 and 2,048 decode tokens that the "
     "blog does not explain and the profile's one eager rule cannot place"),
    (Point("v4pro-b300", "adaptive tau @ C=1", 3.44, (3.25, 3.65), False, VLLM,
           lambda r: r.steady("vllm-adaptive", 1, "spec_decode_acceptance_length")),
     "the simulator gives ~3.25 (fixed:7 gives 3.42): at one request the one-step-old "
     "confidences often size B at 3, because the profile's touched-expert term prices an "
     "8-token step 10 % above a 4-token one (11.5 vs 10.5 ms) and the trimmed drafts carry "
     "less than that; vLLM's adaptive arm keeps tau at the full block's, so its measured "
     "cost table is flatter below 8 tokens than this roofline, which no fitted point pins"),
    (Point("glm47-h20", "best fixed step count @ batch 1", 7, (5, 7), False, AUTOSPEC,
           _best_fixed(1)),
     "the simulator gives 4, on a flat top (k = 3-7 within 5 %): at one request each draft "
     "token routes to 8 more of 160 experts, so the roofline prices the target's 8-token "
     "step 2.1x its 1-token one and k = 7 loses to k = 4. PR #23336 agrees at 2 requests (k = 3 "
     "beats k = 7), so AutoSpec's batch-1 optimum of 7 likely comes from other hardware or "
     "prompts (neither is published); the fall to ~3 by batch 64 is reproduced"),
    (Point("v4flash-h200", "verification budget @ C=192 (Fig. 8)", "~4", (3.5, 4.6), True,
           DSPARK, _budget("confidence", 192)),
     "the simulator gives 3.45 (3.41 with a prefill instance per client): the profile was "
     "fitted to ~4 when prefill was free, and with prompts queued on counted prefill "
     "instances its steady decode batch at 192 clients sizes each request's budget lower; "
     "the grid refit of its three free parameters (benchmarks/fit_published.py) reaches "
     "3.48 at best, and the paper names no prefill count to set"),
    *_fig3_misses(),
]


def points(profile: str | None = None) -> list[Point]:
    return [p for p in POINTS if profile is None or p.profile == profile]
