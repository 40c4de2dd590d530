"""Execute the example notebooks on small inputs (kernel python3); check the stored files
hold their jupytext sources' cells (notebooks/<name>.py) and carry small executed outputs,
each figure with a PNG a viewer that runs no script can show."""

from __future__ import annotations

import base64
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from dspark_sim.sim.config import SimConfig

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NB_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = ("frontier_explorer.ipynb", "trace_explorer.ipynb", "calibration.ipynb")


def _load_builder():
    spec = importlib.util.spec_from_file_location("build_notebooks", NB_DIR / "build_notebooks.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["build_notebooks"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def small_inputs(tmp_path_factory):
    return _load_builder().example_inputs(tmp_path_factory.mktemp("nb"))


def _strip(nb):
    """A notebook's cells without outputs (what the generator writes before running)."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nb


def test_notebooks_match_their_sources_and_store_small_outputs(tmp_path):
    pytest.importorskip("jupytext")
    builder = _load_builder()
    built = builder.sources(tmp_path)
    assert [p.name for p in built] == list(NOTEBOOKS)
    # every percent script in the folder is a notebook's source (none is left unbuilt)
    assert {p.stem for p in NB_DIR.glob("*.py")} - {"build_notebooks"} == \
        {p.stem for p in built}
    for p in built:
        committed = NB_DIR / p.name
        stored = nbformat.read(committed, as_version=4)
        assert nbformat.writes(_strip(nbformat.read(committed, as_version=4))) == \
            nbformat.writes(nbformat.read(p, as_version=4)), \
            f"rebuild {p.name} from {p.stem}.py: python notebooks/build_notebooks.py"
        code = [c for c in stored.cells if c.cell_type == "code"]
        # every cell ran, in order, without an error: a reader sees tables and figures
        assert [c.execution_count for c in code] == list(range(1, len(code) + 1))
        outputs = [o for c in code for o in c.outputs]
        assert not any(o.get("output_type") == "error" for o in outputs)
        assert sum("application/vnd.plotly.v1+json" in o.get("data", {}) for o in outputs) >= 2
        # small enough to diff: no inlined plotly.js (3.5 MB), no machine-specific paths;
        # each figure's PNG is 30-120 kB of base64 (the frontier explorer holds four)
        text = committed.read_text()
        assert committed.stat().st_size < 600_000, committed.stat().st_size
        assert "/tmp" not in text and str(NB_DIR.parent) not in text


def _texts(nb) -> list[str]:
    """What a reader reads: printed text and plain-text results, cell by cell. A cell's
    printed text is joined first: the kernel flushes stdout in chunks whose boundaries
    depend on timing (under load one print can arrive as two stream outputs)."""
    out = []
    for c in nb.cells:
        if c.cell_type != "code":
            continue
        printed = "".join(o.get("text", "") for o in c.outputs
                          if o.get("output_type") == "stream")
        out.append(printed)
        out += [str(o.get("data", {}).get("text/plain", "")) for o in c.outputs
                if o.get("output_type") != "stream"]
    return out


PNG = b"\x89PNG\r\n\x1a\n"


def _figure_outputs(nb) -> list[dict]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "application/vnd.plotly.v1+json" in o.get("data", {})]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_stored_figure_has_a_png_beside_it(name):
    """GitHub runs no script: it shows a figure's PNG, and would prefer an HTML view (blank
    there, its script stripped) over the PNG, so a figure's output holds none."""
    figures = _figure_outputs(nbformat.read(NB_DIR / name, as_version=4))
    assert figures
    for o in figures:
        assert base64.b64decode(o["data"].get("image/png", "")).startswith(PNG), o["data"].keys()
        assert "text/html" not in o["data"]


def test_images_are_added_beside_the_json_and_a_missing_exporter_stores_none(monkeypatch):
    builder = _load_builder()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("fig.show()")])
    nb.cells[0].outputs = [nbformat.v4.new_output(
        "display_data", data={"application/vnd.plotly.v1+json": {"data": [], "layout": {}},
                              "text/plain": "Figure()"})]
    assert builder.add_images(nb, lambda fig: PNG + b"x") == 1
    assert base64.b64decode(nb.cells[0].outputs[0].data["image/png"]) == PNG + b"x"
    nbformat.validate(nb)
    # no kaleido and no plotly export: no exporter, and the build goes on without images
    monkeypatch.setitem(sys.modules, "kaleido.scopes.plotly", None)
    import plotly.io as pio

    def no_chrome(*a, **k):
        raise RuntimeError("no Chrome")

    monkeypatch.setattr(pio, "to_image", no_chrome)
    assert builder.png_exporter() is None


def test_the_png_exporter_renders_a_figure():
    pytest.importorskip("kaleido")
    export = _load_builder().png_exporter()
    if export is None:
        pytest.skip("kaleido is installed but cannot start its browser here")
    assert export({"data": [{"y": [1, 3, 2]}], "layout": {"height": 300}}).startswith(PNG)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name, small_inputs, monkeypatch):
    builder = _load_builder()
    # as shipped: the frontier explorer has no input given and computes its own
    monkeypatch.delenv("DSPARK_RESULTS", raising=False)
    env = {k: v for k, v in small_inputs.items() if k != "DSPARK_RESULTS"}
    nb = builder.execute(NB_DIR / name, env)
    assert not any(o.get("output_type") == "error" for c in nb.cells
                   if c.cell_type == "code" for o in c.outputs)
    text = "\n".join(_texts(nb))
    if name == "frontier_explorer.ipynb":
        # the headline's pair is the sweep's: the run's default policy against mtp1
        pair = f"{SimConfig.policy} vs mtp1"
        assert "35 points" in text and pair in text
        # the example sweep is long enough for steady figures: a headline, not a reason
        assert re.search(rf"matched throughput, {pair} \| [+-]\d+% to ", text)
        # the table shows the figures the fronts are drawn from (steady state)
        assert "figures: steady" in text
    elif name == "trace_explorer.ipynb":
        assert "small_trace.parquet" in text and "12 requests" in text
    else:
        assert "mean ECE of raw survivals" in text
    # plotly figures were produced
    assert any("application/vnd.plotly.v1+json" in o.get("data", {})
               for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    # the stored outputs are this run's: they cannot drift from the code
    builder.scrub(nb, Path(small_inputs["DSPARK_TRACE"]).parent)
    stored = nbformat.read(NB_DIR / name, as_version=4)
    assert _texts(nb) == _texts(stored), \
        f"stored outputs of {name} are stale: python notebooks/build_notebooks.py"


def test_the_stored_frontier_notebook_answers_per_load():
    """Its example sweep has loads enough for fronts (at least five per policy), and its
    first figure, stored with a PNG, is the per-load answer: a row per load, the policy
    to deploy changing with the load where the fronts cross, each with its verdict."""
    nb = nbformat.read(NB_DIR / "frontier_explorer.ipynb", as_version=4)
    text = "\n".join(_texts(nb))
    policies = re.search(r"(\d+) points; policies: \[([^]]*)\]", text)
    assert int(policies[1]) >= 5 * len(policies[2].split(","))
    first = _figure_outputs(nb)[0]["data"]
    fig = first["application/vnd.plotly.v1+json"]
    assert fig["layout"]["title"]["text"] == "Which policy at which load"
    assert base64.b64decode(first["image/png"]).startswith(PNG)
    table = fig["data"][0]
    columns = dict(zip(table["header"]["values"], table["cells"]["values"], strict=True))
    loads, deploy, verdict = (columns[f"<b>{c}</b>"] for c in ("load", "deploy", "verdict"))
    assert len(loads) >= 5 and len(set(deploy)) >= 2, deploy
    assert all(v.startswith(("clear: ", "tie within noise: ", "tie: ")) for v in verdict)
