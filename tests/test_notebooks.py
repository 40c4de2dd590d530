"""Execute the example notebooks on small inputs (kernel python3) and check they are
stored without outputs and match their generator."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import polars as pl
import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

from dspark_sim.sim.config import preset  # noqa: E402
from dspark_sim.sim.sweep import run_sweep  # noqa: E402
from dspark_sim.traces.schema import load_trace, trace_from_frame, write_trace  # noqa: E402

NB_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = ("frontier_explorer.ipynb", "trace_explorer.ipynb", "calibration.ipynb")


@pytest.fixture(scope="module")
def small_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("nb")
    cfg = preset("tiny")
    cfg = replace(cfg, workload=replace(cfg.workload, num_requests=40))
    run_sweep(cfg, qps=[5, 20], policies=["mtp1", "confidence-async"], out=root / "sweep",
              executor="serial", progress=False)
    full = load_trace("dspark-synthetic")
    df = full.to_polars()
    keep = df.group_by("domain").agg(pl.col("request_id").unique().sort().head(4)).explode(
        "request_id")["request_id"]
    small = trace_from_frame(df.filter(pl.col("request_id").is_in(keep.to_list())), full.meta, "small")
    write_trace(small, root / "small_trace.parquet")
    return {"DSPARK_RESULTS": str(root / "sweep" / "results.parquet"),
            "DSPARK_TRACE": str(root / "small_trace.parquet")}


def _load_builder():
    spec = importlib.util.spec_from_file_location("build_notebooks", NB_DIR / "build_notebooks.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["build_notebooks"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_notebooks_match_generator_and_have_no_outputs(tmp_path):
    builder = _load_builder()
    built = builder.build(tmp_path)
    assert [p.name for p in built] == list(NOTEBOOKS)
    for p in built:
        committed = NB_DIR / p.name
        assert committed.read_text() == p.read_text(), f"rebuild {p.name}: " \
            "python notebooks/build_notebooks.py"
        nb = nbformat.read(committed, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name, small_inputs, monkeypatch):
    for k, v in small_inputs.items():
        monkeypatch.setenv(k, v)
    nb = nbformat.read(NB_DIR / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(NB_DIR)}})
    client.execute()
    text = "\n".join(
        o.get("text", "") if o.get("output_type") == "stream"
        else str(o.get("data", {}).get("text/plain", ""))
        for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert not any(o.get("output_type") == "error" for c in nb.cells
                   if c.cell_type == "code" for o in c.outputs)
    if name == "frontier_explorer.ipynb":
        assert "4 points" in text and "confidence-async vs mtp1" in text
    elif name == "trace_explorer.ipynb":
        assert "small_trace.parquet" in text and "12 requests" in text
    else:
        assert "mean ECE of raw survivals" in text
    # plotly figures were produced
    assert any("application/vnd.plotly.v1+json" in o.get("data", {})
               for c in nb.cells if c.cell_type == "code" for o in c.outputs)
