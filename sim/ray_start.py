"""Start (or join) Ray for ``sweep --executor ray``, with a one-line error when it cannot.

Ray's start-up failures are not input errors of ours, yet a user meets them as one: on
a loaded machine the local node misses Ray's 30 s start-up deadline and ``ray.init``
raises a bare ``Exception`` ("The current node timed out during startup") with Ray's
own traceback; a ``RAY_ADDRESS`` naming no running cluster raises ``ConnectionError``.
Either way the remedy is the user's choice of executor or cluster, so it is reported as
an :class:`InputError` on ``--executor`` that says what to do instead.
"""

from __future__ import annotations

from typing import Any

from dspark_sim.errors import InputError

REMEDY = ("use --executor process, or set RAY_ADDRESS to the address of a running Ray "
          "cluster")


def start_ray(workers: int | None) -> Any:
    """The ``ray`` module, initialised (``num_cpus=workers`` when Ray is started here;
    a session already initialised, or a cluster ``RAY_ADDRESS`` names, is used as is)."""
    try:
        import ray
    except ImportError:
        raise InputError("--executor", "ray is not installed; pip install 'dspark-sim[ray]' "
                                       "or use --executor process") from None
    if ray.is_initialized():
        return ray
    kwargs = {"num_cpus": workers} if workers else {}
    try:
        ray.init(ignore_reinit_error=True, log_to_driver=False, **kwargs)
    except Exception as exc:  # Ray raises bare Exception, RuntimeError, ConnectionError...
        _shutdown_quietly(ray)
        first = (str(exc).strip().splitlines() or [""])[0]
        raise InputError("--executor", f"Ray failed to start ({exc.__class__.__name__}: "
                                       f"{first}); {REMEDY}") from exc
    return ray


def _shutdown_quietly(ray: Any) -> None:
    """Stop what a failed ``ray.init`` left half-started (its own failure is no news)."""
    try:
        ray.shutdown()
    except Exception:  # the start-up error is the one to report
        pass
