"""Write the example notebooks from their jupytext sources, executed, outputs stored.

    python notebooks/build_notebooks.py          # rewrites notebooks/*.ipynb (~1 min)

Each notebook's cells live in a jupytext percent script beside it
(``frontier_explorer.py`` -> ``frontier_explorer.ipynb``: ``# %%`` a code cell,
``# %% [markdown]`` a markdown one; its header holds the notebook's kernelspec), which
is what is edited, linted and reviewed; jupytext reads it into the notebook's cells and
this file runs them and stores what they show, which jupytext cannot: the example
inputs, scrubbed outputs and a PNG beside each figure.

Each notebook reads parquet only (no network) and takes its input from an
environment variable (``DSPARK_RESULTS``, ``DSPARK_TRACE``) or its first code cell;
each runs as shipped: with no ``DSPARK_RESULTS`` the frontier explorer runs a 35-point
example sweep itself. The stored outputs come from the notebooks as shipped (the
trace notebooks on 12 requests of the built-in trace, :func:`example_inputs`), so a
reader sees every table and figure without running anything and each file stays small
enough to diff. A figure is stored as Plotly JSON (``plotly_mimetype``: JupyterLab and
VS Code draw it, interactive) with a PNG of it in the same output (:func:`add_images`),
which is what GitHub shows: it runs no script, and it would pick an HTML view over the
PNG and show that blank, so none is stored (nor plotly.js, 3.5 MB).
``tests/docs/test_notebooks.py`` re-executes them and checks the stored cells against the
sources.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
EXAMPLE = "example"  # how the stored outputs name the example inputs' folder
# figures as JSON only, a PNG added by the builder (add_images): nothing inlines plotly.js
RENDERERS = "plotly_mimetype"
PLOTLY_JSON = "application/vnd.plotly.v1+json"
IMAGE_WIDTH = 800  # px, each figure at its own height: ~30-90 kB a PNG


# the notebooks, in the order they are built: notebooks/<name>.py -> notebooks/<name>.ipynb
NOTEBOOKS = ("frontier_explorer", "trace_explorer", "calibration")


def read_source(name: str) -> nbformat.NotebookNode:
    """A notebook's cells and metadata from its percent script, with no outputs and
    stable cell ids (byte-identical across rebuilds; jupytext's own are random). The
    metadata is the script header's alone: not jupytext's record of the format, which
    names its version."""
    import jupytext

    nb = jupytext.read(HERE / f"{name}.py", fmt="py:percent")
    nb.metadata.pop("jupytext", None)
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{name}-{i}"
    nbformat.validate(nb)
    return nb


def sources(out_dir: Path) -> list[Path]:
    """Write each notebook from its source, without outputs, into ``out_dir``."""
    paths = []
    for name in NOTEBOOKS:
        path = Path(out_dir) / f"{name}.ipynb"
        path.write_text(nbformat.writes(read_source(name)) + "\n")
        paths.append(path)
    return paths


def example_inputs(root: Path) -> dict[str, str]:
    """Small deterministic inputs: 4 requests per domain of the built-in
    ``dspark-synthetic`` trace, so the stored trace figures stay small. No
    ``DSPARK_RESULTS``: the frontier explorer runs as shipped, on the sweep it runs
    itself (five policies at seven closed-loop loads on one ``qwen3-8b-h100`` replica,
    300 requests a point: fronts that cross, and steady-state figures at nearly every
    point, so the stored answer, fronts and headline are not empty). Returns the
    notebooks' environment."""
    import polars as pl

    from dspark_sim.traces.schema import load_trace, trace_from_frame, write_trace

    root = Path(root)
    full = load_trace("dspark-synthetic")
    df = full.to_polars()
    keep = df.group_by("domain").agg(pl.col("request_id").unique().sort().head(4)).explode(
        "request_id")["request_id"]
    small = trace_from_frame(df.filter(pl.col("request_id").is_in(keep.to_list())), full.meta,
                             "small")
    write_trace(small, root / "small_trace.parquet")
    return {"DSPARK_TRACE": str(root / "small_trace.parquet"),
            "DSPARK_PLOTLY_RENDERER": RENDERERS}


@contextmanager
def _environment(env: dict[str, str]):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def execute(path: Path, env: dict[str, str], timeout_s: int = 300) -> nbformat.NotebookNode:
    """Run a notebook in place of its folder (kernel python3) with ``env`` set."""
    import nbclient

    nb = nbformat.read(path, as_version=4)
    with _environment(env):
        nbclient.NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                                resources={"metadata": {"path": str(HERE)}}).execute()
    return nb


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def scrub(nb: nbformat.NotebookNode, root: Path) -> None:
    """Outputs that do not depend on where or when they ran: the example folder by a fixed
    name, no execution timestamps, the HTML views' random element ids numbered."""
    ids: dict[str, str] = {}

    def clean(text: str) -> str:
        text = text.replace(str(root), EXAMPLE)
        return _UUID.sub(lambda m: ids.setdefault(m.group(0), f"plotly-figure-{len(ids)}"), text)

    for cell in nb.cells:
        cell.get("metadata", {}).pop("execution", None)
        for out in cell.get("outputs", []):
            if "text" in out:
                out["text"] = clean(out["text"])
            for mime, value in out.get("data", {}).items():
                if isinstance(value, str):
                    out["data"][mime] = clean(value)


RENDER_TIMEOUT_S = 60.0  # one figure: seconds, unless the browser hangs
START_TIMEOUT_S = 20.0  # the browser's start: ~2 s
# kaleido 0.2.1's Chromium now and then never answers its start (seen under `nice`, about
# one start in three); a fresh one does
STARTS = 5
PROBE = {"data": [{"y": [1, 2]}], "layout": {}}


def _within(timeout_s: float, fn, *args):
    """``fn(*args)``, or TimeoutError after ``timeout_s``: a browser that hangs must not
    hang the build or the tests. The thread is a daemon, so a hung call does not keep the
    process alive."""
    out: dict = {}

    def call():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # re-raised in the caller's thread
            out["error"] = exc

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"no answer in {timeout_s:g} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


def _kill_tree(pid: int) -> None:
    """End a process this builder started and every process under it (the browser's
    own children outlive their parent's kill); Linux /proc, elsewhere the process alone."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile, or not /proc
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    todo = [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def _kaleido_export(PlotlyScope):
    """kaleido 0.2.1's renderer, started (retried where its browser never answers)."""
    import plotly

    # the installed plotly's plotly.js, not the CDN's: offline, and the version that drew
    # the figure
    js = str(Path(plotly.__file__).parent / "package_data" / "plotly.min.js")
    for _ in range(STARTS):
        scope = PlotlyScope(plotlyjs=js, mathjax=False)
        try:
            _within(START_TIMEOUT_S, scope.transform, PROBE, "png")
        except TimeoutError:
            if scope._proc is not None:  # the hung start holds the scope's lock
                _kill_tree(scope._proc.pid)
                scope._proc.wait()
            continue
        return lambda fig: _within(RENDER_TIMEOUT_S, scope.transform, fig, "png", IMAGE_WIDTH)
    raise TimeoutError(f"its browser did not start in {STARTS} tries")


def png_exporter():
    """A function from a figure's JSON to PNG bytes, or None where no exporter runs here
    (the notebooks are then stored without images). kaleido 0.2.1 comes first: its wheel
    ships the Chromium it renders with, while plotly's own export (``plotly.io.to_image``)
    needs kaleido >= 1 and a Chrome that it downloads, which not every machine can."""
    try:
        try:
            from kaleido.scopes.plotly import PlotlyScope
        except ImportError:  # no kaleido, or kaleido >= 1 (no scopes): plotly's own export
            import plotly.io as pio

            def export(fig):
                return pio.to_image(fig, format="png", width=IMAGE_WIDTH)

            _within(RENDER_TIMEOUT_S, export, PROBE)
            return lambda fig: _within(RENDER_TIMEOUT_S, export, fig)
        return _kaleido_export(PlotlyScope)
    except Exception as exc:  # whatever stops the exporter (missing, no browser): no images
        print(f"no PNG exporter ({type(exc).__name__}: {exc}); pip install "
              "'dspark-sim[notebooks]' for the images GitHub shows", file=sys.stderr)
        return None


def add_images(nb: nbformat.NotebookNode, export) -> int:
    """Put a PNG of each Plotly figure into its output, beside the JSON; returns how
    many. A viewer that runs no script (GitHub) shows the PNG, JupyterLab the figure."""
    n = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if PLOTLY_JSON in data:
                data["image/png"] = base64.b64encode(export(data[PLOTLY_JSON])).decode("ascii")
                n += 1
    return n


def build(out_dir: Path = HERE, run: bool = True) -> list[Path]:
    """Write the notebooks into ``out_dir``; with ``run``, executed on the example inputs
    with their outputs stored."""
    paths = sources(out_dir)
    if not run:
        return paths
    export = png_exporter()
    with tempfile.TemporaryDirectory(prefix="dspark-nb-") as tmp:
        root = Path(tmp)
        env = example_inputs(root)
        for path in paths:
            metadata = nbformat.read(path, as_version=4).metadata
            nb = execute(path, env)
            nb.metadata = metadata  # not the kernel's version strings: nothing machine-specific
            scrub(nb, root)
            if export is not None:
                add_images(nb, export)
            nbformat.validate(nb)
            path.write_text(nbformat.writes(nb) + "\n")
    return paths


if __name__ == "__main__":
    for p in build():
        print(p, f"{p.stat().st_size / 1024:.0f} kB")
