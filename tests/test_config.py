"""TOML configs and presets."""

from __future__ import annotations

import pytest

from dspark_sim.errors import InputError
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import load_config, preset


def test_toml_config_composes_with_preset(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(
        'preset = "tiny"\n[engine]\nmax_num_seqs = 32\n[workload]\nqps = 5.0\nnum_requests = 30\n'
        '[run]\npolicy = "fixed:2"\nseed = 4\n'
    )
    cfg = load_config(p)
    assert cfg.engine.max_num_seqs == 32 and cfg.workload.qps == 5.0
    assert cfg.policy == "fixed:2" and cfg.deployment.replicas == preset("tiny").deployment.replicas
    assert simulate(cfg).summary["completed"] == 30


@pytest.mark.parametrize("text,needle", [
    ("[engine]\nmax_num_seqz = 3\n", "unknown key"),
    ("[bogus]\nx = 1\n", "unknown table"),
    ("[engine\n", "invalid TOML"),
])
def test_bad_config(tmp_path, text, needle):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(InputError, match=needle) as err:
        load_config(p)
    assert str(p) in str(err.value)


def test_unknown_preset():
    with pytest.raises(InputError, match="--preset"):
        preset("huge")
