"""The README's two set-up commands are exactly what CI runs."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines()
            if ln.strip().startswith(("pip install", "python -m pytest"))]


def test_ci_runs_the_readme_commands():
    readme = _commands((ROOT / "README.md").read_text())
    ci = _commands((ROOT / ".ci/run").read_text())
    assert len(ci) == 2
    assert ci == readme[:2]
    assert "dspark-sim run --policy confidence --qps 200" in ci[0]
