"""The README's two set-up commands are exactly what CI runs; its example output is
the command's."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines()
            if ln.strip().startswith(("pip install", "python -m pytest"))]


def test_ci_runs_the_readme_commands():
    readme = _commands((ROOT / "README.md").read_text())
    ci = _commands((ROOT / ".ci/run").read_text())
    assert len(ci) == 3
    assert ci[:2] == readme[:2]
    assert ci[2] == "python -m pytest -m slow"  # the set the default run leaves out
    assert "dspark-sim run --policy confidence --qps 200" in ci[0]


def _example(text: str) -> tuple[list[str], list[str]]:
    """The ``$ dspark-sim run --policy confidence --qps 200`` console block of a doc:
    its header lines (policy ... calibration, exactly) and the table's metric labels
    (first column), the parts no re-measurement changes."""
    block = text.split("$ dspark-sim run --policy confidence --qps 200\n", 1)[1]
    return _header_and_labels(block.split("```", 1)[0])


def _header_and_labels(out: str) -> tuple[list[str], list[str]]:
    lines = [ln.rstrip() for ln in out.splitlines()]
    title = next(i for i, ln in enumerate(lines) if ln.strip() == "dspark-sim run")
    labels = [ln.split("│")[1].strip() for ln in lines[title:] if ln.startswith("│")]
    return lines[:title], labels


def test_the_docs_example_output_is_what_the_command_prints():
    """README.md and docs/cli.md show the default run's output: the lines that describe
    the run (policy, deployment, workload, trace, calibration) and the rows the table
    has are what the command prints today at that width (the figures are checked, with
    their tolerance, by tests/test_case_study.py), the trace line's
    '[synthetic, drafter ..., gamma_max 7]' included."""
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", "from dspark_sim.cli import main; main()",
         "run", "--policy", "confidence", "--qps", "200"],
        capture_output=True, text=True, check=True, cwd=ROOT,
        env={**os.environ, "COLUMNS": "100"}).stdout
    printed = _header_and_labels(out)
    assert len(printed[0]) >= 5 and len(printed[1]) >= 15
    for doc in ("README.md", "docs/cli.md"):
        assert _example((ROOT / doc).read_text()) == printed, doc


def test_ci_runs_the_torch_free_part_on_a_light_install():
    """After the README's suite, CI runs the torch-free tests once more in a venv with
    neither torch nor the capture extra: the README promises that install, and a test
    that needs the capture stack without its marker failed only there."""
    import re

    ci = (ROOT / ".ci/run").read_text()
    light = ci.split("\npython -m pytest\n", 1)[1]
    installs = [ln for ln in light.splitlines()
                if not ln.startswith("#") and re.search(r"\bpip\"? install\b", ln)]
    assert installs and all('".[dev]"' in ln for ln in installs), installs
    assert "torch" not in " ".join(installs) and "capture" not in " ".join(installs)
    assert '-m pytest -p no:cacheprovider -m "not torch and not slow"' in light
    named = re.findall(r"tests/test_\w+\.py", light)
    assert named and all((ROOT / f).is_file() for f in named), named
    assert "SIM_POLICY_TESTS" in light  # the sim/ and policies/ files, named once
