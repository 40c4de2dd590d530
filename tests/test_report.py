"""What a reader of a run's summary and the HTML report sees: a steady-window rule that
reads as a sentence."""

from __future__ import annotations

import re

import numpy as np

from dspark_sim.sim.metrics import StepSeries, steady_window


def test_steady_window_rule_reads_as_a_sentence():
    t = np.linspace(0.01, 10.0, 400)
    batch = np.minimum(t / 2.0, 1.0) * 50.0  # fills to 50 requests over 2 s
    w = steady_window(StepSeries.of(t, 0.025, decode_batch=batch, emitted_tokens=batch),
                      np.linspace(0.0, 10.0, 200), closed=False)
    assert "reaches 90 % of its steady level of 50.0 requests, at " in w.rule, w.rule
    assert not re.search(r"steady [0-9.]+ to", w.rule)
    assert "(cut at " in w.rule
