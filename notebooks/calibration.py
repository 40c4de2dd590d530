# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
#   language_info:
#     name: python
# ---

# %% [markdown]
# # Confidence calibration
#
# Reliability diagram and expected calibration error (ECE, 15 equal-width bins,
# count-weighted) of a trace's raw confidences, computed here in numpy. Judged as the
# scheduler uses them: the prefix survival a_k = ∏_{i≤k} c_i against the event
# "the first k draft tokens were accepted" (accept_len ≥ k), over all positions; and
# conditionally, c_k among drafts that reached k. If `dspark_sim.calibration.fit` is
# installed, the sequential temperature scaling fit (DSpark §3.2.1) is shown after it.
# `DSPARK_TRACE` (environment) overrides the input.

# %%
import os

import plotly.io as pio

pio.renderers.default = os.environ.get("DSPARK_PLOTLY_RENDERER", "plotly_mimetype+notebook_connected")
TRACE = os.environ.get("DSPARK_TRACE", "dspark-synthetic")
BINS = 15
METHOD = "temperature"  # or "isotonic" (used only when calibration.fit is available)

# %%
import numpy as np
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
raw


# %% [markdown]
# ## Reliability diagram (raw)

# %%
def diagram(prob, title):
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


diagram(c, "raw confidences").show()

# %% [markdown]
# ## After calibration (if `calibration.fit` is available)

# %%
try:
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
                                                  "auc_before", "auc_after"))
