"""DSpark prefix scheduler (Algorithm 1) on device; mirrors :mod:`dspark_sim.policies.scheduler`
name for name and must return the *same* ``l_r`` as that numpy reference.

Inputs: ``survival`` [n, gamma] (any float; ranked in float64 like numpy) and ``sps``
[>= n * gamma + 1] steps/s when ``i`` draft tokens are admitted (tensor or array; only
the first ``n * gamma + 1`` entries are used). Outputs ``l`` [n] int64 on the survival's
device, never synchronising with the host (the async budget stays a device scalar).

What runs where (Triton backend): the ranking is ``torch.sort(descending, stable)`` in
float64 (ties keep row-major flat order ``r * gamma + j``, as numpy's stable argsort of
``-a``); one single-program Triton kernel then does the float64 prefix sum, Theta, the
early stop / global argmax and the per-request admission count (atomic adds), so
``n * gamma + 1 <= MAX_CANDIDATES`` (16384). The top-K admission of the async variant is
a separate multi-program kernel reading K from device memory.

Exactness: Theta is compared between neighbours, so ``l`` depends on float64 rounding of
the prefix sums. Every path sums in numpy's sequential order -- the Triton kernel with a
scalar loop (``n * gamma`` dependent adds), the torch reference with CPU ``cumsum``
(a CUDA tensor is summed on the host: one sync) -- so ``l`` and K equal numpy's bit for
bit, exact ties included.

NaN: a NaN survival or steps/s counts as 0 (a draft that never survives, a batch size
not worth running), elementwise on device, so both backends rank and stop the same way.
Without it torch's sort put NaN first and Triton's comparisons dropped it: the two
returned different budgets. (Refusing NaN would need a host sync; the numpy reference
takes finite inputs, which the simulator's survivals and profiles are checked to be.)
"""

from __future__ import annotations

import numpy as np
import torch

from ._backend import resolve_backend

MAX_CANDIDATES = 16384  # single-program Triton limit on n * gamma + 1


def _as_f64(x, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x) if not torch.is_tensor(x) else x).to(
        device=device, dtype=torch.float64
    )


def _prep(survival, sps=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    s = survival if torch.is_tensor(survival) else torch.as_tensor(np.asarray(survival))
    if s.dim() != 2:
        raise ValueError(f"survival must be [n, gamma], got {tuple(s.shape)}")
    s = _nan_as_zero(s.to(torch.float64))
    if sps is None:
        return s, None
    table = _as_f64(sps, s.device).reshape(-1)
    if table.numel() < s.numel() + 1:
        raise ValueError(f"sps has {table.numel()} entries, needs n*gamma+1 = {s.numel() + 1}")
    return s, _nan_as_zero(table[: s.numel() + 1]).contiguous()


def _nan_as_zero(x: torch.Tensor) -> torch.Tensor:
    # torch.nan_to_num would also turn +-inf into the largest finite float
    return torch.where(x.isnan(), x.new_zeros(()), x)


def rank_torch(survival: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat candidate order by survival descending, ties by flat index; and sorted values."""
    vals, order = torch.sort(survival.reshape(-1), descending=True, stable=True)
    return order, vals


# ---------------------------------------------------------------------------------------
# Plain-torch references (float64 throughout).


def theta_curve_torch(survival: torch.Tensor, sps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Theta_i = (n + sum of the i best survivals) * sps[i] for i = 0..n*gamma, order)."""
    order, vals = rank_torch(survival)
    # numpy's summation order: CPU cumsum is sequential; CUDA's is a tree scan, so a CUDA
    # reference sums on the host (one sync; the Triton path sums sequentially on device).
    seq = vals.cumsum(0) if vals.device.type == "cpu" else vals.cpu().cumsum(0).to(vals.device)
    csum = torch.cat([vals.new_zeros(1), seq])
    return (survival.shape[0] + csum) * sps, order


def _k_torch(theta: torch.Tensor, early_stop: bool) -> torch.Tensor:
    if not early_stop:
        return theta.argmax()  # first maximum
    rises = theta[1:] > theta[:-1]
    return torch.where(rises.all(), rises.numel(), rises.to(torch.int8).argmin())


def _admit_torch(
    survival: torch.Tensor, k: torch.Tensor | int, order: torch.Tensor | None = None
) -> torch.Tensor:
    n, gamma = survival.shape
    if order is None:
        order, _ = rank_torch(survival)
    taken = (torch.arange(order.numel(), device=order.device) < k).to(torch.int64)
    return torch.zeros(n, dtype=torch.int64, device=order.device).index_add_(
        0, order // gamma, taken
    )


# ---------------------------------------------------------------------------------------
# Public wrappers.


def schedule_sync(survival, sps, *, backend: str = "auto") -> torch.Tensor:
    """Algorithm 1 with early stop: admit while Theta strictly rises. Returns l [n] int64."""
    s, table = _prep(survival, sps)
    if s.shape[0] == 0:
        return torch.zeros(0, dtype=torch.int64, device=s.device)
    if resolve_backend(backend, s) == "torch":
        theta, order = theta_curve_torch(s, table)
        return _admit_torch(s, _k_torch(theta, early_stop=True), order)
    from . import scheduler_triton

    return scheduler_triton.schedule_triton(s, table, early_stop=True, admit=True)[0]


def budget_global(survival, sps, *, backend: str = "auto") -> torch.Tensor:
    """§5.2 budget K = first argmax of Theta over the whole table; 0-d int64 device tensor."""
    s, table = _prep(survival, sps)
    if s.shape[0] == 0:
        return torch.zeros((), dtype=torch.int64, device=s.device)
    if resolve_backend(backend, s) == "torch":
        return _k_torch(theta_curve_torch(s, table)[0], early_stop=False)
    from . import scheduler_triton

    return scheduler_triton.schedule_triton(s, table, early_stop=False, admit=False)[1]


def schedule_topk(survival, k, *, backend: str = "auto") -> torch.Tensor:
    """Admit the ``k`` (int or 0-d device tensor) highest-survival draft tokens."""
    s, _ = _prep(survival)
    if s.shape[0] == 0:
        return torch.zeros(0, dtype=torch.int64, device=s.device)
    k_dev = torch.as_tensor(k, dtype=torch.int64, device=s.device).reshape(())
    if resolve_backend(backend, s) == "torch":
        return _admit_torch(s, k_dev)
    from . import scheduler_triton

    return scheduler_triton.admit_topk_triton(s, k_dev)


def schedule_async(survival, lagged_survival, lagged_sps, *, backend: str = "auto") -> torch.Tensor:
    """§5.2: budget from the lagged snapshot, tokens by current survival (no host sync)."""
    k = budget_global(lagged_survival, lagged_sps, backend=backend)
    return schedule_topk(survival, k, backend=backend)


__all__ = [
    "MAX_CANDIDATES",
    "budget_global",
    "rank_torch",
    "schedule_async",
    "schedule_sync",
    "schedule_topk",
    "theta_curve_torch",
]
