"""Write the example notebooks from the cell sources below, executed, outputs stored.

    python notebooks/build_notebooks.py          # rewrites notebooks/*.ipynb (~1 min)

Each notebook reads parquet only (no network) and takes its input from an
environment variable (``DSPARK_RESULTS``, ``DSPARK_TRACE``) or its first code cell;
each runs as shipped: with no ``DSPARK_RESULTS`` the frontier explorer runs a 4-point
example sweep itself. The stored outputs come from the notebooks as shipped (the
trace notebooks on 12 requests of the built-in trace, :func:`example_inputs`), so a
reader sees every table and figure without running anything and each file stays small
enough to diff. A figure is stored as Plotly JSON (``plotly_mimetype``: JupyterLab and
VS Code draw it, interactive) with a PNG of it in the same output (:func:`add_images`),
which is what GitHub shows: it runs no script, and it would pick an HTML view over the
PNG and show that blank, so none is stored (nor plotly.js, 3.5 MB).
``tests/test_notebooks.py`` re-executes them and checks the stored sources against
this file.
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
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
EXAMPLE = "example"  # how the stored outputs name the example inputs' folder
# figures as JSON only, a PNG added by the builder (add_images): nothing inlines plotly.js
RENDERERS = "plotly_mimetype"
PLOTLY_JSON = "application/vnd.plotly.v1+json"
IMAGE_WIDTH = 800  # px, each figure at its own height: ~30-90 kB a PNG

FRONTIER = [
    ("md", """# Frontier explorer

Throughput-vs-interactivity fronts of a sweep (`dspark-sim sweep` or
`dspark_sim.sim.sweep.run_sweep`): x = median interactivity (tok/s/user), y = output
throughput (tok/s/GPU), as in DSpark Fig. 7 and InferenceX. Pick the policies,
profiles and SLA tiers in the next cell. `DSPARK_RESULTS` (environment) or `RESULTS`
names the input: a `results.parquet` or a sweep folder.

With neither, the notebook runs a 4-point example sweep (the `tiny` preset, two light
loads, a few seconds), which gave the stored outputs: its engine is memory-bound,
verification is nearly free, and the gain over MTP-1 is far above a loaded production
engine's. For that world run the case study (`python benchmarks/case_study.py`,
docs/frontiers.md) and set `RESULTS = "../runs/case-study"`."""),
    ("code", """import os

import plotly.io as pio

pio.renderers.default = os.environ.get("DSPARK_PLOTLY_RENDERER", "plotly_mimetype+notebook_connected")
RESULTS = os.environ.get("DSPARK_RESULTS")  # e.g. "../runs/case-study"; None: an example sweep
POLICIES = None  # e.g. ["confidence", "mtp1"]; None: every policy in the sweep
PROFILES = None  # e.g. ["v4flash-h200"]; None: every profile
# None: as the sweep's headline picks them (the run's default policy against mtp1)
CANDIDATE, BASELINE = None, None
SLA_TIERS = [80, 120]  # tok/s/user
STABLE_ONLY = True  # leave unstable (overloaded) points out of the fronts
BASIS = "steady"  # "steady": warm-up and drain excluded (the default); "whole": whole-run"""),
    ("code", """import plotly.graph_objects as go
import polars as pl
from dspark_sim.sim import frontier as fr
from dspark_sim.sim.report import budget_figure, fronts_figure, waste_figure
from dspark_sim.sim.sweep import load_results

if RESULTS is None:  # nothing given: a small sweep, run here, so the notebook runs as shipped
    import tempfile
    from dataclasses import replace

    from dspark_sim.sim.config import preset
    from dspark_sim.sim.sweep import run_sweep

    base = preset("tiny")
    base = replace(base, workload=replace(base.workload, num_requests=200))
    with tempfile.TemporaryDirectory(prefix="dspark-example-sweep-") as tmp:
        run_sweep(base, qps=[5, 20], policies=[fr.DEFAULT_BASELINE, fr.DEFAULT_CANDIDATE], out=tmp,
                  executor="serial", progress=False)
        df = load_results(tmp)
else:
    df = load_results(RESULTS)
if PROFILES:
    df = df.filter(pl.col("profile_spec").is_in(PROFILES))
if POLICIES:
    df = df.filter(pl.col("policy").is_in([fr.canonical_policy(p) for p in POLICIES]))
print(f"{df.height} points; policies: {sorted(set(df['policy']))}; "
      f"figures: {fr.basis_used(df, BASIS)}")
# the same figures the fronts below use (metric_view puts the basis's columns under
# the plain names)
fr.metric_view(df, BASIS).select(
    "policy", "profile_spec", "load_kind", "load", fr.X, fr.Y,
    "spec_decode_acceptance_length", "mean_verify_tokens_per_request_step", "stable")"""),
    ("md", "## Fronts\nMarkers are sweep points (hover for details, x = unstable), lines the "
           "Pareto fronts; click a legend entry to toggle a policy."),
    ("code", """fig = fronts_figure(df, policies=POLICIES, tiers=SLA_TIERS, stable_only=STABLE_ONLY,
                    basis=BASIS)
fig.show()"""),
    ("md", "## Fronts by hand\nThe same fronts from `compute_fronts`, drawn with plain Plotly."),
    ("code", """fronts = fr.compute_fronts(df, policies=POLICIES, stable_only=STABLE_ONLY, basis=BASIS)
fig = go.Figure()
for label, f in fronts.items():
    fig.add_trace(go.Scatter(x=f.x, y=f.y, mode="lines+markers", name=label))
for t in SLA_TIERS:
    fig.add_vline(x=t, line_dash="dot")
fig.update_layout(xaxis_title="tok/s/user", yaxis_title="tok/s/GPU", template="plotly_white")
fig.show()
pl.DataFrame([{"front": k, "points": len(f.x), "interactivity range": f"{f.x_range[0]:.0f}-{f.x_range[1]:.0f}",
               "throughput range": f"{f.y_range[0]:.0f}-{f.y_range[1]:.0f}"} for k, f in fronts.items()])"""),
    ("md", "## Throughput at the SLA tiers"),
    ("code", """pl.DataFrame([{"front": k, "tier": t, "throughput": r.throughput, "status": r.status}
              for k, f in fronts.items() for t in SLA_TIERS
              for r in [fr.tier_throughput(f, t)]])"""),
    ("md", "## Headline: candidate vs baseline"),
    ("code", """candidate, baseline, missing = fr.headline_pair(df["policy"].to_list(), CANDIDATE, BASELINE)
if missing is None:
    h = fr.headline(df, candidate=candidate, baseline=baseline, tiers=SLA_TIERS,
                    stable_only=STABLE_ONLY, basis=BASIS)
    print(fr.format_headline(h))
else:
    print(f"no headline: {missing}")"""),
    ("md", "## Verification budget vs concurrency (Fig. 8) and waste vs load"),
    ("code", """budget_figure(df, policies=POLICIES, basis=BASIS).show()
waste_figure(df, policies=POLICIES, basis=BASIS).show()
fr.budget_table(df, BASIS)"""),
]

TRACE = [
    ("md", """# Trace explorer

A schema-v1 acceptance trace: tokens per verification step (τ) against the verify
length ℓ, per-position conditional acceptance (DSpark Fig. 2), and the drafter's
confidences against what happened. `DSPARK_TRACE` (environment) overrides the input: a
trace parquet path or the name of a trace shipped in the package."""),
    ("code", """import os

import plotly.io as pio

pio.renderers.default = os.environ.get("DSPARK_PLOTLY_RENDERER", "plotly_mimetype+notebook_connected")
TRACE = os.environ.get("DSPARK_TRACE", "dspark-synthetic")"""),
    ("code", """import numpy as np
import plotly.graph_objects as go
import polars as pl
from dspark_sim.traces.schema import load_trace

trace = load_trace(TRACE)
g = trace.gamma_max
print(f"{trace.source_path}: drafter {trace.meta.drafter}, target {trace.meta.target}, "
      f"gamma_max {g}, {trace.num_requests} requests, {trace.num_positions} positions, "
      f"domains {trace.meta.domains}, source {trace.meta.source}")
trace.to_polars().head()"""),
    ("md", "## τ by verify length ℓ\nτ(ℓ) = E[min(ℓ, m)] + 1 (bonus token included), "
           "per domain and overall."),
    ("code", """domains = list(trace.meta.domains) or ["all"]
rows = []
for d in ["all", *[d for d in domains if d != "all"]]:
    t = trace if d == "all" else trace.select_domain(d)
    rows += [{"domain": d, "ell": ell, "tau": t.tau(ell)} for ell in range(g + 1)]
tau = pl.DataFrame(rows)
fig = go.Figure()
for d in tau["domain"].unique(maintain_order=True):
    s = tau.filter(pl.col("domain") == d)
    fig.add_trace(go.Scatter(x=s["ell"], y=s["tau"], mode="lines+markers", name=d))
fig.update_layout(xaxis_title="verify length ℓ (draft tokens)", yaxis_title="τ (tokens / step)",
                  template="plotly_white")
fig.show()
tau.pivot(on="domain", index="ell", values="tau")"""),
    ("md", "## Per-position acceptance\nConditional P(k accepted | 1..k-1 accepted) "
           "(DSpark Fig. 2) and unconditional survival P(m ≥ k) (vLLM's per-position "
           "figure)."),
    ("code", """k = np.arange(1, g + 1)
fig = go.Figure()
for d in domains:
    t = trace if d == "all" else trace.select_domain(d)
    fig.add_trace(go.Scatter(x=k, y=t.conditional_acceptance(), mode="lines+markers",
                             name=f"{d} conditional"))
fig.add_trace(go.Scatter(x=k, y=trace.survival(), mode="lines+markers", name="all survival",
                         line={"dash": "dash"}))
fig.update_layout(xaxis_title="draft position k", yaxis_title="acceptance",
                  yaxis_range=[0, 1], template="plotly_white")
fig.show()
counts = np.bincount(trace.accept_len.astype(np.int64), minlength=g + 1)  # the histogram, binned here
fig = go.Figure(go.Bar(x=np.arange(g + 1), y=counts))
fig.update_layout(xaxis_title="accepted run length m", yaxis_title="positions",
                  template="plotly_white")
fig.show()"""),
    ("md", "## Confidences vs outcomes\nAt each position k, among the drafts that reached k: "
           "the raw confidence c_k when token k was accepted vs rejected (boxes: quartiles, "
           "whiskers: min and max, computed here so the figure stays small), and the mean "
           "confidence against the observed conditional acceptance."),
    ("code", """m = trace.accept_len.astype(np.int64)
c = trace.conf.astype(np.float64)
rows = []
boxes = {"accepted": ([], "seagreen"), "rejected": ([], "indianred")}
for j in range(g):
    reached = m >= j
    acc = m[reached] > j
    cj = c[reached, j]
    rows.append({"k": j + 1, "reached": int(reached.sum()), "mean_conf": float(cj.mean()),
                 "observed": float(acc.mean()),
                 "conf_if_accepted": float(cj[acc].mean()) if acc.any() else None,
                 "conf_if_rejected": float(cj[~acc].mean()) if (~acc).any() else None})
    for name, sel in (("accepted", acc), ("rejected", ~acc)):
        if sel.any():
            q = np.percentile(cj[sel], [0, 25, 50, 75, 100])
            boxes[name][0].append((f"k={j + 1}", *q))
fig = go.Figure()
for name, (stats, color) in boxes.items():
    x, lo, q1, med, q3, hi = (list(v) for v in zip(*stats, strict=True))
    fig.add_trace(go.Box(x=x, lowerfence=lo, q1=q1, median=med, q3=q3, upperfence=hi,
                         name=name, marker_color=color))
fig.update_layout(boxmode="group", yaxis_title="raw confidence c_k", template="plotly_white")
fig.show()
pl.DataFrame(rows)"""),
]

CALIBRATION = [
    ("md", """# Confidence calibration

Reliability diagram and expected calibration error (ECE, 15 equal-width bins,
count-weighted) of a trace's raw confidences, computed here in numpy. Judged as the
scheduler uses them: the prefix survival a_k = ∏_{i≤k} c_i against the event
"the first k draft tokens were accepted" (accept_len ≥ k), over all positions; and
conditionally, c_k among drafts that reached k. If `dspark_sim.calibration.fit` is
installed, the sequential temperature scaling fit (DSpark §3.2.1) is shown after it.
`DSPARK_TRACE` (environment) overrides the input."""),
    ("code", """import os

import plotly.io as pio

pio.renderers.default = os.environ.get("DSPARK_PLOTLY_RENDERER", "plotly_mimetype+notebook_connected")
TRACE = os.environ.get("DSPARK_TRACE", "dspark-synthetic")
BINS = 15
METHOD = "temperature"  # or "isotonic" (used only when calibration.fit is available)"""),
    ("code", """import numpy as np
import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots
from dspark_sim.traces.schema import load_trace

trace = load_trace(TRACE)
c = trace.conf.astype(np.float64)
m = trace.accept_len.astype(np.int64)
g = trace.gamma_max
events = m[:, None] >= np.arange(1, g + 1)[None, :]
surv = np.cumprod(c, axis=1)


def ece(p, y, bins=BINS):
    p = np.asarray(p, float)
    y = np.asarray(y, float)
    idx = np.clip((p * bins).astype(int), 0, bins - 1)
    sp = np.bincount(idx, weights=p, minlength=bins)
    sy = np.bincount(idx, weights=y, minlength=bins)
    return float(np.abs(sp - sy).sum() / max(p.size, 1))


def reliability(p, y, bins=BINS):
    idx = np.clip((np.asarray(p) * bins).astype(int), 0, bins - 1)
    n = np.bincount(idx, minlength=bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mp = np.bincount(idx, weights=p, minlength=bins) / n
        fy = np.bincount(idx, weights=y, minlength=bins) / n
    keep = n > 0
    return mp[keep], fy[keep], n[keep]


raw = []
for j in range(g):
    reached = m >= j
    raw.append({"k": j + 1, "observed": float(events[:, j].mean()),
                "predicted": float(surv[:, j].mean()), "ece_survival": ece(surv[:, j], events[:, j]),
                "ece_conditional": ece(c[reached, j], events[reached, j])})
raw = pl.DataFrame(raw)
print(f"mean ECE of raw survivals: {raw['ece_survival'].mean():.2%}")
raw"""),
    ("md", "## Reliability diagram (raw)"),
    ("code", """def diagram(prob, title):
    fig = make_subplots(rows=1, cols=2, subplot_titles=("survival a_k vs accept_len ≥ k",
                                                        "conditional c_k (reached k)"))
    for j in range(g):
        reached = m >= j
        for col, (p, y) in enumerate([(np.cumprod(prob, axis=1)[:, j], events[:, j]),
                                      (prob[reached, j], events[reached, j])], start=1):
            x, f, n = reliability(p, y)
            fig.add_trace(go.Scatter(x=x, y=f, mode="lines+markers", name=f"k={j + 1}",
                                     legendgroup=f"k{j}", showlegend=col == 1,
                                     customdata=n, hovertemplate="pred %{x:.2f} obs %{y:.2f} n %{customdata}"),
                          row=1, col=col)
    for col in (1, 2):
        fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1], mode="lines", line={"dash": "dot", "color": "grey"},
                                 showlegend=False), row=1, col=col)
    fig.update_xaxes(title_text="predicted", range=[0, 1])
    fig.update_yaxes(title_text="observed", range=[0, 1])
    fig.update_layout(title=title, template="plotly_white", height=450)
    return fig


diagram(c, "raw confidences").show()"""),
    ("md", "## After calibration (if `calibration.fit` is available)"),
    ("code", """try:
    from dspark_sim.calibration.fit import calibrate_confidence
except ImportError:
    calibrate_confidence = None
    print("dspark_sim.calibration.fit is not available: raw ECE only")
if calibrate_confidence is not None:
    cmap, rep = calibrate_confidence(trace, method=METHOD, holdout=0.3, seed=0, bins=BINS)
    print(f"{METHOD}: mean ECE {rep['ece_before_mean']:.2%} -> {rep['ece_after_mean']:.2%} "
          f"on {rep['split']['evaluated_on']}")
    diagram(np.asarray(cmap.apply(c), dtype=np.float64), f"after {METHOD} scaling (all rows)").show()
    display(pl.DataFrame(rep["positions"]).select("k", "observed", "ece_before", "ece_after",
                                                  "auc_before", "auc_after"))"""),
]


def _notebook(cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.cells = [new_markdown_cell(src) if kind == "md" else new_code_cell(src)
                for kind, src in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


NOTEBOOKS = {
    "frontier_explorer.ipynb": FRONTIER,
    "trace_explorer.ipynb": TRACE,
    "calibration.ipynb": CALIBRATION,
}


def sources(out_dir: Path) -> list[Path]:
    """The notebooks with their cells and no outputs (stable cell ids: byte-identical
    across rebuilds)."""
    paths = []
    for name, cells in NOTEBOOKS.items():
        nb = _notebook(cells)
        for i, cell in enumerate(nb.cells):
            cell["id"] = f"{Path(name).stem}-{i}"
        nbformat.validate(nb)
        path = Path(out_dir) / name
        path.write_text(nbformat.writes(nb) + "\n")
        paths.append(path)
    return paths


def example_inputs(root: Path) -> dict[str, str]:
    """Small deterministic inputs: 4 requests per domain of the built-in
    ``dspark-synthetic`` trace, so the stored trace figures stay small. No
    ``DSPARK_RESULTS``: the frontier explorer runs as shipped, on the 4-point sweep it
    runs itself (tiny preset, 200 requests per point, mtp1 and the default policy at 5 and
    20 req/s: enough for every point's steady-state figures, so the stored fronts and
    headline are not empty). Returns the notebooks' environment."""
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
