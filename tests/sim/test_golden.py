"""Behaviour unchanged: the same seed gives the same bytes as a STORED run.

``tests/data/golden/<name>/summary.json`` was written by ``dspark-sim run`` (arguments in
``tests/data/golden/make_golden.py``); it carries the size and sha256 of the run's
``requests.parquet``, so equal summary bytes mean an identical request table too. A
refactor must leave both untouched; a change of behaviour regenerates them on purpose
(``make_golden.py``) and says in its commit what moved. A pyarrow upgrade that changes
the parquet writer's bytes (not the data) shows as the hash alone differing.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from dspark_sim.sim.outputs import sha256_file

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"


def _maker():
    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MAKER = _maker()


@pytest.mark.parametrize("name", sorted(MAKER.RUNS))
def test_same_seed_same_bytes_as_the_stored_run(tmp_path, name):
    stored = (GOLDEN / name / "summary.json").read_bytes()
    MAKER.run(name, tmp_path / "run")
    got = (tmp_path / "run" / "summary.json").read_bytes()
    want_d, got_d = json.loads(stored), json.loads(got)
    moved = {k: (want_d.get(k), got_d.get(k)) for k in want_d.keys() | got_d.keys()
             if want_d.get(k) != got_d.get(k)}
    assert moved == {}, "summary fields moved (stored, now)"
    assert got == stored  # and the formatting: byte for byte
    parquet = tmp_path / "run" / "requests.parquet"
    assert sha256_file(parquet) == want_d["outputs"]["requests.parquet"]["sha256"]
    assert parquet.stat().st_size == want_d["outputs"]["requests.parquet"]["bytes"]
