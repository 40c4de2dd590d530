#!/usr/bin/env bash
# One-command GPU check of kernels/ on one CUDA GPU (sized for an H200: < 8 minutes).
#   1. the kernel tests on CUDA (Triton compiled, not interpreted; CUDA-only tests run);
#   2. the GPU benchmark at the deployment shape: verification 256 requests x gamma 8,
#      V = 128k bf16 (target >= 70% of HBM peak, 4800 GB/s on H200), scheduling 256 x 7
#      (target < 50 us; "triton graph" rows are device time without Python dispatch).
# Usage: bash benchmarks/gpu_check_kernels.sh   (from anywhere; writes nothing but stdout)
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET                      # compile for the GPU, never interpret
export TRITON_DEFAULT_FP_FUSION=1           # Triton 3.9 default, stated to silence its warning

python - <<'PY'
import torch, triton
assert torch.cuda.is_available(), "no CUDA device visible"
print("gpu:", torch.cuda.get_device_name(), "| torch", torch.__version__, "| triton", triton.__version__)
PY

echo "== kernel tests on CUDA =="
timeout 300 python -m pytest -q -p no:cacheprovider \
  tests/kernels/test_kernels_verify.py tests/kernels/test_kernels_survival.py \
  tests/kernels/test_kernels_scheduler.py tests/kernels/test_kernels_tree.py tests/kernels/test_kernels_compile.py

echo "== GPU benchmark =="
timeout 150 python benchmarks/bench_kernels.py --device cuda \
  --num-req 256 --gamma 8 --vocab 131072 --dtype bf16 \
  --sched-n 256 --sched-gamma 7 --min-time-s 0.5 --max-iters 20 --peak-gbs 4800
date -u +"done %Y-%m-%dT%H:%M:%SZ"
