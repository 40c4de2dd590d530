"""One exception type for bad user input.

Every reader (traces, profiles, workloads, calibration maps, options) raises
:class:`InputError` with the offending file or option in the message; the CLI
turns it into a one-line error and exit code 2, never a traceback.
"""

from __future__ import annotations

import numbers
from pathlib import Path

# -- limits one value obeys wherever it is set -------------------------------------------
# A replica's scheduler limits come from an option, a config key or an engine profile's
# [engine] table; each source is held to the same cap. They live here, in the base room,
# because both the option checks (sim) and the profile loader (calibration, which must
# not import sim) read them.
MAX_NUM_BATCHED_TOKENS = 1 << 20  # the engine expands the step table to one float per B
MAX_NUM_SEQS = 1 << 16
# KV capacity and max_model_len: tokens a replica holds (int64 counts, far below overflow)
MAX_KV_CAPACITY_TOKENS = 1 << 40
# replicas behind the router (an option, a config key or a profile's default_replicas):
# one SimPy process and one batch matrix each
MAX_REPLICAS = 1024


class InputError(ValueError):
    """Malformed or inconsistent user input. ``str(err)`` is one line."""

    def __init__(self, where: str | Path | None, problem: str) -> None:
        self.where = None if where is None else str(where)
        self.problem = " ".join(str(problem).split())  # keep it one line
        # args are the constructor's: SimPy re-raises a process's error as
        # ``type(e)(*e.args)`` (a policy's replay may find bad input mid-run)
        super().__init__(self.where, self.problem)

    def __str__(self) -> str:
        return f"{self.where}: {self.problem}" if self.where else self.problem

    def __reduce__(self):
        # picklable (a sweep worker's error reaches the parent process intact)
        return (type(self), (self.where, self.problem))

    def readdressed(self, names: dict[str, str]) -> InputError:
        """This error named as the user knows its ``where`` here (``names``: where ->
        name): sweep's ``--policies`` for run's ``--policy``, a positional argument for
        the option a loader serves elsewhere. Itself when ``where`` is not in ``names``."""
        return InputError(names[self.where], self.problem) if self.where in names else self


def check_known_keys(where: str, table: dict, known) -> None:
    """Refuse keys a TOML table does not define: a misspelt key read as absent makes a
    silent default (a cost term of zero, an identity map)."""
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise InputError(where, f"unknown key(s) {', '.join(unknown)}; known: "
                                f"{', '.join(known)}")


def check_positive_int(option: str, v: object, limit: int | None = None) -> None:
    """A positive integer up to ``limit`` (None passes: the field is optional). Every
    capped count says it alike: ``--num-requests: 2,000,000 is above the limit of
    1,000,000``."""
    if v is None:
        return
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
        raise InputError(option, f"must be a positive integer, got {v!r}")
    if limit is not None and v > limit:
        raise InputError(option, f"{v:,} is above the limit of {limit:,}")


def check_seed(seed: object, option: str = "--seed") -> None:
    """A seed numpy's ``default_rng`` takes: a non-negative integer (a negative one is a
    numpy traceback, a float a TypeError)."""
    if not isinstance(seed, numbers.Integral) or seed < 0:
        raise InputError(option, f"must be a non-negative integer, got {seed}")


def is_decimal(text: str, max_digits: int = 18) -> bool:
    """``text`` is a plain non-negative integer, ASCII ``0``-``9`` only, short enough to
    be a count. ``str.isdigit`` also accepts ``'²'``, which ``int()`` refuses (a
    traceback past the check), and ``'٣'``, which ``int()`` reads as 3; past
    ``max_digits``, ``int()`` may refuse the string or make a number nothing downstream
    holds."""
    return text.isascii() and text.isdigit() and len(text) <= max_digits
