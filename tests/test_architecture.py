"""The house's structure, read from the imports (issue #13): rooms import one way only,
sim/ and policies/ never import torch (not even inside a function), and the layout and
drawing in docs/architecture.md are what the code says."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "triton", "transformers", "safetensors", "gguf")


@pytest.fixture(scope="module")
def rooms():
    spec = importlib.util.spec_from_file_location("rooms", REPO / "docs" / "rooms.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cycle_finder_finds_a_planted_cycle(rooms):
    # the checker itself can fail: a cycle, and a DAG
    assert rooms.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert rooms.cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    g = {"a": {"b", "c"}, "b": {"c"}, "c": set()}
    assert rooms.reduced_edges(g) == [("b", "a"), ("c", "b")]
    assert rooms.layers(g) == {"a": 2, "b": 1, "c": 0}


def test_no_package_level_import_cycle(rooms):
    graph = rooms.room_graph()
    assert set(graph) >= {"sim", "policies", "traces", "calibration", "kernels", "validation",
                          "cli", "base"}
    assert rooms.cycles(graph) == []
    # the intended direction, spelled out
    assert graph["kernels"] == set() and graph["base"] == set()
    assert "validation" not in graph["sim"] | graph["policies"] | graph["traces"]
    # the brief's data flow, kernels -> traces -> calibration -> (policies, sim): nothing
    # below imports what is downstream of it
    assert graph["traces"] <= {"kernels", "base"}
    assert graph["calibration"] <= {"traces", "kernels", "base"}
    assert "sim" not in graph["policies"]
    assert "cli" not in set().union(*(v for k, v in graph.items() if k != "cli"))


@pytest.mark.parametrize("room", ["sim", "policies"])
def test_light_rooms_import_no_torch_anywhere(rooms, room):
    folder = rooms.package_dirs()[f"dspark_sim.{room}"]
    files = sorted((REPO / folder).glob("*.py"))
    assert files
    bad = [(f.name, n) for f in files for n in rooms.imported_names(f)
           if n.split(".")[0] in HEAVY]
    assert bad == []


def test_every_package_has_a_room_description(rooms):
    names = {p.split(".")[-1] for p in rooms.package_dirs() if p != "dspark_sim"}
    assert names | {"base", "cli"} == set(rooms.ROOM_TEXT)


def test_architecture_doc_opens_with_the_generated_rooms(rooms):
    text = (REPO / "docs" / "architecture.md").read_text()
    block = rooms.current_block(text)
    assert block is not None, "markers missing"
    assert block == rooms.render(), "docs/architecture.md is stale: run python docs/rooms.py"
    # it opens the document: only the title and one paragraph come before it
    assert text.index(rooms.BEGIN) < text.index("\n## ")


@pytest.mark.parametrize("policy", ["confidence", "skip:0.5"])
def test_every_summary_field_is_spelled_out_where_it_is_computed(policy):
    # issue #13: a field name greps to the line that computes it, never only to its
    # readers (no f"median_{prefix}" building); the producers: metrics, api and quality
    from dspark_sim.sim.api import simulate
    from dspark_sim.sim.config import resolve_config

    summary = simulate(resolve_config(preset_name="tiny", options={"policy": policy})).summary
    producers = "\n".join((REPO / "sim" / f).read_text() for f in ("metrics.py", "api.py",
                                                                     "quality.py"))
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
