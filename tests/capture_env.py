"""Where the capture-stack tests (test_capture, test_capture_v2, test_asd_decode,
test_deepspec) train and decode: a fresh folder per module with the drafter/target
cache redirected into it, and the tiny drafters they train there.

Imported only by modules that already skip without torch (``pytest.importorskip``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest


@contextmanager
def cache_root(tmp_path_factory, name: str) -> Iterator:
    """A fresh folder ``name`` with ``DSPARK_SIM_CACHE`` pointed inside it until exit
    (the user's cache stays untouched). Two torch threads: the tiny models gain nothing
    from more, and the machine's cores are shared."""
    import torch

    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp(name)
    mp = pytest.MonkeyPatch()
    mp.setenv("DSPARK_SIM_CACHE", str(root / "cache"))
    try:
        yield root
    finally:
        mp.undo()


def train_tiny_drafters(target, root, kinds, gamma: int, dspark_kw=None) -> None:
    """Train each drafter kind for 5 steps on six tiny prompts into ``root / kind``;
    ``dspark_kw`` goes to the DSpark drafter only."""
    from test_drafters import tiny_prompts

    from dspark_sim.traces.train import train_drafter

    for kind in kinds:
        train_drafter(kind, target, tiny_prompts(6), steps=5, out_dir=root / kind, gamma=gamma,
                      batch_size=8, max_new_tokens=24, progress=False,
                      drafter_kw=dspark_kw if kind == "dspark" else None)
