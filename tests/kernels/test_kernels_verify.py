"""Varlen verification kernels: Triton (CUDA, or the CPU interpreter) vs torch reference
vs a per-request Python oracle, plus a statistical test that rejection sampling is exact."""

import os

import pytest
from kernel_env import CUDA, DEV, HAS_TRITON, needs_triton, torch  # sets the device env first

from dspark_sim.kernels import (  # noqa: E402
    Blocks,
    Uniforms,
    draw_uniforms,
    resolve_backend,
    tv_acceptance,
    verify_greedy,
    verify_stochastic,
)

cuda_only = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def _cu(lengths, device=DEV):
    lens = torch.tensor(lengths, dtype=torch.int64)
    return torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(device)


def _greedy_oracle(draft, logits, lengths):
    acc, nxt, d0 = [], [], 0
    for r, n in enumerate(lengths):
        rows = logits[d0 + r : d0 + r + n + 1].float()
        k = 0
        while k < n and int(rows[k].argmax()) == int(draft[d0 + k]):
            k += 1
        acc.append(k)
        nxt.append(int(rows[k].argmax()))
        d0 += n
    return acc, nxt


def _greedy_case(lengths, vocab, dtype, gen, device=DEV):
    num_draft, num_req = sum(lengths), len(lengths)
    # Integer-valued logits force exact argmax ties (first maximum must win).
    logits = torch.randint(0, 6, (num_draft + num_req, vocab), generator=gen).to(dtype)
    req = torch.repeat_interleave(torch.arange(num_req), torch.tensor(lengths))
    target_am = logits.float().argmax(-1)[torch.arange(num_draft) + req]
    draft = target_am.clone()
    flip = torch.rand(num_draft, generator=gen) < 0.3
    draft[flip] = (draft[flip] + 1) % vocab
    return draft.to(device), logits.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_torch_matches_oracle(dtype):
    gen = torch.Generator().manual_seed(1)
    lengths = [3, 0, 5, 1, 8, 2]
    draft, logits = _greedy_case(lengths, 97, dtype, gen, "cpu")
    out = verify_greedy(draft, logits, _cu(lengths, "cpu"), backend="torch")
    acc, nxt = _greedy_oracle(draft, logits, lengths)
    assert out.accepted_len.tolist() == acc
    assert out.next_token.tolist() == nxt
    assert out.target_argmax.tolist() == logits.float().argmax(-1).tolist()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 97, 512])
def test_greedy_triton_matches_torch(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    lengths = [3, 0, 5, 1, 8, 2]
    draft, logits = _greedy_case(lengths, vocab, dtype, gen)
    cu = _cu(lengths)
    ref = verify_greedy(draft, logits, cu, backend="torch")
    # A launch wider than the longest block (8), as a fixed CUDA-graph width would be.
    got = verify_greedy(draft, logits, Blocks.from_cu_seqlens(cu, max_seqlen=12), backend="triton")
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    acc, _ = _greedy_oracle(draft.cpu(), logits.cpu(), lengths)
    assert got.accepted_len.tolist() == acc


@needs_triton
def test_greedy_all_empty_requests():
    lengths = [0, 0, 0]
    logits = torch.randn(3, 50, device=DEV)
    draft = torch.zeros(0, dtype=torch.int64, device=DEV)
    got = verify_greedy(draft, logits, _cu(lengths), backend="triton")
    assert got.accepted_len.tolist() == [0, 0, 0]
    assert got.next_token.tolist() == logits.argmax(-1).tolist()


# ---------------------------------------------------------------------------------------
# Stochastic.


def _stoch_case(lengths, vocab, dtype, gen, device=DEV):
    num_draft, num_req = sum(lengths), len(lengths)
    pd = torch.softmax(2 * torch.randn(num_draft, vocab, generator=gen), -1)
    pt = torch.softmax(2 * torch.randn(num_draft + num_req, vocab, generator=gen), -1)
    draft = torch.multinomial(pd, 1, generator=gen).squeeze(1) if num_draft else pd.new_zeros(0)
    return draft.long().to(device), pd.to(dtype).to(device), pt.to(dtype).to(device)


def _tv_oracle(pd, pt, lengths):
    out, d0 = [], 0
    for r, n in enumerate(lengths):
        for k in range(n):
            diff = pd[d0 + k].double() - pt[d0 + r + k].double()
            out.append(1.0 - 0.5 * float(diff.abs().sum()))
        d0 += n
    return torch.tensor(out, dtype=torch.float64)


def test_stochastic_torch_accept_rule_and_tv():
    gen = torch.Generator().manual_seed(3)
    lengths = [4, 0, 2, 6]
    draft, pd, pt = _stoch_case(lengths, 64, torch.float32, gen, "cpu")
    uni = draw_uniforms(sum(lengths), len(lengths), "cpu", seed=7)
    out = verify_stochastic(draft, pd, pt, _cu(lengths, "cpu"), uniforms=uni, backend="torch")
    # Oracle for the accept test: first k with u_k * p_d(x_k) >= p_t(x_k).
    d0 = 0
    for r, n in enumerate(lengths):
        k = 0
        while k < n and uni.accept[d0 + k] * pd[d0 + k, draft[d0 + k]] < pt[d0 + r + k, draft[d0 + k]]:
            k += 1
        assert int(out.accepted_len[r]) == k
        tok = int(out.next_token[r])
        if k < n:  # the residual sample can only hit tokens where p_t > p_d
            assert pt[d0 + r + k, tok] > pd[d0 + k, tok]
        d0 += n
    torch.testing.assert_close(out.tv_accept.double(), _tv_oracle(pd, pt, lengths), atol=1e-5, rtol=0)


def _stochastic_backends_agree(draft, pd, pt, cu, seeds: int, atol: float):
    """Triton and torch stochastic verification, seed by seed: the same accepted lengths
    and next tokens, TV acceptance within ``atol``. Returns the last torch result."""
    for seed in range(seeds):
        ref = verify_stochastic(draft, pd, pt, cu, seed=seed, backend="torch")
        got = verify_stochastic(draft, pd, pt, cu, seed=seed, backend="triton")
        assert torch.equal(ref.accepted_len, got.accepted_len)
        assert torch.equal(ref.next_token, got.next_token)
        torch.testing.assert_close(got.tv_accept, ref.tv_accept, atol=atol, rtol=0)
    return ref


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [64, 300])
def test_stochastic_triton_matches_torch(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab + 11)
    lengths = [4, 0, 2, 6, 1]
    draft, pd, pt = _stoch_case(lengths, vocab, dtype, gen)
    cu = _cu(lengths)
    ref = _stochastic_backends_agree(draft, pd, pt, cu, seeds=4, atol=2e-6)
    tv = tv_acceptance(pd, pt, cu, backend="triton")
    torch.testing.assert_close(tv, ref.tv_accept, atol=2e-6, rtol=0)


@needs_triton
def test_stochastic_large_vocab_streamed():
    """V = 32768: several BLOCK_V chunks per row (streamed max/sums and carried cumsum)."""
    gen = torch.Generator().manual_seed(5)
    lengths = [2, 1]
    draft, pd, pt = _stoch_case(lengths, 32768, torch.bfloat16, gen)
    cu = _cu(lengths)
    _stochastic_backends_agree(draft, pd, pt, cu, seeds=2, atol=1e-5)
    logits = pt.float().log()
    g_ref = verify_greedy(draft, logits, cu, backend="torch")
    g_got = verify_greedy(draft, logits, cu, backend="triton")
    assert torch.equal(g_ref.target_argmax, g_got.target_argmax)


def _tv_dist(counts, p):
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def _emitted_marginals(num_req, out, draft, gamma):
    """Per output position j, the emitted token of every request that got that far."""
    acc, nxt = out.accepted_len.cpu(), out.next_token.cpu()
    drafts = draft.cpu().view(num_req, gamma)
    per_pos = []
    for j in range(gamma + 1):
        reached = acc >= j  # position j is emitted iff at least j drafts were accepted
        tok = torch.where(acc[reached] > j, drafts[reached, min(j, gamma - 1)], nxt[reached])
        per_pos.append(tok)
    return per_pos


def _stat_case(num_req, gamma=2, vocab=8):
    """Identical rows in every request: each request is one independent draw."""
    gen = torch.Generator().manual_seed(123)
    pd_rows = torch.softmax(1.5 * torch.randn(gamma, vocab, generator=gen), -1)
    pt_rows = torch.softmax(1.5 * torch.randn(gamma + 1, vocab, generator=gen), -1)
    pd = pd_rows.repeat(num_req, 1)
    pt = pt_rows.repeat(num_req, 1)
    draft = torch.multinomial(pd, 1, generator=gen).squeeze(1)
    cu = _cu([gamma] * num_req, "cpu")
    return pd_rows, pt_rows, draft, pd, pt, cu


# The interpreter runs ~10 ms per program, so the 40k-draw test runs Triton on CUDA only;
# on CPU the Triton path is pinned to the torch path draw for draw on a smaller batch.
@pytest.mark.parametrize(
    "backend,device",
    [("torch", "cpu"), pytest.param("triton", "cuda", marks=[needs_triton, cuda_only])],
)
def test_stochastic_output_follows_target_distribution(backend, device):
    """Every emitted position must be distributed as that position's p_t, whatever p_d."""
    num_req, gamma, vocab = 40000, 2, 8
    pd_rows, pt_rows, draft, pd, pt, cu = _stat_case(num_req, gamma, vocab)
    out = verify_stochastic(
        draft.to(device), pd.to(device), pt.to(device), cu.to(device), seed=2024, backend=backend
    )
    for j, toks in enumerate(_emitted_marginals(num_req, out, draft, gamma)):
        counts = torch.bincount(toks, minlength=vocab).double()
        samples = int(counts.sum())
        # Expected TV of an exact sampler ~ sqrt(V / (2 pi N)); 4x that is a ~1e-6 false alarm.
        thresh = 4.0 * (vocab / (2 * torch.pi * samples)) ** 0.5
        assert _tv_dist(counts, pt_rows[j].double()) < thresh, (j, samples)
        if j < gamma:  # power check: the same counts are far from the draft distribution
            assert _tv_dist(counts, pd_rows[j].double()) > thresh
    # First-position acceptance rate equals sum(min(p_d, p_t)) = tv_accept.
    rate = float((out.accepted_len >= 1).double().mean())
    tv0 = float(out.tv_accept[0])
    assert abs(rate - tv0) < 4.0 * (tv0 * (1 - tv0) / num_req) ** 0.5


@needs_triton
def test_stochastic_triton_draws_equal_torch_draws():
    num_req, gamma = 200, 2
    _, _, draft, pd, pt, cu = _stat_case(num_req, gamma)
    args = (draft.to(DEV), pd.to(DEV), pt.to(DEV), cu.to(DEV))
    ref = verify_stochastic(*args, seed=2024, backend="torch")
    got = verify_stochastic(*args, seed=2024, backend="triton")
    assert torch.equal(ref.accepted_len, got.accepted_len)
    assert torch.equal(ref.next_token, got.next_token)
    assert 0 < int(ref.accepted_len.sum()) < num_req * gamma  # both branches exercised


def test_seeded_and_explicit_uniforms():
    gen = torch.Generator().manual_seed(9)
    lengths = [3, 2]
    draft, pd, pt = _stoch_case(lengths, 32, torch.float32, gen, "cpu")
    cu = _cu(lengths, "cpu")
    a = verify_stochastic(draft, pd, pt, cu, seed=5, backend="torch")
    uni = draw_uniforms(5, 2, "cpu", seed=5)
    b = verify_stochastic(draft, pd, pt, cu, uniforms=uni, backend="torch")
    assert torch.equal(a.next_token, b.next_token) and torch.equal(a.accepted_len, b.accepted_len)
    # u -> 1: accept exactly where p_t(x) > p_d(x); u = 0 for sampling picks the first
    # token with positive residual / target mass.
    near_one = Uniforms(torch.full((5,), 1.0 - 2**-24), torch.zeros(2, dtype=torch.float64))
    c = verify_stochastic(draft, pd, pt, cu, uniforms=near_one, backend="torch")
    d0 = 0
    for r, n in enumerate(lengths):
        k = 0
        while k < n and (1.0 - 2**-24) * pd[d0 + k, draft[d0 + k]] < pt[d0 + r + k, draft[d0 + k]]:
            k += 1
        assert int(c.accepted_len[r]) == k
        if k < n:
            res = (pt[d0 + r + k] - pd[d0 + k]).clamp(min=0)
        else:
            res = pt[d0 + r + k]
        assert int(c.next_token[r]) == int((res > 0).nonzero()[0])
        d0 += n


def test_input_checks_and_dispatch():
    cu = _cu([2], "cpu")
    with pytest.raises(ValueError, match=r"target_logits must be \[3, V\], got \(2, 10\)"):
        verify_greedy(torch.zeros(2, dtype=torch.int64), torch.randn(2, 10), cu, backend="torch")
    with pytest.raises(ValueError, match="backend must be one of .* got 'gpu'"):
        verify_greedy(torch.zeros(2, dtype=torch.int64), torch.randn(3, 10), cu, backend="gpu")
    with pytest.raises(ValueError, match="draft_probs has V=9, expected 10"):
        verify_stochastic(
            torch.zeros(2, dtype=torch.int64), torch.rand(2, 9), torch.rand(3, 10), cu, backend="torch"
        )
    x = torch.zeros(1)
    expect = "triton" if HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    assert resolve_backend("auto", x) == expect
    assert resolve_backend("torch", x) == "torch"


# Unchecked, each of these would reach the kernels: the Triton path would read past its
# buffers and return accepted lengths like -3 (on CUDA: an illegal address).
@pytest.mark.parametrize("offsets,needle", [
    ([0, 3, 9], "ends at 9"),
    ([0, 4, 1], "non-decreasing"),
    ([1, 3, 5], "start at 0"),
    ([0, 6, 5], "non-decreasing"),
])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_malformed_layouts_are_refused(offsets, needle, backend):
    draft, logits = torch.zeros(5, dtype=torch.int64, device=DEV), torch.randn(7, 11, device=DEV)
    with pytest.raises(ValueError, match=needle):
        verify_greedy(draft, logits, torch.tensor(offsets, device=DEV), backend=backend)
    with pytest.raises(ValueError, match=needle):
        tv_acceptance(torch.rand(5, 11, device=DEV), logits.softmax(-1),
                      torch.tensor(offsets, device=DEV), backend=backend)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_out_of_vocab_draft_tokens_are_rejected_not_read(backend):
    """A draft id outside [0, V) has p_t = 0: rejected at its position on both backends.
    Unmasked, the Triton kernel would load p_d/p_t at that id, past the row."""
    gen = torch.Generator().manual_seed(4)
    lengths, vocab = [3, 3, 2], 16
    draft, pd, pt = _stoch_case(lengths, vocab, torch.float32, gen, DEV)
    u_zero = Uniforms(torch.zeros(8, device=DEV), torch.full((3,), 0.5, dtype=torch.float64,
                                                           device=DEV))
    pt = pd.new_ones(pt.shape) / vocab  # u = 0 accepts every in-vocab token
    bad = draft.clone()
    bad[1], bad[3], bad[7] = vocab, -1, 10**6  # request 0 at k=1, 1 at k=0, 2 at k=1
    out = verify_stochastic(bad, pd, pt, _cu(lengths), uniforms=u_zero, backend=backend)
    assert out.accepted_len.tolist() == [1, 0, 1]
    ref = verify_stochastic(draft, pd, pt, _cu(lengths), uniforms=u_zero, backend=backend)
    assert ref.accepted_len.tolist() == lengths  # the same draft in vocab: all accepted
    with pytest.raises(TypeError, match="integer ids"):
        verify_stochastic(bad.float(), pd, pt, _cu(lengths), backend=backend)
    with pytest.raises(TypeError, match="integer ids"):
        verify_greedy(bad.float(), pt, _cu(lengths), backend=backend)


def test_blocks_layout():
    blocks = Blocks.from_lengths([3, 0, 5])
    assert blocks.cu_seqlens.tolist() == [0, 3, 3, 8]
    assert (blocks.max_seqlen, blocks.num_tokens, blocks.num_requests) == (5, 8, 3)
    assert blocks.num_target_rows == 11
    same = Blocks.from_cu_seqlens(torch.tensor([0, 3, 3, 8], dtype=torch.int32))
    assert (same.max_seqlen, same.num_tokens) == (5, 8)
    assert Blocks.from_lengths([]).max_seqlen == 0 and Blocks.from_lengths([]).num_tokens == 0
    assert Blocks.from_lengths([2, 2], max_seqlen=6).max_seqlen == 6  # a fixed launch width
    with pytest.raises(ValueError, match="below the longest block"):
        Blocks.from_lengths([2, 5], max_seqlen=4)  # a narrower launch would skip tokens
    with pytest.raises(TypeError, match="max_seqlen"):
        Blocks.from_lengths([2], max_seqlen=True)
    with pytest.raises(ValueError, match=">= 0"):
        Blocks.from_lengths([2, -1])
    with pytest.raises(TypeError, match="integer"):
        Blocks.from_lengths([2.5])  # not cut to 2
    with pytest.raises(TypeError, match="int32/int64"):
        Blocks.from_cu_seqlens(torch.tensor([0.0, 2.0]))
    with pytest.raises(ValueError, match="1-D"):
        Blocks.from_cu_seqlens(torch.zeros(2, 2, dtype=torch.int64))


@cuda_only
def test_cuda_verify_large_batch_bf16():
    """The benchmark shape (256 requests, gamma=8, V=128k bf16) against the torch path."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_req, gamma, vocab = 256, 8, 131072
    lengths = [gamma] * num_req
    cu = Blocks.from_lengths(lengths, "cuda")  # checked once, shared by both verifies
    pt = torch.softmax(torch.randn(num_req * (gamma + 1), vocab, device="cuda", generator=gen), -1)
    pd = torch.softmax(torch.randn(num_req * gamma, vocab, device="cuda", generator=gen), -1)
    draft = torch.multinomial(pd, 1, generator=gen).squeeze(1)
    pt, pd = pt.bfloat16(), pd.bfloat16()
    ref = verify_stochastic(draft, pd, pt, cu, seed=1, backend="torch")
    got = verify_stochastic(draft, pd, pt, cu, seed=1, backend="triton")
    assert torch.equal(ref.accepted_len, got.accepted_len)
    assert (ref.next_token != got.next_token).sum() <= 1  # fp64 sum order may flip a boundary
    torch.testing.assert_close(got.tv_accept, ref.tv_accept, atol=1e-4, rtol=0)
    g_ref = verify_greedy(draft, pt, cu, backend="torch")
    g_got = verify_greedy(draft, pt, cu, backend="triton")
    for a, b in zip(g_ref, g_got, strict=True):
        assert torch.equal(a, b)
