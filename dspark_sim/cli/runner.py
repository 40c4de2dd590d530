"""What ``dspark-sim run`` does once its options are parsed, by typer (``cli/run.py``) or
without it (``cli/fast.py``): nothing here imports typer, pydantic or rich until it
prints."""

from __future__ import annotations

import time
import typing
from pathlib import Path

from dspark_sim.errors import InputError
from dspark_sim.io import check_writable
from dspark_sim.policies import compiled

# ``run``'s own options beside one per setting of the schema: flag -> (parameter, type,
# default, least value). ``cli/run.py`` declares the same to typer (tests/cli/test_fast.py
# holds the two together); ``cli/fast.py`` parses them.
OWN_OPTIONS: dict[str, tuple[str, type, object, int | None]] = {
    "--policy-profile": ("policy_profile", str, None, None),
    "--config": ("config", Path, None, None),
    "--preset": ("preset_name", str, None, None),
    "--out": ("out", Path, None, None),
    "--quiet": ("quiet", bool, False, None),
    "--executor": ("executor", str, "serial", None),
    "--workers": ("workers", int, None, 1),
}


def setting_type(settings: tuple) -> type:
    """The value type of a setting's option (``sim.config.OPTIONS``' entries): a path
    for a file it reads, text for a spec setting several, else the setting's own type
    (not None: an option not given is no setting)."""
    s = settings[0]
    if s.reads == "file":
        return Path
    hint = str if s.spec else s.type
    return next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))


def run_command(*, policy_profile: str | None, config: Path | None, preset_name: str | None,
                out: Path | None, quiet: bool, executor: str, workers: int | None,
                **settings) -> None:
    """Simulate one deployment under load and print a summary (``settings``: option name
    -> value or None, one per setting of the schema)."""
    from dspark_sim.calibration.profile import load_profile
    from dspark_sim.sim.config import files_read, requests_known, resolve_config
    from dspark_sim.sim.outputs import REQUESTS, SUMMARY

    layers: list = []
    cfg = resolve_config(preset_name=preset_name, config_path=config, options=settings,
                         layers_out=layers)
    compiled.choose_for_run(requests_known(cfg.workload))
    if out is not None:  # after the config: its files are inputs too
        check_writable(out, "--out", inside={SUMMARY: "file", REQUESTS: "file"},
                       not_over=files_read(cfg, {"--config": config,
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
    result = simulate_parsed(cfg, layers, sched_profile, executor=executor, workers=workers)
    wall = time.perf_counter() - t0
    if out is not None:
        result.write(out)
    if not quiet:
        from dspark_sim.cli.summary import print_summary
        from dspark_sim.cli.terminal import console

        print_summary(result.summary, wall)
        if out is not None:
            console.print(f"wrote {out / 'summary.json'} and {out / 'requests.parquet'}",
                          style="dim")


def simulate_parsed(cfg, layers: list, sched_profile, executor: str = "serial",
                    workers: int | None = None):
    """The run of :func:`~dspark_sim.sim.api.prepare`'s inputs (with ``executor="ray"``,
    replica groups as Ray tasks where the run allows it); a bad value the config file
    gave names the file's key (``layers``: :func:`resolve_config`'s)."""
    from dspark_sim.sim.api import prepare, simulate
    from dspark_sim.sim.config import blame_config

    with blame_config(layers):
        inputs = prepare(cfg, policy_profile=sched_profile)
        if executor == "serial":
            return simulate(inputs)
        from dspark_sim.cli.terminal import err_console
        from dspark_sim.sim.shard import simulate_replicas

        result, why = simulate_replicas(inputs, executor=executor, workers=workers)
        if why is not None:
            err_console.print(f"note: --executor {executor} ran serially: {why}",
                              highlight=False)
        return result
