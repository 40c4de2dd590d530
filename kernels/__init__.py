"""PyTorch + Triton kernels for real drafter/target runs (see ``docs/kernels.md``).

Public wrappers (each takes ``backend="auto" | "triton" | "torch"``) over the layouts of
:mod:`.layout` -- :class:`Blocks` (varlen ``cu_seqlens``) and :class:`DraftTree` -- built
and checked once per step:

* :func:`verify_greedy`, :func:`verify_stochastic`, :func:`tv_acceptance`,
  :func:`draw_uniforms` -- varlen verification (:mod:`.verify`);
* :func:`verify_tree_greedy`, :func:`tree_attention_mask` -- varlen draft-tree
  verification and its ancestor mask (:mod:`.tree`);
* :func:`survival_varlen`, :func:`survival_dense` -- confidence logits -> survival (:mod:`.survival`);
* :func:`schedule_sync`, :func:`budget_global`, :func:`schedule_topk`,
  :func:`schedule_async` -- Algorithm 1 on device (:mod:`.scheduler`).

Names resolve lazily, so ``import dspark_sim.kernels`` needs neither torch nor triton;
Triton itself is imported only when a Triton backend actually runs.
"""

from __future__ import annotations

if "." not in __name__:  # the bare folder name, from a sys.path entry at the checkout's root
    from dspark_sim.shadow import defer_to_installed

    defer_to_installed(__name__, __file__)

import importlib

_EXPORTS = {
    "Blocks": "layout",
    "DraftTree": "layout",
    "GreedyVerify": "verify",
    "StochasticVerify": "verify",
    "Uniforms": "verify",
    "draw_uniforms": "verify",
    "tv_acceptance": "verify",
    "verify_greedy": "verify",
    "verify_stochastic": "verify",
    "survival_varlen": "survival",
    "survival_dense": "survival",
    "budget_global": "scheduler",
    "schedule_async": "scheduler",
    "schedule_sync": "scheduler",
    "schedule_topk": "scheduler",
    "resolve_backend": "_backend",
    "TreeMask": "tree",
    "TreeVerify": "tree",
    "tree_attention_mask": "tree",
    "verify_tree_greedy": "tree",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = importlib.import_module(f".{_EXPORTS[name]}", __name__)
        value = globals()[name] = getattr(module, name)  # cache: later lookups skip this
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
