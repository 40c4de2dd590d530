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
# # Trace explorer
#
# A schema-v1 acceptance trace: tokens per verification step (τ) against the verify
# length ℓ, per-position conditional acceptance (DSpark Fig. 2), and the drafter's
# confidences against what happened. `DSPARK_TRACE` (environment) overrides the input: a
# trace parquet path or the name of a trace shipped in the package.

# %%
import os

import plotly.io as pio

pio.renderers.default = os.environ.get("DSPARK_PLOTLY_RENDERER", "plotly_mimetype+notebook_connected")
TRACE = os.environ.get("DSPARK_TRACE", "dspark-synthetic")

# %%
import numpy as np
import plotly.graph_objects as go
import polars as pl

from dspark_sim.traces.schema import load_trace

trace = load_trace(TRACE)
g = trace.gamma_max
print(f"{trace.source_path}: drafter {trace.meta.drafter}, target {trace.meta.target}, "
      f"gamma_max {g}, {trace.num_requests} requests, {trace.num_positions} positions, "
      f"domains {trace.meta.domains}, source {trace.meta.source}")
trace.to_polars().head()

# %% [markdown]
# ## τ by verify length ℓ
# τ(ℓ) = E[min(ℓ, m)] + 1 (bonus token included), per domain and overall.

# %%
domains = list(trace.meta.domains) or ["all"]
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
tau.pivot(on="domain", index="ell", values="tau")

# %% [markdown]
# ## Per-position acceptance
# Conditional P(k accepted | 1..k-1 accepted) (DSpark Fig. 2) and unconditional survival P(m ≥ k) (vLLM's per-position figure).

# %%
k = np.arange(1, g + 1)
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
fig.show()

# %% [markdown]
# ## Confidences vs outcomes
# At each position k, among the drafts that reached k: the raw confidence c_k when token k was accepted vs rejected (boxes: quartiles, whiskers: min and max, computed here so the figure stays small), and the mean confidence against the observed conditional acceptance.

# %%
m = trace.accept_len.astype(np.int64)
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
pl.DataFrame(rows)
