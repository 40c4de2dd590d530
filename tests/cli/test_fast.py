"""``run`` parsed without typer (``cli/fast.py``) against the typer app: the same options,
the same call of the command, and typer left to parse whatever the fast parser does not
read the way typer does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main

from dspark_sim.cli import app, fast


def _run_command():
    return typer.main.get_command(app).commands["run"]


def test_the_fast_parser_knows_every_option_of_the_typer_command():
    """Each option of the app's ``run``: the same flag, parameter, type, default and
    least value, and nothing the fast parser would skip (an environment variable, a
    callback, a repeated or multi-value option, a bound above); a path is read with the
    app's path parser, whose refusals the fast parser leaves to typer."""
    from dspark_sim.cli.common import _path_value

    table = fast.options()
    params = [p for p in _run_command().params if p.expose_value]
    assert {p.opts[0] for p in params} == set(table)
    for p in params:
        name, kind, default, least = table[p.opts[0]]
        assert (name, kind, default, least) == (p.name, p.type_descriptor.annotation,
                                                p.default, p.min), p.opts
        assert not (p.envvar or p.callback or p.multiple or p.max is not None) and p.nargs == 1
        assert p.secondary_opts == (["--no-quiet"] if p.name == "quiet" else [])
        parser = p.type_descriptor.parameter_info.parser
        assert parser is (_path_value if kind is Path else None), p.opts


def _typer_call(args: list[str], monkeypatch) -> dict:
    from typer.testing import CliRunner

    got = {}
    monkeypatch.setattr("dspark_sim.cli.run.run_command", lambda **kw: got.update(kw))
    res = CliRunner().invoke(app, ["run", *args])
    assert res.exit_code == 0, res.output
    return got


@pytest.mark.parametrize("args", [
    [],
    ["--policy", "fixed:3", "--qps", "20", "--num-requests", "10000", "--quiet"],
    ["--replicas=1", "--qps", "1e3", "--seed", "-7", "--lengths", "fixed:512:256",
     "--no-quiet", "--out", "some/dir", "--profile", "qwen3-8b-h100"],
    ["--qps", ".5", "--num-requests", "007", "--executor", "ray", "--workers", "2",
     "--config", "c.toml", "--preset", "tiny", "--policy-profile", "p.toml"],
    ["--policy", "", "--duration-s", "+60.", "--kv-capacity-tokens", "123456789012"],
])
def test_both_parsers_make_the_same_call(monkeypatch, args):
    want = _typer_call(args, monkeypatch)
    assert fast.parse_run(args) == want


@pytest.mark.parametrize("args", [
    ["--help"], ["--bogus", "1"], ["--qps"], ["--qps", "20", "--qps", "30"],
    ["--num-requests", "1e3"], ["--num-requests", "1_000"], ["--qps", "inf"],
    ["--qps", " 20"], ["--out", ""], ["--out", "x" * 5000], ["--workers", "0"],
    ["--policy", "--qps"], ["--quiet=yes"], ["--quiet", "--no-quiet"], ["positional"],
    ["--", "--qps", "20"]])
def test_what_typer_may_read_otherwise_is_left_to_typer(args):
    assert fast.parse_run(args) is None


def _cli(args: list[str], **env: str) -> subprocess.CompletedProcess:
    code = ("import sys, json\nfrom dspark_sim.cli import main\n"
            "sys.argv = ['dspark-sim', *json.loads(sys.argv[1])]\n"
            "try:\n    main()\nfinally:\n"
            "    print(json.dumps(sorted(m for m in ('typer', 'pydantic', 'rich', 'click') "
            "if m in sys.modules)))")
    return subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True,
                          text=True, env={**os.environ, **env}, cwd=os.getcwd())


def test_a_plain_run_imports_no_typer_and_fails_as_the_app_fails(tmp_path):
    """A quiet run of plain options loads neither typer, pydantic nor rich; a refused
    value is the app's one line and exit code 2; ``--help`` is the app's."""
    ok = _cli(["run", "--preset", "tiny", "--num-requests", "20", "--quiet"])
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr
    assert json.loads(ok.stdout.splitlines()[-1]) == []
    from typer.testing import CliRunner

    bad = ["run", "--preset", "tiny", "--num-requests", "-5", "--quiet"]
    typed = CliRunner().invoke(app, bad)
    got = _cli(bad)
    assert (got.returncode, got.stderr.strip()) == (typed.exit_code, typed.output.strip())
    assert got.returncode == 2 and got.stderr.startswith("error: --num-requests")
    helped = _cli(["run", "--help"], COLUMNS="100")
    assert helped.returncode == 0 and "--num-requests" in helped.stdout
    assert "typer" in json.loads(helped.stdout.splitlines()[-1])
