"""Each point's steps by batch, measured from its token gaps and simulated: the gaps that
ran another request's prompt are left out on both sides, and the comparison is of
means where both sides have enough. Fast: synthetic runs (the recorded runs' tables are
checked in test_vllm_loop)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from timed_runs import timed_run

from dspark_sim.sim.metrics import StepSeries
from dspark_sim.validation.vllm_fit import decode_gaps, prompt_step_gaps, step_gaps
from dspark_sim.validation.vllm_repeats import Point
from dspark_sim.validation.vllm_steps import (
    MIN_GAPS,
    MIN_PROMPT_GAPS,
    MIN_PROMPT_STEPS,
    MIN_STEPS,
    simulated_prompt_steps,
    simulated_steps,
    step_frame,
    step_markdown,
    step_rows,
)

_run = partial(timed_run, concurrency=2)


@pytest.mark.parametrize("jitter_s", [0.004, -0.002])
def test_the_gap_in_which_another_request_got_its_first_token_is_left_out(jitter_s):
    # request 0's tokens at 1.0, 1.1, 1.4, 1.5 s: its 300 ms gap is the step that also
    # ran request 1's prompt, whose first token reaches the client a few ms off 1.4 s
    first_1 = 1.4 + jitter_s
    run = _run([0.0, 0.5], [1.0, first_1 - 0.5], [[0.1, 0.3, 0.1], [0.1, 0.1]])
    with_prompt = decode_gaps(run)
    assert sorted(with_prompt[1].tolist()) == pytest.approx([100.0, 100.0, 300.0])
    gaps = step_gaps(run)
    assert sorted(gaps) == [1, 2]
    assert gaps[1].tolist() == pytest.approx([100.0, 100.0])  # 0's first, 1's last
    assert gaps[2].tolist() == pytest.approx([100.0, 100.0])
    # a speculative run's gaps are steps too (one chunk a step, whatever it accepted)
    spec = replace(run, k=3)
    assert decode_gaps(spec) == {}
    assert {b: g.tolist() for b, g in step_gaps(spec).items()} \
        == {b: g.tolist() for b, g in gaps.items()}
    assert step_gaps(replace(run, itl_s=None)) == {}
    assert prompt_step_gaps(run).tolist() == pytest.approx([300.0])
    assert prompt_step_gaps(replace(run, itl_s=None)).size == 0


def test_a_gap_before_or_after_the_prompt_step_is_kept():
    # request 1's first token at 1.2 s ends request 0's second gap, not its first or third
    run = _run([0.0, 0.5], [1.0, 0.7], [[0.1, 0.1, 0.1], []])
    assert sorted(step_gaps(run)[1].tolist()) == pytest.approx([100.0, 100.0])


@pytest.mark.parametrize("after_s,marked", [(0.04, True), (0.06, False)])
def test_a_first_token_after_the_last_gap_marks_it_only_within_half_a_gap(after_s,
                                                                          marked):
    # request 0's tokens at 1.0, 1.1, 1.2; request 1's first token after 1.2
    run = _run([0.0, 0.5], [1.0, 0.7 + after_s], [[0.1, 0.1], []])
    assert prompt_step_gaps(run).tolist() == ([100.0] if marked else [])
    assert sorted(step_gaps(run)[1].tolist()) == [100.0] * (1 if marked else 2)


def test_a_first_token_marks_the_gap_ending_at_the_nearer_token():
    # request 0's tokens at 1.0, 1.3, 1.4: a first token at 1.33 is nearer 1.3 (the
    # 300 ms gap's end) than 1.4, one at 1.37 nearer 1.4
    for first_s, marked in ((1.33, 300.0), (1.37, 100.0)):
        run = _run([0.0, 0.5], [1.0, first_s - 0.5], [[0.3, 0.1], []])
        assert prompt_step_gaps(run).tolist() == pytest.approx([marked])


def test_a_gap_that_is_not_a_positive_time_is_no_step():
    # a 0.5 ms gap is a step (two chunks read together); nothing after a NaN has a place
    run = _run([0.0], [1.0], [[0.1, 0.0005, 0.0, float("nan"), 0.1]], concurrency=1)
    assert {b: g.tolist() for b, g in step_gaps(run).items()} \
        == {1: pytest.approx([100.0, 0.5])}
    assert {b: g.tolist() for b, g in decode_gaps(run).items()} \
        == {1: pytest.approx([100.0, 0.5])}
    assert prompt_step_gaps(run).size == 0
    # another request's first token at the end of a zero gap marks no prompt step
    run = _run([0.0, 0.5], [1.0, 0.601], [[0.1, 0.0, 0.1], []])
    assert prompt_step_gaps(run).size == 0


def test_a_request_of_one_gap_has_its_prompt_step_marked():
    run = _run([0.0, 0.5], [1.0, 0.9], [[0.4], []])
    assert prompt_step_gaps(run).tolist() == pytest.approx([400.0])
    assert step_gaps(run) == {}


def test_first_tokens_read_together_mark_no_gap():
    # both prompts ran in one step: the second first token, 2 ms after the first, is
    # nearest request 0's own first token, not the end of its first gap
    run = _run([0.0, 0.0], [1.0, 1.002], [[0.1, 0.1], [0.1]])
    assert prompt_step_gaps(run).size == 0
    gaps = step_gaps(run)
    assert (gaps[2].tolist(), gaps[1].tolist()) == (pytest.approx([100.0] * 2),
                                                    pytest.approx([100.0]))


def test_simulated_steps_leave_out_the_steps_with_a_prompt_chunk():
    # the last two steps decode nothing: a lone prompt's chunk, and an empty step
    steps = StepSeries.of(np.arange(7.0), decode_batch=np.array([1, 1, 2, 2, 1, 0, 0]),
                          prefill_tokens=np.array([0, 150, 0, 0, 1, 200, 0]),
                          dt_s=np.array([0.05, 0.4, 0.06, 0.07, 0.08, 0.3, 0.01]))
    got = simulated_steps(steps)
    assert sorted(got) == [1, 2]
    assert got[1].tolist() == pytest.approx([50.0])
    assert got[2].tolist() == pytest.approx([60.0, 70.0])
    # a prompt's last chunk of one token makes a prompt step too
    assert simulated_prompt_steps(steps).tolist() == pytest.approx([400.0, 80.0])


def test_rows_compare_means_where_both_sides_have_enough():
    # one request decoding alone for MIN_GAPS gaps of 50 ms, then with a second for fewer
    n = MIN_GAPS
    run = _run([0.0, 0.0], [0.1, 0.1 + 0.05 * n],
               [[0.05] * (n + 10), [0.05] * 5], concurrency=2)
    point = Point("none@c2", (run,))
    one = np.full(MIN_STEPS, 0.055)
    steps = StepSeries.of(np.arange(2.0 * MIN_STEPS),
                          decode_batch=np.concatenate([np.ones(MIN_STEPS), [2] * MIN_STEPS]),
                          prefill_tokens=np.zeros(2 * MIN_STEPS),
                          dt_s=np.concatenate([one, one]))
    rows = step_rows(point, "fitted", steps)
    assert [r["batch"] for r in rows] == [1]  # batch 2 has too few measured gaps
    r = rows[0]
    assert r["gaps"] >= MIN_GAPS and r["steps"] == MIN_STEPS
    assert (r["measured_ms"], r["simulated_ms"]) == pytest.approx((50.0, 55.0))
    assert r["error"] == pytest.approx(0.1)
    few = StepSeries.of(np.arange(MIN_STEPS - 1.0), decode_batch=np.ones(MIN_STEPS - 1),
                        prefill_tokens=np.zeros(MIN_STEPS - 1),
                        dt_s=np.full(MIN_STEPS - 1, 0.055))
    assert step_rows(point, "fitted", few) == []
    lines = step_markdown(step_frame(rows))
    assert lines[-1] == "| none@c2 | fitted | 1: 50 / 55 (+10%) |"
    assert step_markdown(step_frame([])) == []
    # points keep the comparison's order, each its batches in turn
    two = [{**r, "run": name} for name in ("b@c2", "a@c2") for r in rows]
    assert [line.split(" | ")[0] for line in step_markdown(step_frame(two))[-2:]] \
        == ["| b@c2", "| a@c2"]


def test_the_docs_state_the_thresholds_the_code_uses():
    text = (Path(__file__).parents[2] / "docs" / "validation.md").read_text(encoding="utf-8")
    assert (f"({MIN_GAPS} gaps, {MIN_STEPS} simulated steps; {MIN_PROMPT_GAPS} and "
            f"{MIN_PROMPT_STEPS} for the prompt steps)") in " ".join(text.split())


def test_prompt_steps_are_compared_apart_from_the_decode_steps():
    # request 0 decodes 200 gaps of 50 ms, every tenth 300 ms: the step in which one of
    # requests 1..20 (a single token each) got its first token
    gaps = np.where(np.arange(200) % 10 == 9, 0.3, 0.05)
    ends = 1.0 + np.cumsum(gaps)
    firsts = ends[gaps == 0.3] + 0.002
    n = len(firsts)
    assert n == MIN_PROMPT_GAPS
    run = _run(np.zeros(n + 1), np.concatenate([[1.0], firsts]),
               [gaps, *([[]] * n)], concurrency=2)
    assert prompt_step_gaps(run).tolist() == pytest.approx([300.0] * n)
    assert step_gaps(run)[1].tolist() == pytest.approx([50.0] * 180)
    k = MIN_PROMPT_STEPS
    steps = StepSeries.of(np.arange(MIN_STEPS + k + 1.0),
                          decode_batch=np.r_[np.ones(MIN_STEPS + k), 0],
                          prefill_tokens=np.r_[np.zeros(MIN_STEPS), np.full(k, 100), 100],
                          dt_s=np.r_[np.full(MIN_STEPS, 0.05), np.full(k, 0.33), 9.0])
    assert simulated_prompt_steps(steps).tolist() == pytest.approx([330.0] * k)
    rows = step_rows(Point("none@c2", (run,)), "held-out", steps)
    assert [(r["kind"], r["batch"]) for r in rows] == [("decode", 1), ("prompt", None)]
    assert rows[1]["gaps"] == n and rows[1]["steps"] == k
    assert rows[1]["error"] == pytest.approx(0.1) and rows[0]["error"] == pytest.approx(0.0)
    assert step_markdown(step_frame(rows))[-1] \
        == "| none@c2 | held-out | 1: 50 / 50 (+0%); prompt: 300 / 330 (+10%) |"
    fewer = StepSeries.of(np.arange(MIN_STEPS + k - 1.0),
                          decode_batch=np.ones(MIN_STEPS + k - 1),
                          prefill_tokens=np.r_[np.zeros(MIN_STEPS), np.full(k - 1, 100)],
                          dt_s=np.r_[np.full(MIN_STEPS, 0.05), np.full(k - 1, 0.33)])
    assert [r["kind"] for r in step_rows(Point("none@c2", (run,)), "x", fewer)] == ["decode"]
