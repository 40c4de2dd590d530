"""Check the import contracts of ``[tool.importlinter]`` in pyproject.toml (import-linter).

    python tools/lint_imports.py                  # exit 0 when every contract holds
    python tools/lint_imports.py --config F.toml  # the contracts of another file

import-linter's graph builder (grimp) finds a package's modules by walking its folder,
and this project's folders map into one namespace (``[tool.setuptools.package-dir]``:
``sim/`` is ``dspark_sim.sim``), so ``dspark_sim/`` on disk holds only the root modules.
This script lays the namespace out as grimp expects it, a temporary ``dspark_sim/`` of
links to the real files and folders, and runs ``lint-imports`` on it; the contracts and
the tool are import-linter's own. (The layout is kept because ``kernels`` as a top-level
package would shadow Hugging Face's package of that name.)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def namespace_tree(root: Path) -> Path:
    """``root/dspark_sim``: the import namespace as one folder of links."""
    with open(REPO / "pyproject.toml", "rb") as fh:
        dirs = tomllib.load(fh)["tool"]["setuptools"]["package-dir"]
    ns = root / "dspark_sim"
    ns.mkdir()
    for f in (REPO / dirs["dspark_sim"]).glob("*.py"):
        (ns / f.name).symlink_to(f)
    for init in (REPO / dirs["dspark_sim"]).glob("*/__init__.py"):  # the root's subpackages
        (ns / init.parent.name).symlink_to(init.parent, target_is_directory=True)
    for pkg, folder in dirs.items():
        if pkg != "dspark_sim":
            (ns / pkg.split(".", 1)[1]).symlink_to(REPO / folder, target_is_directory=True)
    return ns


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "pyproject.toml"),
                        help="file holding the contracts (default: pyproject.toml)")
    config = parser.parse_args(argv).config
    with tempfile.TemporaryDirectory(prefix="dspark-imports-") as tmp:
        namespace_tree(Path(tmp))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (tmp, os.environ.get("PYTHONPATH")) if p)}
        lint = Path(sys.executable).with_name("lint-imports")
        cmd = [str(lint) if lint.exists() else "lint-imports", "--no-cache", config]
        return subprocess.run(cmd, env=env, cwd=tmp).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
