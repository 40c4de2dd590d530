"""The README's two set-up commands are exactly what CI runs; its example output is
the command's (a cog block, regenerated and compared)."""

from __future__ import annotations

import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


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


def test_the_readme_example_is_the_commands_output():
    """README.md's "Example" block is a cog block that runs the default command: cog
    --check reruns it and compares the whole output, figures included (exit 5 when
    stale)."""
    from cogapp import Cog

    readme = ROOT / "README.md"
    text = readme.read_text()
    # the generated block is the console block, and it holds the run's table
    head, block = text.split("]]] -->\n", 1)
    assert "[[[cog" in head and block.startswith(
        "```console\n$ dspark-sim run --policy confidence --qps 200\n")
    assert "│ stable " in block.split("<!-- [[[end]]] -->")[0]
    assert Cog().main(["cog", "--check", str(readme)]) == 0, "run: cog -r README.md"


def test_the_cli_doc_example_output_is_what_the_command_prints():
    """docs/cli.md's copy of the same run's output is typed out, not a cog block: only
    the lines that describe the run (policy, deployment, workload, trace, calibration)
    and the rows the table has are compared with what the command prints at that width,
    the trace line's '[synthetic, drafter ..., gamma_max 7]' included, not its figures."""
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
    assert _example((ROOT / "docs" / "cli.md").read_text()) == printed


def test_ci_runs_the_torch_free_part_on_a_light_install():
    """After the README's suite, CI runs the torch-free tests once more in a venv with
    neither torch nor the capture extra: the README promises that install, and a test
    that needs the capture stack without its marker failed only there."""

    ci = (ROOT / ".ci/run").read_text()
    light = ci.split("\npython -m pytest\n", 1)[1]
    installs = [ln for ln in light.splitlines()
                if not ln.startswith("#") and re.search(r"\bpip\"? install\b", ln)]
    assert installs and all('".[dev]"' in ln for ln in installs), installs
    assert "torch" not in " ".join(installs) and "capture" not in " ".join(installs)
    assert '-m pytest -p no:cacheprovider -m "not torch and not slow"' in light
    named = re.findall(r"tests/(?:\w+/)?test_\w+\.py", light)
    assert named and all((ROOT / f).is_file() for f in named), named
    assert "SIM_POLICY_TESTS" in light  # the sim/ and policies/ files, named once


def test_ci_installs_the_readme_way_in_a_fresh_venv():
    """The README's install runs in a virtual environment CI has just made, so packages
    the machine kept from earlier work cannot hide what a fresh install resolves."""
    ci = (ROOT / ".ci/run").read_text()
    install = _commands(ci)[0]
    before = ci.split(install, 1)[0]
    made = re.search(r'^python -m venv "(\$\w+)/venv"$', before, re.M)
    assert made, "no fresh venv before the README's install"
    assert f'source "{made.group(1)}/venv/bin/activate"' in before
    assert "-c constraints.txt" in install


def _pins() -> dict[str, str]:
    pins = {}
    for ln in (ROOT / "constraints.txt").read_text().splitlines():
        if ln.strip() and not ln.startswith("#"):
            name, version = ln.split("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def test_every_pin_satisfies_the_projects_own_bounds():
    """constraints.txt pins every dependency of the README's install (but torch and what
    its build pins, left to the torch installed first) inside pyproject.toml's bounds: a
    raised lower bound without a refresh (tools/refresh_constraints.sh) fails here."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in ("capture", "dev"):
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    pins = _pins()
    for req in reqs:
        name = canonicalize_name(req.name)
        if name in ("torch", "triton"):
            assert name not in pins  # a CUDA build of the same torch must still fit
            continue
        assert name in pins, f"{req.name} is not pinned in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (req, pins[name])
    assert not [v for v in pins.values() if "+" in v]  # no local build labels
