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
# With neither, the notebook runs an example sweep, which gave the stored outputs: five
# policies at seven loads each (a closed loop of 1 to 64 clients on one replica of the
# `qwen3-8b-h100` profile, 300 requests a point, about ten seconds), enough loads for the
# fronts to cross where they cross: drafting long (`fixed:7`) wins the light loads, the
# confidence scheduler the middle ones, and the gains shrink as the batch fills the GPU.
# The first table and figure answer which policy to deploy at each load. For a loaded
# production engine run the case study (`python benchmarks/case_study.py`,
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
SLA_TIERS = None  # tok/s/user, e.g. [80, 120]; None: two inside the data's range
STABLE_ONLY = True  # leave unstable (overloaded) points out of the fronts
BASIS = "steady"  # "steady": warm-up and drain excluded (the default); "whole": whole-run

# %%
import re

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

    base = preset("tiny")  # one replica
    base = replace(base, deployment=replace(base.deployment, profile="qwen3-8b-h100"),
                   workload=replace(base.workload, num_requests=300))
    with tempfile.TemporaryDirectory(prefix="dspark-example-sweep-") as tmp:
        run_sweep(base, concurrency=[1, 2, 4, 8, 16, 32, 64],
                  policies=[fr.DEFAULT_BASELINE, "none", "fixed:3", "fixed:7", fr.DEFAULT_CANDIDATE],
                  out=tmp, executor="serial", progress=False)
        df = load_results(tmp)
else:
    df = load_results(RESULTS)
if PROFILES:
    df = df.filter(pl.col("profile_spec").is_in(PROFILES))
if POLICIES:
    df = df.filter(pl.col("policy").is_in([fr.canonical_policy(p) for p in POLICIES]))
SLA_TIERS = SLA_TIERS or fr.default_tiers(df, BASIS)
print(f"{df.height} points; policies: {sorted(set(df['policy']))}; "
      f"figures: {fr.basis_used(df, BASIS)}; SLA tiers {SLA_TIERS} tok/s/user")
# the same figures the fronts below use (metric_view puts the basis's columns under
# the plain names)
fr.metric_view(df, BASIS).select(
    "policy", "profile_spec", "load_kind", "load", fr.X, fr.Y,
    "spec_decode_acceptance_length", "mean_verify_tokens_per_request_step", "stable")

# %% [markdown]
# ## Which policy at which load
# One row per load: the policy to deploy, its gains over `none` and over the runner-up, and
# whether the runner-up is within noise (a tie is called a tie, with what would settle it).
# The same table opens the sweep's report.

# %%
answer = fr.answer_rows(fr.answer(df, basis=BASIS))
# the verdict up to its confidence interval; the full text is in `answer` (and the report)
cells = {"load": [r["load"] for r in answer], "deploy": [r["deploy"] for r in answer],
         "tok/s/GPU": [r["tok/s/GPU"] for r in answer],
         "vs none (tok/s/GPU)": [r["vs none"].removesuffix(" tok/s/GPU") for r in answer],
         "verdict": [re.sub(r" \(95 % CI.*", "", r["verdict"]) for r in answer]}
go.Figure(go.Table(
    columnwidth=[45, 70, 60, 80, 300],
    header={"values": [f"<b>{c}</b>" for c in cells], "align": "left"},
    cells={"values": list(cells.values()), "align": "left"}),
    layout={"title": "Which policy at which load", "height": 100 + 20 * len(answer),
            "margin": {"l": 10, "r": 10, "t": 40, "b": 10}}).show()

# %% [markdown]
# ## Fronts
# Markers are sweep points (hover for details, x = unstable), lines the Pareto fronts; click a legend entry to toggle a policy.

# %%
fig = fronts_figure(df, policies=POLICIES, tiers=SLA_TIERS, stable_only=STABLE_ONLY,
                    basis=BASIS)
fig.show()

# %% [markdown]
# ## Fronts by hand
# The same fronts from `compute_fronts`, as numbers (each `f.x`, `f.y` draws with plain
# Plotly: `go.Scatter(x=f.x, y=f.y, mode="lines+markers")`).

# %%
fronts = fr.compute_fronts(df, policies=POLICIES, stable_only=STABLE_ONLY, basis=BASIS)
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
