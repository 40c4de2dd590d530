"""One value, one rule wherever it is given: a profile's ``[engine]`` KV capacity obeys the
cap the option obeys, and a sweep's ``--out`` is checked against its ``--vllm-results``
input as against every other input, before any point runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dspark_sim.calibration.profile import profile_from_dict
from dspark_sim.cli import app
from dspark_sim.errors import MAX_KV_CAPACITY_TOKENS, InputError
from dspark_sim.io import loads_toml
from dspark_sim.sim.config import resolve_config

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "calibration" / "data" / "v4flash-h200.toml"


@pytest.mark.parametrize("key", ["kv_capacity_tokens", "max_model_len"])
def test_a_profiles_kv_limits_and_the_options_share_one_cap(key):
    data = loads_toml(PROFILE.read_text())
    data.setdefault("engine", {})[key] = MAX_KV_CAPACITY_TOKENS  # was refused above 2^30
    assert getattr(profile_from_dict(data, "p.toml").limits, key) == MAX_KV_CAPACITY_TOKENS
    assert getattr(resolve_config(options={key: MAX_KV_CAPACITY_TOKENS}).engine, key) \
        == MAX_KV_CAPACITY_TOKENS
    data["engine"][key] = MAX_KV_CAPACITY_TOKENS + 1
    with pytest.raises(InputError, match=rf"'{key}' must be an integer in "
                                         rf"\[1, {MAX_KV_CAPACITY_TOKENS:,}\]"):
        profile_from_dict(data, "p.toml")
    with pytest.raises(InputError, match=f"--{key.replace('_', '-')}"):
        resolve_config(options={key: MAX_KV_CAPACITY_TOKENS + 1})


def _bench_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"label": "vllm", "median_tpot_ms": 10.0,
                                "output_throughput": 1000.0, "num_gpus": 1}))
    return path


@pytest.mark.parametrize("where", ["points", "points/sub", "report.html"])
def test_sweep_refuses_an_out_that_overwrites_or_owns_its_vllm_results(tmp_path, where):
    out = tmp_path / "sweep"
    if where == "report.html":
        given = _bench_file(out / "report.html")
    else:
        given = out / where
        _bench_file(given / "r.json")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    res = CliRunner().invoke(app, ["sweep", "--out", str(out), "--policies", "none",
                                   "--qps", "5", "--num-requests", "20", "--vllm-results",
                                   str(given), "--gpus", "1"])
    assert res.exit_code != 0
    assert "--out" in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert not (out / "results.parquet").exists()
