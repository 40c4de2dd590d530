"""Compile every Triton kernel for a CUDA target without a GPU (``ptxas`` ships in the
triton wheel). Catches code-generation errors the CPU interpreter cannot see (types,
constexpr branches, register spills of the single-program scheduler).

    python -m dspark_sim.kernels.aot_check [--arch 90]

Must run in a process where ``TRITON_INTERPRET`` is unset (interpreted kernels cannot be
compiled); prints one line per kernel and exits non-zero on the first failure.
"""

from __future__ import annotations

import argparse
import os
import re
import sys


def _signatures():
    from . import scheduler_triton as sc
    from . import survival_triton as st
    from . import tree_triton as tt
    from . import verify_triton as vt

    rows = {"pd_ptr": "*bf16", "stride_pd": "i32", "pt_ptr": "*bf16", "stride_pt": "i32"}
    yield vt._row_argmax_kernel, {
        "logits_ptr": "*bf16", "stride_row": "i32", "cu_ptr": "*i64", "out_ptr": "*i64",
        "V": "i32",
    }, {"BLOCK_V": 4096}, 8
    yield vt._greedy_accept_kernel, {
        "draft_ptr": "*i64", "argmax_ptr": "*i64", "cu_ptr": "*i64", "acc_ptr": "*i64",
        "next_ptr": "*i64",
    }, {"BLOCK_G": 8}, 4
    for with_accept in (True, False):
        yield vt._stoch_rows_kernel, {
            "tok_ptr": "*i64", **rows, "cu_ptr": "*i64", "u_ptr": "*fp32", "tv_ptr": "*fp32",
            "mass_ptr": "*fp64", "ok_ptr": "*i8", "V": "i32",
        }, {"WITH_ACCEPT": with_accept, "BLOCK_V": 4096}, 8
    yield vt._stoch_sample_kernel, {
        **rows, "cu_ptr": "*i64", "ok_ptr": "*i8", "mass_ptr": "*fp64", "u_ptr": "*fp64",
        "acc_ptr": "*i64", "next_ptr": "*i64", "V": "i32",
    }, {"BLOCK_G": 8, "BLOCK_V": 4096}, 8
    yield st._survival_kernel, {
        "z_ptr": "*fp32", "cu_ptr": "*i64", "temp_ptr": "*fp32", "out_ptr": "*fp32",
    }, {"BLOCK_G": 8}, 4
    theta_sig = {
        "vals_ptr": "*fp64", "order_ptr": "*i64", "sps_ptr": "*fp64", "work_ptr": "*fp64",
        "k_ptr": "*i64", "ell_ptr": "*i64", "n": "i32", "N": "i32", "gamma": "i32",
    }
    for early_stop, block in ((True, 2048), (False, 2048), (True, 16384)):
        consts = {"EARLY_STOP": early_stop, "ADMIT": early_stop, "BLOCK": block}
        yield sc._theta_kernel, theta_sig, consts, sc._warps(block)
    yield sc._admit_kernel, {
        "order_ptr": "*i64", "k_ptr": "*i64", "ell_ptr": "*i64", "N": "i32", "gamma": "i32",
    }, {"BLOCK": 1024}, 4
    yield tt._tree_accept_kernel, {
        "tok_ptr": "*i64", "par_ptr": "*i64", "am_ptr": "*i64", "cu_ptr": "*i64",
        "acc_ptr": "*i64", "best_ptr": "*i64", "path_ptr": "*i64", "next_ptr": "*i64",
        "max_depth": "i32", "path_width": "i32",
    }, {"BLOCK_N": 64, "BLOCK_D": 16}, 4
    yield tt._tree_mask_kernel, {
        "par_ptr": "*i64", "cu_ptr": "*i64", "mask_ptr": "*i8", "depth_ptr": "*i64",
        "M1": "i32", "max_depth": "i32",
    }, {"BLOCK_M": 64}, 4


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET to compile", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", args.arch, 32)
    for fn, sig, consts, warps in _signatures():
        sig = {**sig, **{name: "constexpr" for name in consts}}
        kernel = triton.compile(
            ASTSource(fn=fn, signature=sig, constexprs=consts),
            target=target,
            options={"num_warps": warps},
        )
        local = len(re.findall(r"\.local", kernel.asm["ptx"]))  # spills show as .local
        print(f"sm_{args.arch} {fn.fn.__name__:<24} {consts} warps={warps} "
              f"smem={kernel.metadata.shared}B local_refs={local}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
