"""Tree verification kernels: Triton (CUDA, or the CPU interpreter) vs torch reference vs a
per-request Python oracle written from the definition; chains equal the chain kernel."""


import pytest
from kernel_env import DEV, needs_triton, torch  # sets the device env first

from dspark_sim.kernels import (  # noqa: E402
    DraftTree,
    tree_attention_mask,
    verify_greedy,
    verify_tree_greedy,
)
from dspark_sim.kernels.tree import chain_parents  # noqa: E402


def _cu(lengths, device=DEV):
    lens = torch.tensor(lengths, dtype=torch.int64)
    return torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(device)


def _random_trees(lengths, vocab, gen, p_hit=0.7):
    """Random topological trees; integer logits (argmax ties inside rows); node tokens
    copy their parent row's argmax with probability ``p_hit`` (else a random token, which
    may equal it anyway), so siblings often repeat the accepted token (depth ties)."""
    num_nodes, num_req = sum(lengths), len(lengths)
    logits = torch.randint(0, 4, (num_nodes + num_req, vocab), generator=gen).float()
    am = logits.argmax(-1)
    parents, tokens = [], []
    base = 0
    for r, n in enumerate(lengths):
        for i in range(n):
            deep = float(torch.rand(1, generator=gen)) < 0.5  # half extend the last node
            p = -1 if i == 0 else (i - 1 if deep else int(torch.randint(-1, i, (1,), generator=gen)))
            parents.append(p)
            row = base + r + 1 + p
            hit = float(torch.rand(1, generator=gen)) < p_hit
            tokens.append(int(am[row]) if hit else int(torch.randint(0, vocab, (1,), generator=gen)))
        base += n
    return (torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64), logits)


def _oracle(tokens, parents, logits, lengths):
    """Straight from the definition, one request and one node at a time."""
    am = logits.argmax(-1).tolist()
    out = []
    base = 0
    for r, n in enumerate(lengths):
        row0 = base + r + 1
        accepted, depth = [], []
        for i in range(n):
            p = int(parents[base + i])
            ok = int(tokens[base + i]) == am[row0 + p] and (p < 0 or accepted[p])
            accepted.append(ok)
            depth.append(1 if p < 0 else depth[p] + 1)
        best, best_d = -1, 0
        for i in range(n):
            if accepted[i] and depth[i] > best_d:
                best, best_d = i, depth[i]
        path, node = [], best
        while node >= 0:
            path.insert(0, node)
            node = int(parents[base + node])
        out.append((best_d, best, path, am[row0 + best], depth))
        base += n
    return out


def _check_against_oracle(got, tokens, parents, logits, lengths):
    want = _oracle(tokens, parents, logits, lengths)
    assert got.accepted_len.tolist() == [w[0] for w in want]
    assert got.best_node.tolist() == [w[1] for w in want]
    assert got.next_token.tolist() == [w[3] for w in want]
    for r, w in enumerate(want):
        row = got.path[r].tolist()
        assert row[: len(w[2])] == w[2]
        assert all(x == -1 for x in row[len(w[2]):])


LENGTHS = [5, 0, 1, 12, 3, 9, 16, 2]


@pytest.mark.parametrize("seed", range(6))
def test_tree_torch_matches_oracle(seed):
    gen = torch.Generator().manual_seed(seed)
    tokens, parents, logits = _random_trees(LENGTHS, 3 + seed, gen)
    tree = DraftTree.build(parents, _cu(LENGTHS, "cpu"))
    got = verify_tree_greedy(tokens, logits, tree, backend="torch")
    _check_against_oracle(got, tokens, parents, logits, LENGTHS)
    # The oracle's trees really exercise depth > 1 and same-depth ties.
    assert max(got.accepted_len.tolist()) >= 3


@needs_triton
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("as_argmax", [False, True])
def test_tree_triton_matches_torch(seed, as_argmax):
    gen = torch.Generator().manual_seed(100 + seed)
    tokens, parents, logits = _random_trees(LENGTHS, 4, gen)
    tree = DraftTree.build(parents.to(DEV), _cu(LENGTHS))
    target = logits.argmax(-1) if as_argmax else logits
    ref = verify_tree_greedy(tokens.to(DEV), target.to(DEV), tree, backend="torch")
    got = verify_tree_greedy(tokens.to(DEV), target.to(DEV), tree, backend="triton")
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a.cpu(), b.cpu())
    _check_against_oracle(got, tokens, parents, logits, LENGTHS)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_chain_tree_equals_chain_kernel(backend):
    """A tree with one node per depth is the chain: same accepted length and bonus token."""
    gen = torch.Generator().manual_seed(7)
    lengths = [4, 0, 7, 1, 3]
    num = sum(lengths)
    logits = torch.randint(0, 5, (num + len(lengths), 33), generator=gen).float()
    req = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    draft = logits.argmax(-1)[torch.arange(num) + req].clone()
    flip = torch.rand(num, generator=gen) < 0.25
    draft[flip] = (draft[flip] + 1) % 33
    cu = _cu(lengths)
    chain = verify_greedy(draft.to(DEV), logits.to(DEV), cu, backend=backend)
    layout = DraftTree.build(chain_parents(lengths, DEV), cu)
    tree = verify_tree_greedy(draft.to(DEV), logits.to(DEV), layout, backend=backend)
    assert torch.equal(tree.accepted_len, chain.accepted_len)
    assert torch.equal(tree.next_token, chain.next_token)
    assert torch.equal(tree.target_argmax, chain.target_argmax)
    for r, a in enumerate(chain.accepted_len.tolist()):  # the path is the chain's prefix
        assert tree.path[r, :a].tolist() == list(range(a))


def test_tree_rejects_malformed_trees():
    cu = _cu([3], "cpu")
    with pytest.raises(ValueError, match="topological"):
        DraftTree.build(torch.tensor([-1, 2, 0]), cu)
    with pytest.raises(ValueError, match="topological"):
        DraftTree.build(torch.tensor([-1, 0, -2]), cu)
    with pytest.raises(ValueError, match="parents has 2 entries"):
        DraftTree.build(torch.tensor([-1, 0]), cu)
    with pytest.raises(TypeError, match="int32/int64"):
        DraftTree.build(torch.tensor([-1.0, 0.0, 0.0]), cu)
    with pytest.raises(ValueError, match="non-decreasing"):
        DraftTree.build(torch.tensor([-1, 0, 0]), torch.tensor([0, 4, 3]))
    tree = DraftTree.build(torch.tensor([-1, 0, 0]), cu)
    assert (tree.blocks.max_seqlen, tree.max_depth) == (3, 3)  # depth bound: the largest tree
    with pytest.raises(ValueError, match="target_logits"):
        verify_tree_greedy(torch.zeros(3, dtype=torch.long), torch.zeros(3, 5), tree)
    with pytest.raises(ValueError, match="node_tokens has 4 entries"):
        verify_tree_greedy(torch.zeros(4, dtype=torch.long), torch.zeros(4, 5), tree)


@pytest.mark.parametrize("seed", range(3))
def test_tree_max_depth_must_reach_the_deepest_node(seed):
    """A max_depth below the deepest node would give an IndexError (torch) or a silently
    shortened path (Triton); build() refuses it, and accepts exactly the true depth."""
    _, parents, _ = _random_trees(LENGTHS, 4, torch.Generator().manual_seed(seed))
    deepest = int(_mask_oracle(parents, LENGTHS, max(LENGTHS))[1].max())
    assert deepest >= 3
    tree = DraftTree.build(parents, _cu(LENGTHS, "cpu"), max_depth=deepest)
    assert tree.max_depth == deepest and tree.blocks.max_seqlen == max(LENGTHS)
    with pytest.raises(ValueError, match=f"below the deepest node \\({deepest}\\)"):
        DraftTree.build(parents, _cu(LENGTHS, "cpu"), max_depth=deepest - 1)
    with pytest.raises(TypeError, match="max_depth"):
        DraftTree.build(parents, _cu(LENGTHS, "cpu"), max_depth=2.5)


def _mask_oracle(parents, lengths, m):
    masks, depths, base = [], [], 0
    for n in lengths:
        mk = torch.eye(m + 1, dtype=torch.bool)
        mk[: n + 1, 0] = True
        for i in range(n):
            node = i
            d = 0
            while node >= 0:
                mk[i + 1, node + 1] = True
                node = int(parents[base + node])
                d += 1
            depths.append(d)
        masks.append(mk)
        base += n
    return torch.stack(masks), torch.tensor(depths, dtype=torch.int64)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_tree_attention_mask_matches_oracle(backend):
    gen = torch.Generator().manual_seed(3)
    _, parents, _ = _random_trees(LENGTHS, 4, gen)
    got = tree_attention_mask(DraftTree.build(parents.to(DEV), _cu(LENGTHS)), backend=backend)
    want_mask, want_depth = _mask_oracle(parents, LENGTHS, max(LENGTHS))
    assert torch.equal(got.mask.cpu(), want_mask)
    assert torch.equal(got.depth.cpu(), want_depth)
    # A chain's mask is causal over [root, d_1 .. d_n].
    chain = tree_attention_mask(DraftTree.build(chain_parents([6], DEV), _cu([6])),
                                backend=backend)
    assert torch.equal(chain.mask[0].cpu(), torch.tril(torch.ones(7, 7, dtype=torch.bool)))
    assert chain.depth.tolist() == [1, 2, 3, 4, 5, 6]


@needs_triton
def test_tree_all_empty_requests():
    cu = _cu([0, 0])
    logits = torch.randn(2, 11, device=DEV)
    tree = DraftTree.build(torch.zeros(0, dtype=torch.long, device=DEV), cu)
    got = verify_tree_greedy(torch.zeros(0, dtype=torch.long, device=DEV), logits, tree,
                             backend="triton")
    assert got.accepted_len.tolist() == [0, 0]
    assert got.best_node.tolist() == [-1, -1]
    assert got.next_token.tolist() == logits.argmax(-1).tolist()
