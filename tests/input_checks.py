"""The bad-input contract the loaders' tests check (house rule: a malformed file gives a
one-line ``InputError`` naming the file, never a traceback)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from dspark_sim.errors import InputError


def assert_rejects_file(path: Path, text: str, load: Callable[[Path], object],
                        match: str) -> None:
    """``load`` of a file ``path`` holding ``text`` raises a one-line InputError matching
    ``match`` that starts with the file's name."""
    path.write_text(text)
    with pytest.raises(InputError, match=match) as err:
        load(path)
    assert str(err.value).startswith(str(path)) and "\n" not in str(err.value), str(err.value)
