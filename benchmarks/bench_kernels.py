"""Kernel micro-benchmark (not a test): time and effective bandwidth of every kernel.

For each kernel it times the torch reference path, the fastest plain-torch formulation
written for comparison ("best torch", shown so the reference can be checked to stay
within 2x of it) and, on CUDA, the Triton kernel. Bandwidth = bytes the kernel must
touch (inputs read once + outputs written) / time; it is a lower bound on real traffic.

    python benchmarks/bench_kernels.py                     # CPU defaults, < 1 minute
    python benchmarks/bench_kernels.py --device cuda --num-req 256 --gamma 8 \
        --vocab 131072 --dtype bf16                        # GPU targets

GPU targets (DSpark deployment shape): verification at 256 x gamma 8, V = 128k bf16
>= 70% of HBM bandwidth; scheduling 256 x 7 candidates in < 50 us.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dspark_sim.kernels import layout as klayout
from dspark_sim.kernels import scheduler as ks
from dspark_sim.kernels import survival as ksurv
from dspark_sim.kernels import tree as ktree
from dspark_sim.kernels import verify as kv
from dspark_sim.policies import scheduler as np_sched

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def timeit_s(fn: Callable[[], object], device: str, min_time_s: float, max_iters: int) -> float:
    """Seconds per call: the best of several timed loops (best-of, as timeit: the machine
    is shared, so slower loops measure other processes). Each loop runs enough calls to
    last >= 2 ms; loops repeat until ``min_time_s`` is spent or ``max_iters`` loops ran."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    inner = max(1, int(2e-3 / max(time.perf_counter() - t0, 1e-7)))
    best, loops, start = float("inf"), 0, time.perf_counter()
    while loops < 3 or (time.perf_counter() - start < min_time_s and loops < max_iters):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / inner)
        loops += 1
    return best


def graph_time_s(fn: Callable[[], object], iters: int = 200) -> float | None:
    """Per-call seconds replaying a CUDA graph of ``fn`` (device time without Python)."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            graph.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / iters
    except Exception as err:  # graphs are an extra; report and carry on
        print(f"    (cuda graph capture failed: {type(err).__name__}: {err})")
        return None


# ---------------------------------------------------------------------------------------
# "Best torch" formulations: equal-length blocks let the target rows be a strided view.


def best_greedy(draft, logits, num_req, gamma):
    am = logits.argmax(dim=-1).view(num_req, gamma + 1)
    ok = (am[:, :gamma] == draft.view(num_req, gamma)).to(torch.int8)
    acc = torch.where(ok.all(1), gamma, ok.argmin(1))
    return acc, am.gather(1, acc.unsqueeze(1)).squeeze(1)


def best_stochastic(draft, pd, pt, num_req, gamma, uniforms):
    vocab = pd.shape[1]
    ptv = pt.view(num_req, gamma + 1, vocab)
    pdv = pd.view(num_req, gamma, vocab)
    diff = ptv[:, :gamma].to(torch.float32, copy=True).sub_(pdv)  # the one [T, V] temporary
    tv = 1.0 - 0.5 * torch.linalg.vector_norm(diff, ord=1, dim=-1)
    x = draft.view(num_req, gamma, 1)
    ok = (uniforms.accept.view(num_req, gamma) * pdv.gather(2, x).squeeze(2).float()
          < ptv[:, :gamma].gather(2, x).squeeze(2).float()).to(torch.int8)
    acc = torch.where(ok.all(1), gamma, ok.argmin(1))
    rej = (acc < gamma).unsqueeze(1)
    row_t = ptv[torch.arange(num_req, device=pt.device), acc].float()
    row_d = pdv[torch.arange(num_req, device=pt.device), acc.clamp(max=gamma - 1)].float()
    res = torch.where(rej, (row_t - row_d).clamp_(min=0), row_t).double()
    cum = res.cumsum(1)
    tok = (cum <= (uniforms.sample * cum[:, -1]).unsqueeze(1)).sum(1).clamp_(max=vocab - 1)
    return acc, tok, tv.view(-1)


def best_tree(logits, tokens, parents_local, anc, num_req, nodes):
    """Equal-size trees: the dense ancestor mask [R, n, n] turns "all ancestors matched"
    into one batched matmul (count of mismatched ancestors-or-self)."""
    am = logits.argmax(dim=-1).view(num_req, nodes + 1)
    judge = am.gather(1, (parents_local + 1).view(num_req, nodes))
    miss = (tokens.view(num_req, nodes) != judge).to(torch.float32)
    ok = torch.bmm(anc, miss.unsqueeze(2)).squeeze(2) == 0
    depth = anc.sum(-1)
    key = torch.where(ok, depth * (nodes + 1) + nodes - torch.arange(nodes, device=am.device), -1)
    best_key = key.max(1).values
    acc = torch.where(best_key >= 0, best_key // (nodes + 1), 0).long()
    return acc


def best_survival(z, temp, num_req, gamma):
    return torch.sigmoid(z.view(num_req, gamma) / temp[:gamma]).cumprod(1).view(-1)


def best_schedule(surv, sps):
    vals, order = torch.sort(surv.reshape(-1), descending=True, stable=True)
    theta = (surv.shape[0] + torch.cat([vals.new_zeros(1), vals.cumsum(0)])) * sps
    rises = theta[1:] > theta[:-1]
    k = torch.where(rises.all(), rises.numel(), rises.to(torch.int8).argmin())
    taken = (torch.arange(order.numel(), device=surv.device) < k).to(torch.int64)
    return torch.zeros(surv.shape[0], dtype=torch.int64, device=surv.device).index_add_(
        0, order // surv.shape[1], taken
    )


# ---------------------------------------------------------------------------------------


def row(name: str, path: str, sec: float | None, nbytes: int, peak_gbs: float | None) -> None:
    if sec is None:
        return
    gbs = nbytes / sec / 1e9
    frac = f"  {100 * gbs / peak_gbs:5.1f}% of peak" if peak_gbs else ""
    print(f"  {name:<12} {path:<14} {sec * 1e6:11.1f} us  {gbs:9.2f} GB/s{frac}")


@dataclass(frozen=True)
class Bench:
    """What every phase needs: the shape, where it runs and how it is timed."""

    args: argparse.Namespace
    device: str
    dtype: torch.dtype
    peak: float | None  # HBM GB/s for the % column
    gen: torch.Generator

    @property
    def triton(self) -> bool:
        return self.device == "cuda"

    def t(self, fn: Callable[[], object]) -> float:
        return timeit_s(fn, self.device, self.args.min_time_s, self.args.max_iters)

    def rows(self, name: str, run: Callable[[str], object], nbytes: int, peak: float | None,
             best: Callable[[], object] | None = None) -> None:
        """One op's rows, timed in this order: ``run("torch")`` (the reference), ``best``
        (the fastest plain-torch formulation, when there is one) and, on CUDA,
        ``run("triton")``."""
        row(name, "torch ref", self.t(lambda: run("torch")), nbytes, peak)
        if best is not None:
            row(name, "best torch", self.t(best), nbytes, peak)
        if self.triton:
            row(name, "triton", self.t(lambda: run("triton")), nbytes, peak)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--num-req", type=int, default=32, help="requests R in the verify batch")
    ap.add_argument("--gamma", type=int, default=8, help="draft tokens per request")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--tree-nodes", type=int, default=16,
                    help="nodes per request's draft tree (a gamma-chain plus branches)")
    ap.add_argument("--sched-n", type=int, default=256, help="requests in the scheduler batch")
    ap.add_argument("--sched-gamma", type=int, default=7)
    ap.add_argument("--min-time-s", type=float, default=1.0, help="timing budget per path")
    ap.add_argument("--max-iters", type=int, default=50)
    ap.add_argument("--peak-gbs", type=float, default=None,
                    help="HBM peak GB/s for the %% column (default 4800 = H200 on CUDA)")
    return ap.parse_args(argv)


def bench_verify(b: Bench) -> None:
    """Greedy and stochastic chain verification, after checking that the comparison
    formulations compute what the references compute."""
    num_req, gamma, vocab = b.args.num_req, b.args.gamma, b.args.vocab
    num_draft = num_req * gamma
    device, gen, dtype, peak = b.device, b.gen, b.dtype, b.peak
    esize = torch.tensor([], dtype=dtype).element_size()
    # The layout is built once, outside the timed calls, as a serving step builds it.
    cu = klayout.Blocks.from_lengths([gamma] * num_req, device)
    logits = torch.randn(num_draft + num_req, vocab, device=device, generator=gen).to(dtype)
    pt = torch.softmax(logits.float(), -1).to(dtype)
    pd = torch.softmax(torch.randn(num_draft, vocab, device=device, generator=gen), -1).to(dtype)
    draft = logits.float().argmax(-1).view(num_req, gamma + 1)[:, :gamma].reshape(-1).clone()
    draft[::3] = 0  # some rejections
    uni = kv.draw_uniforms(num_draft, num_req, device, seed=0)

    # The comparison formulations must compute the same thing as the references.
    g_ref = kv.verify_greedy(draft, logits, cu, backend="torch")
    assert all(torch.equal(a, b) for a, b in zip(best_greedy(draft, logits, num_req, gamma), g_ref[:2], strict=True))
    s_ref = kv.verify_stochastic(draft, pd, pt, cu, uniforms=uni, backend="torch")
    s_best = best_stochastic(draft, pd, pt, num_req, gamma, uni)
    assert torch.equal(s_best[0], s_ref.accepted_len)
    assert int((s_best[1] != s_ref.next_token).sum()) <= 1  # fp64 rounding at a CDF boundary
    torch.testing.assert_close(s_best[2], s_ref.tv_accept, atol=1e-4, rtol=0)

    # Greedy: every target row read once.
    nbytes = (num_draft + num_req) * vocab * esize
    b.rows("greedy", lambda be: kv.verify_greedy(draft, logits, cu, backend=be),
           nbytes, peak, best=lambda: best_greedy(draft, logits, num_req, gamma))

    # Stochastic: draft rows + their target rows + bonus rows (lower bound).
    nbytes = (2 * num_draft + num_req) * vocab * esize
    b.rows("stochastic", lambda be: kv.verify_stochastic(
        draft, pd, pt, cu, uniforms=uni, backend=be), nbytes, peak,
        best=lambda: best_stochastic(draft, pd, pt, num_req, gamma, uni))


def bench_tree(b: Bench) -> None:
    """Tree verification (a gamma-deep spine plus branches hanging off random spine
    nodes) and the tree attention mask."""
    num_req, gamma, vocab = b.args.num_req, b.args.gamma, b.args.vocab
    device, gen, peak = b.device, b.gen, b.peak
    esize = torch.tensor([], dtype=b.dtype).element_size()
    nodes = max(b.args.tree_nodes, 1)
    spine = min(gamma, nodes)
    par_one = [-1] + list(range(spine - 1)) + [
        int(x) for x in torch.randint(-1, spine, (nodes - spine,), generator=torch.Generator().manual_seed(1))]
    par_local = torch.tensor(par_one * num_req, dtype=torch.int64, device=device)
    tree = klayout.DraftTree.build(par_local, klayout.Blocks.from_lengths([nodes] * num_req, device))
    t_logits = torch.randn(num_req * (nodes + 1), vocab, device=device, generator=gen).to(b.dtype)
    am_t = t_logits.float().argmax(-1).view(num_req, nodes + 1)
    t_tokens = am_t.gather(1, (par_local.view(num_req, nodes) + 1)).reshape(-1).clone()
    t_tokens[::5] = 0  # some rejections
    anc = ktree.tree_attention_mask(tree, backend="torch").mask[:, 1:, 1:].float()
    t_ref = ktree.verify_tree_greedy(t_tokens, t_logits, tree, backend="torch")
    assert torch.equal(best_tree(t_logits, t_tokens, par_local, anc, num_req, nodes), t_ref.accepted_len)
    nbytes = num_req * (nodes + 1) * vocab * esize
    b.rows("tree", lambda be: ktree.verify_tree_greedy(t_tokens, t_logits, tree, backend=be),
           nbytes, peak,
        best=lambda: best_tree(t_logits, t_tokens, par_local, anc, num_req, nodes))
    # Tree attention mask: R x (n+1)^2 bools out (latency-bound).
    nbytes = num_req * (nodes + 1) ** 2 + par_local.numel() * 16
    b.rows("tree-mask", lambda be: ktree.tree_attention_mask(tree, backend=be),
           nbytes, None)


def bench_survival(b: Bench) -> None:
    """Survival: T logits in, T floats out."""
    num_req, gamma = b.args.num_req, b.args.gamma
    num_draft = num_req * gamma
    cu = klayout.Blocks.from_lengths([gamma] * num_req, b.device)
    z = torch.randn(num_draft, device=b.device, generator=b.gen)
    temp = 0.5 + torch.rand(gamma, device=b.device, generator=b.gen)
    nbytes = num_draft * 8 + gamma * 4
    torch.testing.assert_close(
        best_survival(z, temp, num_req, gamma), ksurv.survival_varlen(z, cu, temp, backend="torch")
    )
    b.rows("survival", lambda be: ksurv.survival_varlen(z, cu, temp, backend=be),
           nbytes, None, best=lambda: best_survival(z, temp, num_req, gamma))


def bench_schedule(b: Bench) -> None:
    """Scheduler (latency-bound: bytes are tiny; time is the figure of merit)."""
    t, n = b.t, b.args.sched_n
    rng = np.random.default_rng(0)
    surv_np = np.cumprod(rng.uniform(0.3, 1.0, (n, b.args.sched_gamma)), axis=1)
    sps_np = np.sort(rng.uniform(10, 100, surv_np.size + 1))[::-1].copy()
    surv = torch.tensor(surv_np, device=b.device)
    sps = torch.tensor(sps_np, device=b.device)
    nbytes = surv.numel() * 8 + sps.numel() * 8 + n * 8
    assert best_schedule(surv, sps).tolist() == np_sched.schedule_sync(surv_np, sps_np).tolist()
    row("schedule", "numpy", t(lambda: np_sched.schedule_sync(surv_np, sps_np)), nbytes, None)
    row("schedule", "torch ref", t(lambda: ks.schedule_sync(surv, sps, backend="torch")), nbytes, None)
    row("schedule", "best torch", t(lambda: best_schedule(surv, sps)), nbytes, None)
    if b.triton:
        fn = lambda: ks.schedule_sync(surv, sps, backend="triton")  # noqa: E731
        row("schedule", "triton", t(fn), nbytes, None)
        row("schedule", "triton graph", graph_time_s(fn), nbytes, None)
        fn_async = lambda: ks.schedule_async(surv, surv, sps, backend="triton")  # noqa: E731
        row("sched-async", "triton", t(fn_async), nbytes, None)
        row("sched-async", "triton graph", graph_time_s(fn_async), nbytes, None)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    peak = args.peak_gbs if args.peak_gbs else (4800.0 if device == "cuda" else None)
    what = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
    print(f"device {device} ({what}), torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"cpus {os.cpu_count()}")
    print(f"verify: R={args.num_req} gamma={args.gamma} V={args.vocab} {args.dtype}; "
          f"schedule: {args.sched_n}x{args.sched_gamma}")
    b = Bench(args, device, DTYPES[args.dtype], peak,
              torch.Generator(device=device).manual_seed(0))
    # one generator through the phases, in this order: the same inputs as ever
    bench_verify(b)
    bench_tree(b)
    bench_survival(b)
    bench_schedule(b)


if __name__ == "__main__":
    main()
