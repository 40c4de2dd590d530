"""The settings schema (sim/config.py ``setting()``): every setting declared once, on its
field, and the command line, the config-file reader, the errors' blame and docs/cli.md's
tables all read it from there."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark_sim.errors import InputError
from dspark_sim.sim.config import (
    ARRIVALS,
    OPTIONS,
    SETTINGS,
    Setting,
    _coerce,
    resolve_config,
)

REPO = Path(__file__).resolve().parents[2]

# Each setting's test: a value unlike its default that a run takes (a new setting is added
# here with its field; test_every_setting_has_a_sample holds it to that), by table.
SAMPLES: dict[str, object] = {
    "policy": "fixed:3", "trace": "my-trace", "mtp_trace": "my-mtp-trace",
    "calibration": "identity", "gamma_max": 5, "conf_source": "position",
    "extrapolate_gamma": 9, "seed": 7, "slo_ttft_ms": 2000.0, "slo_tpot_ms": 20.0,
    "drain_timeout_s": 60.0, "max_engine_steps": 1000,
    **{f"workload.{k}": v for k, v in {
        "arrival": "closed", "qps": 5.0, "burstiness": 0.5, "max_concurrency": 8,
        "num_requests": 300, "duration_s": 10.0, "workload_path": "w.csv", "replay_qps": 3.0,
        "lengths": "fixed:100:10", "domain": "chat", "session_turns": 3,
        "think_time_s": "fixed:1", "system_prompt_tokens": 256}.items()},
    **{f"deployment.{k}": v for k, v in {
        "profile": "qwen3-8b-h100", "replicas": 2, "prefill_instances": 6,
        "router": "round-robin"}.items()},
    **{f"engine.{k}": v for k, v in {
        "max_num_seqs": 32, "max_num_batched_tokens": 4096, "kv_capacity_tokens": 100_000,
        "kv_mode": "reserve", "max_model_len": 4096, "prefill": "chunked",
        "prefix_cache": "off", "prefix_block_tokens": 64}.items()},
}
# the settings a sample needs beside it to be valid (a replay rate needs a replayed file)
NEEDS: dict[str, dict[str, object]] = {
    "workload.replay_qps": {"workload.workload_path": "w.csv"}}
OWN_OPTIONS = {"--policy-profile", "--config", "--preset", "--out", "--quiet", "--executor",
               "--workers"}


def _toml(values: dict[str, object]) -> str:
    tables: dict[str, list[str]] = {}
    for path, v in values.items():
        s = SETTINGS[path]
        text = f'"{v}"' if isinstance(v, str) else repr(v)
        tables.setdefault(s.table, []).append(f"{s.key} = {text}")
    return "".join(f"[{t}]\n" + "\n".join(lines) + "\n" for t, lines in tables.items())


def _option_value(s: Setting, v: object) -> object:
    """What the command line hands resolve_config for ``v``: a spec option's part as a
    spec (``--slo ttft:2000.0``), a file as a path."""
    if s.spec is not None:
        return f"{s.key.split('_')[1]}:{v}"
    return Path(v) if s.reads == "file" else v


def _options(values: dict[str, object]) -> dict[str, object]:
    return {SETTINGS[p].option[2:].replace("-", "_"): _option_value(SETTINGS[p], v)
            for p, v in values.items()}


def test_every_setting_has_a_sample():
    assert set(SAMPLES) == set(SETTINGS)


def test_every_setting_has_help_and_a_default_of_its_type():
    for s in SETTINGS.values():
        assert s.help.strip() and s.table in ("run", "workload", "deployment", "engine")
        assert _coerce(s.default, s.type, s.path) == s.default, s.path
        assert s.unit is None or s.unit.strip()


@pytest.mark.parametrize("path", sorted(SAMPLES))
def test_every_setting_is_read_from_its_config_key(tmp_path, path):
    value, extra = SAMPLES[path], NEEDS.get(path, {})
    assert value != SETTINGS[path].default
    p = tmp_path / "c.toml"
    p.write_text(_toml({**extra, path: value}))
    assert SETTINGS[path].get(resolve_config(config_path=p)) == value


@pytest.mark.parametrize("path", sorted(p for p, s in SETTINGS.items() if s.option))
def test_every_option_sets_its_setting(path):
    value, extra = SAMPLES[path], NEEDS.get(path, {})
    cfg = resolve_config(options=_options({**extra, path: value}))
    assert SETTINGS[path].get(cfg) == value


@pytest.mark.parametrize("path", sorted(SETTINGS))
def test_a_value_of_the_wrong_type_names_the_key_or_the_option(tmp_path, path):
    s = SETTINGS[path]
    p = tmp_path / "c.toml"
    p.write_text(f"[{s.table}]\n{s.key} = [1]\n")
    with pytest.raises(InputError) as err:
        resolve_config(config_path=p)
    assert str(err.value).startswith(f"{p} [{s.table}] {s.key}: must be ")
    if s.option and s.spec is None and s.reads != "file":  # a path is any string
        with pytest.raises(InputError) as err:
            resolve_config(options={s.option[2:].replace("-", "_"): [1]})
        assert str(err.value).startswith(f"{s.option}: must be ")


# (a rate given with a replayed file is its replay rate, --qps with --workload: implied)
@pytest.mark.parametrize("path,arrival", [
    (p, a) for p, s in SETTINGS.items() if s.arrivals for a in ARRIVALS
    if a not in s.arrivals and (p, a) != ("workload.qps", "replay")])
def test_a_setting_given_under_an_arrival_that_never_reads_it_is_refused(tmp_path, path,
                                                                         arrival):
    given = {"workload.arrival": arrival, path: SAMPLES[path]}
    if arrival == "replay":
        given["workload.workload_path"] = "w.csv"
    p = tmp_path / "c.toml"
    p.write_text(_toml(given))
    key = SETTINGS[path].key
    with pytest.raises(InputError, match=rf"\[workload\] {key}: does not apply to {arrival} "):
        resolve_config(config_path=p)


def test_run_takes_one_option_per_setting_with_its_help_and_panel():
    import typer.main
    from rich.markup import escape

    from dspark_sim.cli import RUN_PANELS, app

    run = typer.main.get_command(app).commands["run"]
    params = {p.opts[0]: p for p in run.params}
    assert set(params) == set(OPTIONS) | OWN_OPTIONS
    for flag, settings in OPTIONS.items():
        s = settings[0]
        assert params[flag].help == escape(s.spec.help if s.spec else s.help), flag
        assert params[flag].rich_help_panel == RUN_PANELS[s.table]
        assert params[flag].default is None  # not given: the lower layers decide
    # a spec option sets several settings, each with its own key
    assert [s.key for s in OPTIONS["--slo"]] == ["slo_ttft_ms", "slo_tpot_ms"]


def test_sweep_takes_every_setting_but_its_grid_axes_as_run_does():
    """A sweep gives each setting its grid does not sweep one value for every point, by
    run's option with run's help and panel; a grid axis (a setting's ``swept``) is the
    sweep's own option, which lists its values."""
    import typer.main
    from rich.markup import escape

    from dspark_sim.cli import RUN_PANELS, app

    sweep = typer.main.get_command(app).commands["sweep"]
    params = {p.opts[0]: p for p in sweep.params}
    swept = {s.option: s.swept for s in SETTINGS.values() if s.swept}
    assert swept == {"--policy": "--policies", "--trace": "--traces", "--seed": "--seeds",
                     "--qps": "--qps", "--max-concurrency": "--concurrency",
                     "--profile": "--profiles", "--prefix-cache": "--prefix-cache"}
    for flag, settings in OPTIONS.items():
        s = settings[0]
        if flag in swept:
            assert params[swept[flag]].rich_help_panel is None  # the sweep's own
            assert flag in swept.values() or flag not in params
            continue
        assert params[flag].help == escape(s.spec.help if s.spec else s.help), flag
        assert params[flag].rich_help_panel == RUN_PANELS[s.table]
        assert params[flag].default is None


def test_the_cli_docs_settings_tables_are_current():
    from cogapp import Cog

    doc = REPO / "docs" / "cli.md"
    text = doc.read_text()
    for s in SETTINGS.values():
        assert f"| `{s.key}` | " in text, s.path
    # cog --check: exit 5 when running the generator would change the file
    assert Cog().main(["cog", "--check", str(doc)]) == 0, "run: cog -r docs/cli.md"
