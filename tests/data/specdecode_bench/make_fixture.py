"""Regenerate ``combined_fixture.jsonl``: six requests in SpecDecode-Bench's JSONL layout
(github.com/SpecDecode-Bench/simulator, data/llama3.1-8B/combined_<dataset>.jsonl at
commit 2fdccbd61b62be339fb85fd90caf43f5e8392aa6) with values made up here. See README.md.

    python tests/data/specdecode_bench/make_fixture.py
"""

import json
from pathlib import Path

import numpy as np

rng = np.random.default_rng(20260401)
rows = []
for i, (prompt_len, out_len) in enumerate([(94, 178), (103, 61), (57, 240), (131, 12),
                                           (88, 96), (412, 150)]):
    # bursty acceptance: an AR(1) logit over positions, tokens per step = 1 + leading
    # successes of up to 15 drafts (SpecDecode-Bench's EAGLE column reaches 16-20)
    z = np.zeros(out_len)
    for t in range(1, out_len):
        z[t] = 0.8 * z[t - 1] + 0.6 * rng.standard_normal()
    q = 1 / (1 + np.exp(-(1.3 + z)))
    ok = rng.random((out_len, 15)) < q[:, None]
    eagle = np.where(ok.all(1), 15, ok.argmin(1)) + 1
    ngram = np.where(rng.random(out_len) < 0.15, rng.integers(2, 8, out_len), 1)
    rows.append({
        "id": str(100 + 7 * i),
        "prompt_token_ids": rng.integers(0, 128000, prompt_len).tolist(),
        "generated_token_ids": rng.integers(0, 128000, out_len + (3 if i == 2 else 0)).tolist(),
        "acc_eagle": {"acc_len": eagle.astype(int).tolist()},
        "acc_ngram": {"acc_len": ngram.astype(int).tolist()},
    })
out = Path(__file__).with_name("combined_fixture.jsonl")
out.write_text("".join(json.dumps(r) + "\n" for r in rows))
