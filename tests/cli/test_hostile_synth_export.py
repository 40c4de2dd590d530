"""Hostile options for ``traces synth``, ``traces export``, ``traces import --format
vllm-counters`` and ``calibrate confidence``,
drawn by Hypothesis (the run-side suite is tests/cli/test_hostile_properties.py; the
settings and value strategies they share are tests/hostile_inputs.py).

The property, for each command: any value of any one option is either refused with exit
2 and one line that names the option, with nothing written, or the command writes a
whole, valid file:

* ``synth``: a trace that loads, with ``accept_len`` in ``[0, gamma_max]`` and, where it
  has them, confidences in ``[0, 1]`` (a NaN spread must not write NaN confidences);
* ``export``: JSON whose rates are ``num_speculative_tokens`` numbers in ``[0, 1]``;
* ``calibrate confidence``: a map that loads and applies to finite values in ``[0, 1]``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hostile_inputs import (
    ANY_NUMBER,
    HOSTILE,
    PRINTABLE,
    invoke_drawn,
    no_escape,
    one_line_refusal,
)
from hypothesis import given
from hypothesis import strategies as st

from dspark_sim.calibration.confmap import load_calibration
from dspark_sim.traces.schema import load_trace
from dspark_sim.traces.synth import synth_drafter


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    from dspark_sim.traces.schema import write_trace

    path = tmp_path_factory.mktemp("tr") / "dspark.parquet"
    write_trace(synth_drafter(gamma=4, requests_per_domain=4, positions=32, seed=3), path)
    return path


# Counts: small valid ones (a run stays fast), edges, and the hostile numbers; huge valid
# counts are refused by synth's size cap before anything is generated.
COUNT = st.one_of(st.integers(-2, 6).map(str), ANY_NUMBER)
SEED = st.one_of(st.integers(-3, 2**70).map(str), ANY_NUMBER)


def _synth_argv(data, out, _trace) -> list[str]:
    kind = data.draw(st.sampled_from(["iid", "dspark", "mtp1"]), label="kind")
    # --gamma only where the kind reads it (mtp1 drafts 1: the option is refused there)
    return ["traces", "synth", "--out", str(out), "--kind", kind, "--requests", "2",
            "--positions", "16", *(["--gamma", "3"] if kind != "mtp1" else [])]


def _valid_trace(out) -> None:
    t = load_trace(out)
    assert t.num_requests >= 1 and t.num_positions >= 1
    assert 0 <= int(t.accept_len.min()) and int(t.accept_len.max()) <= t.gamma_max
    if t.conf is not None:
        assert np.isfinite(t.conf).all() and (t.conf >= 0).all() and (t.conf <= 1).all()


def _valid_rates(out) -> None:
    cfg = json.loads(out.read_text())
    k = cfg["num_speculative_tokens"]
    rates = cfg["synthetic_acceptance_rates"]
    assert 1 <= k <= 4 and len(rates) == k  # the small trace drafts 4
    assert all(0.0 <= x <= 1.0 for x in rates)


def _valid_map(out) -> None:
    cmap = load_calibration(out)
    grid = np.linspace(0.0, 1.0, 11, dtype=np.float32)
    got = cmap.apply(np.tile(grid[:, None], (1, 4)))
    assert np.isfinite(got).all() and (got >= 0).all() and (got <= 1).all()


COUNTERS = ('vllm:spec_decode_num_drafts_total{engine="0"} 100.0\n'
            + "".join(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",'
                      f'position="{k}"}} {n}.0\n' for k, n in enumerate((80, 50, 20))))


def _import_counters_argv(_data, out, trace) -> list[str]:
    src = trace.parent / "metrics.txt"  # vLLM /metrics text, beside the module's trace
    if not src.exists():
        src.write_text(COUNTERS)
    return ["traces", "import", str(src), "--format", "vllm-counters", "--out", str(out),
            "--requests", "2", "--positions", "8"]


# command -> (its options and their value strategies, its other arguments given the output
# path and the small trace, the file it writes, what makes that file valid)
COMMANDS = {
    "synth": ({
        "--kind": st.one_of(st.sampled_from(["iid", "dspark", "mtp1"]), PRINTABLE),
        "--alpha": st.one_of(st.floats(0, 1).map(repr), ANY_NUMBER),
        "--gamma": COUNT,
        "--requests": COUNT,
        "--positions": COUNT,
        "--overconfidence": ANY_NUMBER,
        "--noise": ANY_NUMBER,
        "--seed": SEED,
    }, _synth_argv, "t.parquet", _valid_trace),
    "export": ({
        "--num-speculative-tokens": COUNT,
        "--weighting": st.one_of(st.sampled_from(["served", "positions"]), PRINTABLE),
        "--format": st.one_of(st.just("vllm-synthetic"), PRINTABLE),
        "--method": PRINTABLE,
        "--model": PRINTABLE,
    }, lambda _data, out, trace: ["traces", "export", str(trace), "--out", str(out)],
        "spec.json", _valid_rates),
    # a negative --seed reached numpy's default_rng: a ValueError traceback
    "import-counters": ({
        "--requests": COUNT,
        "--positions": COUNT,
        "--seed": SEED,
        "--domain": PRINTABLE,
    }, _import_counters_argv, "t.parquet", _valid_trace),
    "calibrate": ({
        "--method": st.one_of(st.sampled_from(["temperature", "isotonic"]), PRINTABLE),
        "--holdout": st.one_of(st.floats(0, 1).map(repr), ANY_NUMBER),
        "--seed": SEED,
    }, lambda _data, out, trace: ["calibrate", "confidence", "--trace", str(trace),
                                  "--out", str(out)], "map.toml", _valid_map),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@HOSTILE
@given(data=st.data())
def test_any_option_is_refused_in_one_line_or_the_command_writes_a_valid_file(
        tmp_path_factory, small_trace, command, data):
    options, argv, name, valid = COMMANDS[command]
    out = tmp_path_factory.mktemp(command) / name
    option, r = invoke_drawn(data, options, argv(data, out, small_trace))
    no_escape(r)
    if r.exit_code == 0:
        valid(out)
    else:
        one_line_refusal(r, option)
        assert not out.exists()


@pytest.mark.parametrize("command", sorted(c for c in COMMANDS if "--seed" in COMMANDS[c][0]))
def test_a_negative_seed_is_refused_by_every_command_that_takes_one(tmp_path, small_trace,
                                                                    command):
    """The one value every seed refuses (numpy's default_rng raises on it), given to each
    command of the table, so no draw has to find it."""
    from types import SimpleNamespace

    from hostile_inputs import runner

    from dspark_sim.cli import app

    _options, argv, name, _valid = COMMANDS[command]
    out = tmp_path / name
    iid = SimpleNamespace(draw=lambda _strategy, label=None: "iid")  # synth draws its --kind
    r = runner.invoke(app, [*argv(iid, out, small_trace), "--seed", "-1"])
    no_escape(r)
    one_line_refusal(r, "--seed")
    assert not out.exists()
