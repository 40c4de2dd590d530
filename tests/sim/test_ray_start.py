"""``sweep --executor ray`` starting Ray: Ray's own start-up failures are one line with the
remedy, not Ray's traceback."""

from __future__ import annotations

import sys
import types

import pytest

from dspark_sim.errors import InputError
from dspark_sim.sim.ray_start import start_ray


def fake_ray(monkeypatch, error: BaseException | None) -> types.SimpleNamespace:
    """A stand-in ``ray`` whose ``init`` raises ``error`` (None: starts), recording calls."""
    calls: list[str] = []

    def init(**kwargs):
        calls.append(f"init {sorted(kwargs.items())}")
        if error is not None:
            raise error

    ray = types.SimpleNamespace(is_initialized=lambda: False, init=init,
                                shutdown=lambda: calls.append("shutdown"), calls=calls)
    monkeypatch.setitem(sys.modules, "ray", ray)
    return ray


@pytest.mark.parametrize("error", [
    # what ray 2.x raises when the local node misses its start-up deadline (bare Exception)
    Exception("The current node timed out during startup. This could happen because some "
              "of the raylet failed to startup or the GCS has become overloaded."),
    ConnectionError("Could not find any running Ray instance. Please specify the one to "
                    "connect to by setting `--address` flag or `RAY_ADDRESS`\nenvironment"),
    RuntimeError("Failed to start GCS"),
])
def test_a_ray_that_cannot_start_is_one_line_with_the_remedy(monkeypatch, error):
    ray = fake_ray(monkeypatch, error)
    with pytest.raises(InputError) as exc:
        start_ray(2)
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith("--executor: Ray failed to start")
    assert type(error).__name__ in msg and str(error).splitlines()[0] in msg
    assert "--executor process" in msg and "RAY_ADDRESS" in msg
    assert ray.calls == ["init [('ignore_reinit_error', True), ('log_to_driver', False), "
                         "('num_cpus', 2)]", "shutdown"]  # the half-started node stopped


def test_a_ray_that_starts_is_returned(monkeypatch):
    ray = fake_ray(monkeypatch, None)
    assert start_ray(None) is ray
    assert ray.calls == ["init [('ignore_reinit_error', True), ('log_to_driver', False)]"]
    ray.is_initialized = lambda: True  # an existing session is joined, not re-initialised
    assert start_ray(4) is ray and len(ray.calls) == 1


def test_ray_missing_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(InputError, match="ray is not installed.*--executor process"):
        start_ray(None)
