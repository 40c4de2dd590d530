"""Keep the checkout's top-level folders from shadowing installed distributions.

The rooms live at the repository's top level (``kernels/``, ``sim/``, ...) and import as
``dspark_sim.kernels``, ``dspark_sim.sim`` ... through the build backend's package-dir
map. Python itself puts the working directory (``python -c``, ``python -m pytest``, a
notebook kernel) or a script's folder first on ``sys.path``, so from the checkout's root
``import kernels`` would find this project's folder before Hugging Face's ``kernels``
(which transformers imports), and the same holds for any installed distribution named
like another room.

Each room's ``__init__`` therefore calls :func:`defer_to_installed` when it is being
imported under its bare top-level name: the import then resolves as if the checkout's
root were not on ``sys.path``, to the installed distribution when there is one. When
there is none it gives what a folder without ``__init__`` would give, an empty namespace
package (no ``__file__``, no portions), not an error: ``importlib.util.find_spec`` has
already found the folder by then, and probes such as transformers' (find the spec, no
distribution metadata, import it, no ``__file__`` means not installed) must read it as
absent instead of failing. A room's own name (``dspark_sim.<room>``) is untouched.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path


def _resolved(entry: str) -> Path | None:
    try:
        return Path(entry or ".").resolve()
    except (OSError, RuntimeError, ValueError):
        return None


def defer_to_installed(name: str, init_file: str) -> None:
    """Replace the half-imported top-level module ``name`` (a room's folder, found
    through a ``sys.path`` entry at the checkout's root) by what the import resolves to
    without that entry, or by an empty namespace package when nothing else provides it."""
    root = Path(init_file).resolve().parent.parent
    path = [p for p in sys.path if isinstance(p, str) and _resolved(p) != root]
    spec = None
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        spec = find(name, path)
        if spec is not None:
            break
    if spec is None or spec.loader is None and not spec.submodule_search_locations:
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = []
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        return
    module = importlib.util.module_from_spec(spec)
    # the import statement returns what sys.modules holds once this body has run
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
