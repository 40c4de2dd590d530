"""The house's structure: the rooms' import rules hold (import-linter's contracts in
pyproject.toml), no function outgrows ruff's limits, and the layout and drawing in
docs/architecture.md are what the code says."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def rooms():
    return _load("rooms")


def test_import_contracts_hold():
    r = subprocess.run([sys.executable, str(REPO / "tools" / "lint_imports.py")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "3 kept, 0 broken" in r.stdout


def test_import_linter_sees_the_mapped_rooms(tmp_path):
    # the contracts can fail: policies/ does import the base modules, so forbidding that
    # breaks (and it could not, were the namespace's mapped folders invisible to it)
    cfg = tmp_path / "planted.toml"
    cfg.write_text('[tool.importlinter]\nroot_package = "dspark_sim"\n\n'
                   '[[tool.importlinter.contracts]]\nname = "planted"\ntype = "forbidden"\n'
                   'source_modules = ["dspark_sim.policies"]\n'
                   'forbidden_modules = ["dspark_sim.errors"]\n')
    lint = _load("lint_imports")
    (tmp_path / "ns").mkdir()
    ns = lint.namespace_tree(tmp_path / "ns")
    assert (ns / "policies" / "registry.py").is_file() and (ns / "cli" / "run.py").is_file()
    r = subprocess.run([sys.executable, str(REPO / "tools" / "lint_imports.py"), "--config",
                        str(cfg)], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "planted BROKEN" in r.stdout, r.stdout[-3000:]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is in the dev extra")
def test_no_function_past_ruff_length_and_complexity_limits():
    # C901 (branches) and PLR0915 (statements), limits in pyproject.toml's ruff config
    r = subprocess.run(["ruff", "check", "--select", "C901,PLR0915", "--output-format",
                        "concise", "."], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"split these into their phases:\n{r.stdout[-3000:]}"


def test_layering_of_a_planted_graph(rooms):
    g = {"a": {"b", "c"}, "b": {"c"}, "c": set()}
    assert rooms.reduced_edges(g) == [("b", "a"), ("c", "b")]
    assert rooms.layers(g) == {"a": 2, "b": 1, "c": 0}


def test_every_package_has_a_room_description(rooms):
    names = {p.split(".")[-1] for p in rooms.package_dirs() if p != "dspark_sim"}
    assert names | {"base", "cli"} == set(rooms.ROOM_TEXT)


def test_architecture_doc_opens_with_the_generated_rooms(rooms):
    text = (REPO / "docs" / "architecture.md").read_text()
    block = rooms.current_block(text)
    assert block is not None, "markers missing"
    assert block == rooms.render(), "docs/architecture.md is stale: run python tools/rooms.py"
    # it opens the document: only the title and one paragraph come before it
    assert text.index(rooms.BEGIN) < text.index("\n## ")


@pytest.mark.parametrize("policy", ["confidence", "skip:0.5"])
def test_every_summary_field_is_spelled_out_where_it_is_computed(policy):
    # a field name greps to the line that computes it, never only to its
    # readers (no f"median_{prefix}" building); the producers: metrics, api, quality and
    # the prefill pool (its queue's own figures)
    from dspark_sim.sim.api import simulate
    from dspark_sim.sim.config import resolve_config

    summary = simulate(resolve_config(preset_name="tiny", options={"policy": policy})).summary
    producers = "\n".join((REPO / "sim" / f).read_text() for f in ("metrics.py", "api.py",
                                                                     "quality.py", "prefill.py"))
    assert len(summary) > 100
    assert [k for k in summary if f'"{k}"' not in producers] == []


REF = r":(?:func|meth|class|attr|data|mod):`~?([\w.]+)`"


def _sources_by_module(rooms) -> dict[str, str]:
    """``dspark_sim.sim.engine`` -> its source, for every shipped module."""
    out = {}
    for pkg, folder in rooms.package_dirs().items():
        for f in sorted((REPO / folder).glob("*.py")):
            name = pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"
            out[name] = f.read_text(encoding="utf-8")
    return out


def dangling_references(sources: dict[str, str]) -> list[str]:
    """Sphinx-style cross-references in the sources that point at nothing: a qualified
    ``dspark_sim.x.y.name`` whose module does not define ``name`` (or, for a method
    ``Class.name``, the class's module), or a bare name defined nowhere."""
    import re

    everything = "\n".join(sources.values())

    def defines(text: str, name: str) -> bool:
        return re.search(rf"(?:def|class)\s+{name}\b|^\s*{name}\s*[:=]", text, re.M) is not None

    bad = []
    for module, text in sources.items():
        is_package = any(m.startswith(f"{module}.") for m in sources)
        package = module if is_package else module.rsplit(".", 1)[0]
        for ref in re.findall(REF, text):
            if ref.startswith("."):  # relative to this module's package
                ref = f"{package}{ref}"
            parts = ref.split(".")
            if ref in sources or ("." in ref and parts[0] != "dspark_sim"):
                continue  # a module of ours, or another project's name (the stdlib's)
            if parts[0] == "dspark_sim":
                owner = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)
                              if ".".join(parts[:i]) in sources), None)
                ok = owner is not None and (
                    defines(sources[owner], parts[-1])
                    # a package re-exporting a name one of its modules defines
                    or (parts[-1] in sources[owner]
                        and any(defines(t, parts[-1]) for m, t in sources.items()
                                if m.startswith(f"{owner}."))))
            else:
                ok = defines(everything, parts[-1])
            if not ok:
                bad.append(f"{module}: {ref}")
    return bad


def test_reference_checker_sees_a_dangling_reference():
    sources = {"dspark_sim.a": "def f():\n    ':func:`dspark_sim.a.g` :func:`f`'\n",
               "dspark_sim.b": "class C:\n    x: int = 0\n    'see :attr:`C.x`, :meth:`gone`'\n"}
    assert dangling_references(sources) == ["dspark_sim.a: dspark_sim.a.g",
                                            "dspark_sim.b: gone"]


def test_docstring_references_point_at_what_exists(rooms):
    sources = _sources_by_module(rooms)
    assert len(sources) > 40
    assert dangling_references(sources) == []


def test_the_route_of_one_run_in_the_doc_runs():
    """docs/architecture.md's worked example (CLI -> prepare -> engine -> outputs) is
    executed as written: its asserts are the doc's claims."""
    import re

    doc = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = doc.split("## The route of one run\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the section holds one python block"
    assert all(f"# {n}." in blocks[0] for n in (1, 2, 3, 4)), "one step of the route each"
    exec(compile(blocks[0], "docs/architecture.md", "exec"), {"__name__": "route"})
