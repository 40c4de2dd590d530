"""Prefix scheduler on device: torch reference and Triton kernel vs the numpy reference
(:mod:`dspark_sim.policies.scheduler`), exact equality of every l_r and budget K."""

import numpy as np
import pytest
from kernel_env import CUDA, DEV, TRITON_OK, torch  # sets the device env first

from dspark_sim.kernels import scheduler as ks  # noqa: E402
from dspark_sim.policies import scheduler as ref  # noqa: E402

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not TRITON_OK, reason="no triton"))]


def _batch(rng, case):
    """Random batch; ``case`` cycles through the tie/staircase regimes."""
    n, gamma = int(rng.integers(1, 14)), int(rng.integers(1, 9))
    conf = rng.uniform(0.05, 1.0, (n, gamma))
    if case % 4 == 1:  # survivals on a few dyadic levels: many exact ties
        conf = np.round(conf * 4) / 4
    if case % 4 == 2:  # confidences exactly 1.0: equal survivals along a row and across rows
        conf[rng.random((n, gamma)) < 0.4] = 1.0
    if case % 4 == 3:  # every request identical: ties across requests
        conf = np.repeat(conf[:1], n, axis=0)
    if case % 6 == 4:  # zero confidences: zero-survival tails (Theta flat on a plateau)
        conf[rng.random((n, gamma)) < 0.3] = 0.0
    survival = np.cumprod(conf, axis=1)
    num = n * gamma + 1
    sps = np.sort(rng.uniform(5.0, 120.0, num))[::-1].copy()
    if case % 6 == 4 and case % 12 == 4:  # flat table: admit all positive survivals, stop at 0
        sps[:] = 50.0
    if case % 3 == 0:  # staircase: plateaus of equal steps/s (equal-Theta neighbours)
        step = int(rng.integers(2, 6))
        sps = np.repeat(sps[::step], step)[:num].copy()
    if case % 5 == 0:  # token budget reached: entries past it are 0
        sps[int(rng.integers(1, num)) :] = 0.0
    if case % 7 == 0:  # jagged (non-monotone) table
        sps = sps * rng.uniform(0.7, 1.3, num)
    if case % 11 == 0:  # longer table than needed: only the first n*gamma+1 entries count
        sps = np.concatenate([sps, rng.uniform(0, 100, 5)])
    return survival, sps


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_numpy_reference_exactly(backend):
    rng = np.random.default_rng(20240601)
    boundary_ties = plateau_stops = 0
    for case in range(160):
        surv, sps = _batch(rng, case)
        theta = ref.theta_curve(surv, sps)
        k_sync = int(ref.schedule_sync(surv, sps).sum())
        _, ranked = ref.rank_candidates(surv)
        # Regimes that only exact tie handling gets right: equal survivals straddling the
        # admission cut, and an early stop on an exactly flat Theta step.
        boundary_ties += bool(0 < k_sync < surv.size and ranked[k_sync - 1] == ranked[k_sync])
        plateau_stops += bool(k_sync < surv.size and theta[k_sync + 1] == theta[k_sync])
        # Lagged snapshot: another batch (requests join and leave between steps).
        lag, lag_sps = _batch(rng, case + 1)
        s_dev = torch.tensor(surv, device=DEV)
        sps_dev = torch.tensor(sps, device=DEV)
        k_top = int(rng.integers(0, surv.size + 3))

        got_sync = ks.schedule_sync(s_dev, sps_dev, backend=backend).cpu().numpy()
        np.testing.assert_array_equal(got_sync, ref.schedule_sync(surv, sps), err_msg=f"case {case}")
        got_k = int(ks.budget_global(s_dev, sps_dev, backend=backend))
        assert got_k == ref.budget_global(surv, sps), case
        got_top = ks.schedule_topk(s_dev, k_top, backend=backend).cpu().numpy()
        np.testing.assert_array_equal(got_top, ref.schedule_topk(surv, k_top), err_msg=f"case {case}")
        got_async = ks.schedule_async(
            s_dev, torch.tensor(lag, device=DEV), lag_sps, backend=backend
        ).cpu().numpy()
        np.testing.assert_array_equal(
            got_async, ref.schedule_async(surv, lag, lag_sps), err_msg=f"case {case}"
        )
    assert boundary_ties >= 10 and plateau_stops >= 5, (boundary_ties, plateau_stops)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_survival_and_edges(backend):
    rng = np.random.default_rng(7)
    surv = np.cumprod(rng.uniform(0.3, 1.0, (16, 7)), axis=1).astype(np.float32)
    sps = np.linspace(100.0, 20.0, surv.size + 1)
    got = ks.schedule_sync(torch.tensor(surv, device=DEV), sps, backend=backend).cpu().numpy()
    np.testing.assert_array_equal(got, ref.schedule_sync(surv, sps))
    # Empty batch, K = 0, K past the table, K as a device tensor.
    empty = torch.zeros(0, 4, device=DEV)
    assert ks.schedule_sync(empty, np.ones(1), backend=backend).numel() == 0
    s = torch.tensor(surv, device=DEV)
    assert int(ks.schedule_topk(s, 0, backend=backend).sum()) == 0
    assert ks.schedule_topk(s, 10**6, backend=backend).tolist() == [7] * 16
    k_dev = torch.tensor(9, device=DEV)
    np.testing.assert_array_equal(
        ks.schedule_topk(s, k_dev, backend=backend).cpu().numpy(), ref.schedule_topk(surv, 9)
    )
    with pytest.raises(ValueError, match=r"sps has 112 entries, needs n\*gamma\+1 = 113"):
        ks.schedule_sync(s, np.ones(surv.size), backend=backend)  # table one entry short


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_survival_or_steps_per_s_counts_as_zero(backend):
    """torch's sort ranked a NaN survival first and Triton's comparisons skipped it, so the
    two backends returned different budgets (0 vs 1 here); both now read NaN as 0."""
    rng = np.random.default_rng(11)
    for case in range(24):
        surv, sps = _batch(rng, case)
        surv[rng.random(surv.shape) < 0.25] = np.nan
        sps[rng.random(sps.shape) < 0.2] = np.nan
        clean_surv, clean_sps = np.nan_to_num(surv, nan=0.0), np.nan_to_num(sps, nan=0.0)
        s_dev = torch.tensor(surv, device=DEV)
        np.testing.assert_array_equal(
            ks.schedule_sync(s_dev, sps, backend=backend).cpu().numpy(),
            ref.schedule_sync(clean_surv, clean_sps), err_msg=f"case {case}")
        assert int(ks.budget_global(s_dev, sps, backend=backend)) == \
            ref.budget_global(clean_surv, clean_sps), case
        np.testing.assert_array_equal(
            ks.schedule_topk(s_dev, 5, backend=backend).cpu().numpy(),
            ref.schedule_topk(clean_surv, 5), err_msg=f"case {case}")


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_benchmark_shape_256x7():
    rng = np.random.default_rng(3)
    for case in range(20):
        surv = np.cumprod(rng.uniform(0.2, 1.0, (256, 7)), axis=1)
        if case % 2:
            surv = np.round(surv * 8) / 8
        sps = np.sort(rng.uniform(10, 90, surv.size + 1))[::-1].copy()
        got = ks.schedule_sync(torch.tensor(surv, device="cuda"), sps, backend="triton")
        np.testing.assert_array_equal(got.cpu().numpy(), ref.schedule_sync(surv, sps))
