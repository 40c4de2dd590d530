"""`sim/` and `policies/` import and run without torch (the light install)."""

from __future__ import annotations

import subprocess
import sys

CODE = r"""
import sys
for name in ("torch", "triton", "transformers", "safetensors", "gguf"):
    sys.modules[name] = None  # any import of these now raises ImportError
import importlib, pkgutil
import dspark_sim.sim as sim_pkg, dspark_sim.policies as pol_pkg
for pkg in (sim_pkg, pol_pkg):
    for m in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{pkg.__name__}.{m.name}")
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import preset
s = simulate(preset("tiny")).summary
assert s["completed"] == 200, s["completed"]
from typer.testing import CliRunner
from dspark_sim.cli import app
r = CliRunner().invoke(app, ["run", "--preset", "tiny", "--quiet"])
assert r.exit_code == 0, r.output
print("ok")
"""


def test_sim_and_policies_run_without_torch():
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith("ok")
