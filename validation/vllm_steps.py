"""Each point's engine steps by batch, measured against simulated: where a comparison's
errors come from.

A figure such as output throughput mixes the acceptance, the step cost, the prefills and
the client's closed loop. The step cost can be held apart. vLLM streams each request one
chunk per engine step, so the gaps between a request's chunks are the steps it took part
in (:func:`dspark_sim.validation.vllm_fit.step_gaps`), grouped by how many requests were
decoding, with the steps that also ran a prompt's chunk apart
(:func:`~dspark_sim.validation.vllm_fit.prompt_step_gaps`). The simulator's steps of the
same point are grouped the same way. A held-out point whose figures miss while its steps
match misses elsewhere (its acceptance, its client loop); one whose decode steps miss at
some batches, or whose prompt steps miss, shows which.

Means, not medians: a batch's steps differ by what each verifies (an n-gram drafter
proposes at some steps only), and a run's time is their sum.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from dspark_sim.sim.metrics import StepSeries
from dspark_sim.validation.vllm_fit import by_batch, pooled_gaps, prompt_step_gaps, step_gaps
from dspark_sim.validation.vllm_repeats import Point

# a batch is compared where the point's repeats measured at least this many token gaps at
# it and the simulation ran at least this many steps at it: a mean of fewer moves with a
# few steps a host hiccup lengthened
MIN_GAPS = 100
MIN_STEPS = 20
# a point runs a prompt step per request: fewer of them, and each far longer than a
# decode step, so fewer make a mean
MIN_PROMPT_GAPS = 20
MIN_PROMPT_STEPS = 5
COLUMNS = {"run": pl.String, "split": pl.String, "kind": pl.String, "batch": pl.Int64,
           "measured_ms": pl.Float64, "gaps": pl.Int64, "simulated_ms": pl.Float64,
           "steps": pl.Int64, "error": pl.Float64}


def simulated_steps(steps: StepSeries) -> dict[int, np.ndarray]:
    """A simulation's step times (ms) by decoding batch, the steps without a prompt
    chunk."""
    batch = steps.decode_batch.astype(np.int64)
    return by_batch(steps.dt_s * 1e3, np.where(steps.prefill_tokens == 0, batch, 0))


def simulated_prompt_steps(steps: StepSeries) -> np.ndarray:
    """A simulation's step times (ms) of the steps that ran a prompt chunk beside
    requests decoding (what those requests wait through)."""
    return steps.dt_s[(steps.prefill_tokens > 0) & (steps.decode_batch > 0)] * 1e3


def step_rows(point: Point, split: str, steps: StepSeries) -> list[dict]:
    """One row per batch both sides cover, and one for the steps with a prompt chunk:
    measured and simulated mean step (ms), their counts and the relative error."""
    meas, sim = pooled_gaps(point.runs, step_gaps), simulated_steps(steps)
    pairs = [("decode", b, meas[b], sim[b], MIN_GAPS, MIN_STEPS)
             for b in sorted(set(meas) & set(sim))]
    prompt = np.concatenate([prompt_step_gaps(r) for r in point.runs])
    pairs.append(("prompt", None, prompt, simulated_prompt_steps(steps), MIN_PROMPT_GAPS,
                  MIN_PROMPT_STEPS))
    return [{"run": point.run.name, "split": split, "kind": kind, "batch": b,
             "measured_ms": float(m.mean()), "gaps": int(m.size),
             "simulated_ms": float(s.mean()), "steps": int(s.size),
             "error": float(s.mean() / m.mean() - 1.0)}
            for kind, b, m, s, fewest_gaps, fewest_steps in pairs
            if m.size >= fewest_gaps and s.size >= fewest_steps]


def step_frame(rows: list[dict]) -> pl.DataFrame:
    return pl.DataFrame(rows, schema=COLUMNS)


def step_markdown(frame: pl.DataFrame) -> list[str]:
    """The section of the comparison's Markdown: a row per point, its batches in turn,
    then its prompt steps."""
    if frame.is_empty():
        return []
    lines = ["**Steps by batch** (mean ms; measured: each request's gaps between streamed "
             "chunks, by how many requests were decoding, those in which another request's "
             "first token arrived apart as *prompt*; simulated: the engine's steps, those "
             "with a prompt chunk beside decoding requests apart):", "",
             "| run | split | batch: measured / simulated (error) |", "|---|---|---|"]
    for (run, split), g in frame.group_by(["run", "split"], maintain_order=True):
        cells = "; ".join(
            f"{r['batch'] if r['kind'] == 'decode' else 'prompt'}: {r['measured_ms']:.3g} / "
            f"{r['simulated_ms']:.3g} ({r['error']:+.0%})" for r in g.iter_rows(named=True))
        lines.append(f"| {run} | {split} | {cells} |")
    return lines
