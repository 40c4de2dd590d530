"""``dspark-sim profiles``: the built-in engine profiles and what one holds."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from dspark_sim.cli.common import NameArgument, _as_argument, console

profiles_app = typer.Typer(help="List and show engine profiles.", no_args_is_help=True)


@profiles_app.command("list")
def profiles_list() -> None:
    """Built-in engine profiles."""
    from dspark_sim.calibration.profile import builtin_profiles, load_profile

    tab = Table(title="built-in engine profiles")
    for col in ("name", "kind", "GPU/replica", "description"):
        tab.add_column(col)
    for name in builtin_profiles():
        prof = load_profile(name)
        tab.add_row(name, prof.kind, str(prof.gpus_per_replica), prof.description)
    console.print(tab)


@profiles_app.command("show")
def profiles_show(name: Annotated[str, NameArgument(help="Built-in name or TOML path.")]) -> None:
    """SPS(B) table and draft costs of a profile."""
    from dspark_sim.calibration.profile import load_profile

    with _as_argument("--profile", "name"):
        prof = load_profile(name)
    console.print(Text(prof.summary(), style="bold"))
    console.print(prof.description)
    tab = Table(title="target step time and steps/s")
    for col in ("tokens B", "step (ms)", "SPS (1/s)", "B x SPS (tok/s)"):
        tab.add_column(col, justify="right")
    for b, s in zip(prof.tokens, prof.step_s, strict=True):
        tab.add_row(str(b), f"{s * 1e3:.2f}", f"{1 / s:.1f}", f"{b / s:,.0f}")
    console.print(tab)
    console.print(profile_terms_text(prof), highlight=False, soft_wrap=True)


def profile_terms_text(p) -> str:
    """Every term of a profile, one line each (0 and unset ones included, so nothing is
    hidden): the per-step terms, the eager rule, the engine limits and each draft table."""
    lim = p.limits
    window = "unbounded" if p.attn_window_tokens is None else f"{p.attn_window_tokens:,} tokens"
    lines = [
        "per-step terms:",
        f"  kv_us_per_token        {p.kv_s_per_token * 1e6:.6g}  (per context token in the batch)",
        f"  multi_kv_us_per_token  {p.multi_kv_s_per_token * 1e6:.6g}  (extra, per context token "
        "of multi-token blocks)",
        f"  attn_ns_per_query_ctx  {p.attn_s_per_query_ctx * 1e9:.6g}  (per query token x "
        f"attended context; window {window})",
        f"  logits_us_per_row      {p.logits_s_per_row * 1e6:.6g}  (LM head + sampling per "
        "logit row)",
        f"  request_us             {p.request_s * 1e6:.6g}  (per request with a context)",
        f"  eager_penalty_ms       {p.eager_penalty_s * 1e3:.6g}  (past the last table row, "
        f"interpolation {p.interpolation})",
        "engine limits (per replica; unset: the simulator's default):",
        *(f"  {k:22s} {getattr(lim, k) if getattr(lim, k) is not None else 'unset'}"
          for k in ("max_num_seqs", "max_num_batched_tokens", "kv_capacity_tokens",
                    "max_model_len", "prefill")),
        "default trace (what run replays without --trace): "
        + (p.default_trace or "unset (the simulator's default)"),
    ]
    for dname, d in p.drafts.items():
        costs = ", ".join(f"n={int(n)}: {t * 1e3:.3g} ms"
                          for n, t in zip(d.batch, d.time_s, strict=True))
        lines.append(f"draft [{dname}] {'block' if d.block else 'autoregressive'}, gamma_ref "
                     f"{d.gamma_ref}, gamma_slope {d.gamma_slope:.4g}, kv_us_per_token "
                     f"{d.kv_s_per_token * 1e6:.4g}: {costs}")
        if d.has_context_terms or d.kv_budget_tokens is not None:
            lines.append(f"  sparse KV: kv_budget_tokens {d.kv_budget_tokens}, "
                         f"sparse_kv_us_per_token {d.sparse_kv_s_per_token * 1e6:.4g} (per "
                         "attended token per drafted token), select_us_per_context_token "
                         f"{d.select_s_per_context_token * 1e6:.4g} (per context token per step)")
    return "\n".join(lines)
