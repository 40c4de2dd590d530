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
# # Frontier explorer
#
# Throughput-vs-interactivity fronts of a sweep (`dspark-sim sweep` or
# `dspark_sim.sim.sweep.run_sweep`): x = median interactivity (tok/s/user), y = output
# throughput (tok/s/GPU), as in DSpark Fig. 7 and InferenceX. Pick the policies,
# profiles and SLA tiers in the next cell. `DSPARK_RESULTS` (environment) or `RESULTS`
# names the input: a `results.parquet` or a sweep folder.
#
# With neither, the notebook runs a 4-point example sweep (the `tiny` preset, two light
# loads, a few seconds), which gave the stored outputs: its engine is memory-bound,
# verification is nearly free, and the gain over MTP-1 is far above a loaded production
# engine's. For that world run the case study (`python benchmarks/case_study.py`,
# docs/frontiers.md) and set `RESULTS = "../runs/case-study"`.

# %%
import os

import plotly.io as pio

pio.renderers.default = os.environ.get("DSPARK_PLOTLY_RENDERER", "plotly_mimetype+notebook_connected")
RESULTS = os.environ.get("DSPARK_RESULTS")  # e.g. "../runs/case-study"; None: an example sweep
POLICIES = None  # e.g. ["confidence", "mtp1"]; None: every policy in the sweep
PROFILES = None  # e.g. ["v4flash-h200"]; None: every profile
# None: as the sweep's headline picks them (the run's default policy against mtp1)
CANDIDATE, BASELINE = None, None
SLA_TIERS = [80, 120]  # tok/s/user
STABLE_ONLY = True  # leave unstable (overloaded) points out of the fronts
BASIS = "steady"  # "steady": warm-up and drain excluded (the default); "whole": whole-run

# %%
import plotly.graph_objects as go
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
    "spec_decode_acceptance_length", "mean_verify_tokens_per_request_step", "stable")

# %% [markdown]
# ## Fronts
# Markers are sweep points (hover for details, x = unstable), lines the Pareto fronts; click a legend entry to toggle a policy.

# %%
fig = fronts_figure(df, policies=POLICIES, tiers=SLA_TIERS, stable_only=STABLE_ONLY,
                    basis=BASIS)
fig.show()

# %% [markdown]
# ## Fronts by hand
# The same fronts from `compute_fronts`, drawn with plain Plotly.

# %%
fronts = fr.compute_fronts(df, policies=POLICIES, stable_only=STABLE_ONLY, basis=BASIS)
fig = go.Figure()
for label, f in fronts.items():
    fig.add_trace(go.Scatter(x=f.x, y=f.y, mode="lines+markers", name=label))
for t in SLA_TIERS:
    fig.add_vline(x=t, line_dash="dot")
fig.update_layout(xaxis_title="tok/s/user", yaxis_title="tok/s/GPU", template="plotly_white")
fig.show()
pl.DataFrame([{"front": k, "points": len(f.x), "interactivity range": f"{f.x_range[0]:.0f}-{f.x_range[1]:.0f}",
               "throughput range": f"{f.y_range[0]:.0f}-{f.y_range[1]:.0f}"} for k, f in fronts.items()])

# %% [markdown]
# ## Throughput at the SLA tiers

# %%
pl.DataFrame([{"front": k, "tier": t, "throughput": r.throughput, "status": r.status}
              for k, f in fronts.items() for t in SLA_TIERS
              for r in [fr.tier_throughput(f, t)]])

# %% [markdown]
# ## Headline: candidate vs baseline

# %%
candidate, baseline, missing = fr.headline_pair(df["policy"].to_list(), CANDIDATE, BASELINE)
if missing is None:
    h = fr.headline(df, candidate=candidate, baseline=baseline, tiers=SLA_TIERS,
                    stable_only=STABLE_ONLY, basis=BASIS)
    print(fr.format_headline(h))
else:
    print(f"no headline: {missing}")

# %% [markdown]
# ## Verification budget vs concurrency (Fig. 8) and waste vs load

# %%
budget_figure(df, policies=POLICIES, basis=BASIS).show()
waste_figure(df, policies=POLICIES, basis=BASIS).show()
fr.budget_table(df, BASIS)
