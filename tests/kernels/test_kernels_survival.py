"""Fused confidence -> survival kernel: Triton vs torch reference vs a Python oracle."""

import math

import pytest
from kernel_env import DEV, needs_triton, torch  # sets the device env first

from dspark_sim.kernels import Blocks, survival_dense, survival_varlen  # noqa: E402

LENGTHS = [3, 0, 7, 1, 5, 7]


def _cu(lengths, device):
    lens = torch.tensor(lengths, dtype=torch.int64)
    return torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(device)


def _oracle(z, lengths, temp):
    out, d0 = [], 0
    for n in lengths:
        prod = 1.0
        for k in range(n):
            prod *= 1.0 / (1.0 + math.exp(-float(z[d0 + k]) / float(temp[k])))
            out.append(prod)
        d0 += n
    return torch.tensor(out, dtype=torch.float64)


def _case(seed):
    gen = torch.Generator().manual_seed(seed)
    z = 3 * torch.randn(sum(LENGTHS), generator=gen)
    z[::5] = 60.0  # saturates: confidence exactly 1.0 in float32
    temp = 0.5 + torch.rand(8, generator=gen)
    return z, temp


def test_torch_matches_oracle():
    z, temp = _case(0)
    got = survival_varlen(z, _cu(LENGTHS, "cpu"), temp, backend="torch")
    torch.testing.assert_close(got.double(), _oracle(z, LENGTHS, temp), rtol=1e-5, atol=1e-7)
    # Non-increasing inside every request (a product of values in (0, 1]).
    d0 = 0
    for n in LENGTHS:
        seg = got[d0 : d0 + n]
        assert bool((seg[1:] <= seg[:-1]).all())
        d0 += n


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_torch(dtype):
    z, temp = _case(1)
    z = z.to(dtype)
    cu = _cu(LENGTHS, DEV)
    ref = survival_varlen(z.to(DEV), cu, temp.to(DEV), backend="torch")
    got = survival_varlen(z.to(DEV), Blocks.from_cu_seqlens(cu), temp.to(DEV), backend="triton")
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-7)


@needs_triton
def test_dense_form_matches_varlen():
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(5, 6, generator=gen).to(DEV)
    temp = (0.5 + torch.rand(6, generator=gen)).to(DEV)
    for backend in ("torch", "triton"):
        dense = survival_dense(z, temp, backend=backend)
        assert dense.shape == (5, 6)
        expect = torch.cumprod(torch.sigmoid(z / temp), dim=1)
        torch.testing.assert_close(dense, expect, rtol=2e-6, atol=1e-7)


def test_checks():
    z = torch.zeros(4)
    with pytest.raises(ValueError, match="temperature has 3 entries, blocks reach 4"):
        survival_varlen(z, _cu([4], "cpu"), torch.ones(3), backend="torch")
    with pytest.raises(ValueError, match="conf_logits must be a 1-D"):
        survival_varlen(z.view(2, 2), _cu([4], "cpu"), torch.ones(4), backend="torch")
