"""What the hostile-input suites share (test_hostile_properties, test_hostile_sweep_import,
test_hostile_synth_export, test_traces_import_shapes): the Hypothesis settings, value
strategies a user could type, a CLI runner that invokes one drawn option, and the
one-line refusal they all check."""

from __future__ import annotations

import string

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from dspark_sim.cli import app

runner = CliRunner()
# each example runs the CLI (a clean run ~0.2-1 s): fewer examples than the pure properties;
# derandomized with no example database, so every run (and CI) draws the same inputs
HOSTILE = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.function_scoped_fixture,
                                          HealthCheck.too_slow])
PRINTABLE = st.text(alphabet=string.printable.strip() + " ", max_size=24)


def draw_option(data, options: dict) -> tuple[str, str]:
    """One option of ``options`` (name -> value strategy) and a value for it."""
    option = data.draw(st.sampled_from(sorted(options)), label="option")
    return option, data.draw(options[option], label="value")


def invoke_drawn(data, options: dict, argv):
    """Run the CLI with ``argv`` (a list, or a function of the drawn option giving one) and
    one option of ``options`` set to a drawn value, last (a repeated option takes its last
    value, so ``argv`` may hold a default for it). Returns ``(option, result)``."""
    option, value = draw_option(data, options)
    args = argv(option) if callable(argv) else argv
    return option, runner.invoke(app, [*args, option, value])


def no_escape(r) -> None:
    """No exception but the CLI's own exit, and no traceback printed."""
    assert r.exception is None or isinstance(r.exception, SystemExit), \
        f"escaped: {r.exception!r}\n{r.output}"
    assert "Traceback" not in r.output


def one_line_refusal(r, where: str) -> None:
    """Exit 2 and one line, ``error: ...``, that names ``where`` (an option or a file)."""
    assert r.exit_code == 2, (r.exit_code, r.output)
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and where in lines[0], \
        (where, r.output)


def num_text(x) -> str:
    """A drawn number as a user would type it (a float by its repr: nan, inf, 1e-07)."""
    return repr(x) if isinstance(x, float) else str(x)


ANY_NUMBER = st.one_of(
    st.integers(-10**6, 10**6), st.integers(-2**80, 2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "abc", "1e9", "0x10", "1_000", "--", "5 5", "½", "NaN", "-inf"]),
).map(num_text)
POLICY = st.one_of(
    st.sampled_from(["none", "mtp1", "confidence", "confidence-sync", "confidence-async",
                     "vllm-adaptive", "bogus"]),
    st.builds(lambda name, arg: f"{name}:{arg}",
              st.sampled_from(["fixed", "threshold", "mtp1", "none", "confidence", "x"]),
              st.one_of(ANY_NUMBER, PRINTABLE)),
    PRINTABLE)
