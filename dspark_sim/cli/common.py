"""What every command shares: the consoles, the one-line error and warning forms and the
exit on a signal (``cli/terminal.py``'s, which a run parsed without typer uses too), the
path and name parsers, and the option types several commands take.

Bad input of any kind (an :class:`~dspark_sim.errors.InputError` from the library, or an
option typer cannot parse) is one line on stderr, ``error: <file or option>: <problem>``,
and exit code 2, never a traceback.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape as _markup_escape
from rich.table import Table
from typer.core import TyperGroup

from dspark_sim.calibration.profile import DEFAULT_LIMITS
from dspark_sim.cli.terminal import (  # noqa: F401 - the commands import these from here
    _error_line,
    _exit_cleanly_on_termination,
    _fmt,
    _shortened,
    console,
    err_console,
    raise_os_error_line,
)
from dspark_sim.errors import InputError
from dspark_sim.io import as_os_error, path_too_long

try:  # typer >= 0.22 parses with its own copy of click, older ones with click itself
    from typer._click import exceptions as _click_errors
except ImportError:  # pragma: no cover - depends on the installed typer
    from click import exceptions as _click_errors

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


# run --help groups its options by the --config table that holds the same setting
# (docs/cli.md), and sweep --help the settings it shares with run; no "[table]" in a panel
# title: rich would read it as markup.
RUN_LOAD = "Load (config table: workload)"
RUN_POLICY = "Policy and trace (config table: run)"
RUN_DEPLOY = "Deployment and engine (config tables: deployment, engine)"
RUN_PANELS = {"run": RUN_POLICY, "workload": RUN_LOAD, "deployment": RUN_DEPLOY,
              "engine": RUN_DEPLOY}


def _setting_option(flag: str, settings: tuple) -> inspect.Parameter:
    """The typer option of one setting of the schema (sim/config.py), or of a spec option
    setting several: its help, its panel (the setting's config table), its type (a path
    for a file it reads), and None for its default, so an option not given is no setting."""
    from dspark_sim.cli.runner import setting_type

    s = settings[0]
    # help is rich markup to typer: "[@BASE]" or "[word]" would vanish unescaped
    text = _markup_escape(s.spec.help if s.spec else s.help)
    kind = setting_type(settings)
    if s.reads == "file":
        info = PathOption(help=text, rich_help_panel=RUN_PANELS[s.table])
    else:
        info = typer.Option(help=text, rich_help_panel=RUN_PANELS[s.table])
    return inspect.Parameter(flag[2:].replace("-", "_"), inspect.Parameter.KEYWORD_ONLY,
                             default=None, annotation=Annotated[kind | None, info])


def with_setting_options(*, after: dict[str, str] | None = None, grid: bool = False):
    """A command taking one option per setting of the schema, in its order, then its own
    keyword parameters (``after`` places one of those right after a setting's option);
    with ``grid`` (a sweep) its own parameters first and no option for a setting its grid
    gives a value per point (``Setting.swept``: its own option lists them). The settings
    reach the command as ``**settings``, option name -> value or None."""
    from dspark_sim.sim.config import OPTIONS

    def wrap(command):
        own = dict(inspect.signature(command, eval_str=True).parameters)
        own = {k: p for k, p in own.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
        params = []
        for flag, settings in OPTIONS.items():
            if grid and any(s.swept for s in settings):
                continue
            params.append(_setting_option(flag, settings))
            if after and flag in after:
                params.append(own.pop(after[flag]))
        ordered = [*own.values(), *params] if grid else [*params, *own.values()]
        command.__signature__ = inspect.Signature(ordered)
        return command

    return wrap


# Options several commands take, declared once (the parameter's name makes the flag).
Device = Annotated[str, typer.Option(help="cpu | cuda")]
Seed = Annotated[int, typer.Option()]
PromptDir = Annotated[Path | None, PathOption(help="Folder of {turns: [...]} JSONL prompts.")]
OutParquet = Annotated[Path, PathOption(help="Output parquet path.")]
TraceArg = Annotated[str, NameArgument(help="Trace path or built-in name.")]
# the engine limits a vLLM deployment's runs were served with (calibrate vllm, vllm compare)
EngineSeqs = Annotated[int | None, typer.Option(
    help="max_num_seqs the runs were served with (default: the manifest's, else "
         f"{DEFAULT_LIMITS.max_num_seqs}).")]
EngineTokens = Annotated[int | None, typer.Option(
    help="max_num_batched_tokens the runs were served with (default: the manifest's, "
         f"else {DEFAULT_LIMITS.max_num_batched_tokens}).")]
EngineKv = Annotated[int | None, typer.Option(
    help="KV cache tokens vLLM allocated ('KV cache size: N tokens' in its log; default: "
         "the manifest's).")]
StepTable = Annotated[str, typer.Option(
    help="How the fitted step time grows with the batch: linear (fixed + per token), "
         "by-batch (its own step time at each concurrency a none run decodes), or auto: "
         "by-batch only where the linear fit misses a repeated none point's TPOT by more "
         "than its repeats' spread explains.")]


def _print_table(rows: list[dict[str, str]], title: str) -> None:
    """Rows of text (every row the same keys) as one rich table."""
    if not rows:
        return
    table = Table(title=title, show_lines=True)
    for col in rows[0]:
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(*(str(v) for v in r.values()))
    console.print(table)


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

