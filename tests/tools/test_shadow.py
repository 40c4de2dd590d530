"""The checkout's root never shadows an installed distribution: a bare top-level name
(``kernels``, ``sim``, ...) imported by a process started at the root resolves as it
resolves anywhere else, while ``dspark_sim.<room>`` stays this project's room."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("kernels", "sim", "policies", "traces", "calibration", "validation")

# prints, for each name, the file it imported or the missing name
PROBE = """
import importlib, sys
for name in sys.argv[1:]:
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__file__", None) or list(m.__path__))
    except ModuleNotFoundError as e:
        print(name, "missing", e.name)
"""


def _run(args: list[str], cwd: Path, env_extra: dict[str, str] | None = None,
         stdin: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env.update(env_extra or {})
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, input=stdin,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _fake_site(tmp_path: Path) -> Path:
    """An installed-looking folder providing every room's bare name (packages and one
    plain module), and a probe module for ``python -m``."""
    site = tmp_path / "site"
    for name in ROOMS[:-1]:
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(f"WHO = 'installed {name}'\n")
    (site / f"{ROOMS[-1]}.py").write_text("WHO = 'installed module'\n")
    (site / "probe_rooms.py").write_text(PROBE)
    return site


@pytest.mark.parametrize("how", ["-c", "stdin", "-m"])
def test_an_installed_distribution_wins_at_the_root(tmp_path, how):
    site = _fake_site(tmp_path)
    env = {"PYTHONPATH": str(site)}  # after the root entry, as site-packages is
    if how == "-c":
        out = _run(["-c", PROBE, *ROOMS], ROOT, env)
    elif how == "stdin":
        out = _run(["-", *ROOMS], ROOT, env, stdin=PROBE)
    else:
        out = _run(["-m", "probe_rooms", *ROOMS], ROOT, env)
    got = dict(line.split(" ", 1) for line in out.splitlines())
    for name in ROOMS[:-1]:
        assert got[name] == str(site / name / "__init__.py")
    assert got[ROOMS[-1]] == str(site / f"{ROOMS[-1]}.py")


def test_a_bare_name_resolves_at_the_root_as_it_does_elsewhere(tmp_path):
    """With nothing planted, a name installed elsewhere is that installation at the root
    too; a name installed nowhere is, at the root, what a folder without ``__init__``
    gives (an empty namespace package), and the rooms still import by their own names."""
    at_root = dict(ln.split(" ", 1) for ln in _run(
        ["-c", PROBE, *ROOMS, "dspark_sim.kernels"], ROOT).splitlines())
    elsewhere = dict(ln.split(" ", 1) for ln in _run(
        ["-c", PROBE, *ROOMS, "dspark_sim.kernels"], tmp_path).splitlines())
    for name in ROOMS:
        if elsewhere[name].startswith("missing"):
            assert at_root[name] == "[]", (name, at_root[name])
        else:
            assert at_root[name] == elsewhere[name]
    assert at_root["dspark_sim.kernels"] == str(ROOT / "kernels" / "__init__.py")


# transformers' availability probe: a spec, no distribution metadata, then an import
# whose module has no __file__ and no version reads as "not installed"
AVAILABLE = """
import importlib, importlib.metadata, importlib.util, sys
for name in sys.argv[1:]:
    spec = importlib.util.find_spec(name)
    found = spec is not None
    if found:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            m = importlib.import_module(name)
            found = getattr(m, "__file__", None) is not None
    print(name, found)
"""


def test_an_availability_probe_at_the_root_answers_as_elsewhere(tmp_path):
    """A probe that finds the spec, then imports the module (as transformers does for
    ``kernels``), gets the same answer at the root as elsewhere and does not fail."""
    names = [*ROOMS, "dspark_sim_absent_name"]
    assert _run(["-c", AVAILABLE, *ROOMS], ROOT) == _run(["-c", AVAILABLE, *ROOMS], tmp_path)
    assert "dspark_sim_absent_name False" in _run(["-c", AVAILABLE, *names], ROOT)


def test_transformers_loads_hugging_faces_kernels_at_the_root():
    """transformers imports Hugging Face's ``kernels`` when its activations load; a
    process started at the checkout's root with the default ``sys.path`` gets that
    package, not this project's folder."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    out = _run(["-c", "import transformers.activations, sys; m = sys.modules.get('kernels');"
                      " print(getattr(m, '__file__', None))"], ROOT)
    loaded = out.strip()
    if loaded != "None":
        assert not Path(loaded).resolve().is_relative_to(ROOT), loaded
