#!/usr/bin/env python3
"""A stand-in for a vLLM environment's interpreter, for testing the live runner without
vLLM: ``-m vllm.entrypoints.openai.api_server ... --port P`` serves /health, /metrics
and POST /v1/chat/completions (with ``--per-request-spec-decode-metrics detailed`` and
speculation, each response carries per-step proposed and accepted drafts) on
127.0.0.1:P until signalled; ``-c CODE ...`` (the bench client) writes a result JSON
shaped like ``vllm bench serve --save-result --save-detailed``, its figures moved by a
few per cent per ``dspark_round`` (round 2 is the median): like vLLM's client it sends
the prompt file in a seeded shuffle, and its lengths, texts and acceptance counters are
those the server gives each prompt (a prompt's length: its words); ``-c`` with anything else
prints a version. FAKE_VLLM_LOG, if set, gets one JSON line per server start and per
bench run."""

import json
import os
import random
import sys
import time
import zlib
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path


def arg(argv: list[str], name: str, default=None):
    return argv[argv.index(name) + 1] if name in argv else default


def record_cpus(role: str) -> None:
    """Append where this process may run (FAKE_VLLM_CPUFILE), for the pinning test."""
    path = os.environ.get("FAKE_VLLM_CPUFILE")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"role": role, "cpus": sorted(os.sched_getaffinity(0)),
                                "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}) + "\n")


def log(event: dict) -> None:
    path = os.environ.get("FAKE_VLLM_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({**event, "t": time.monotonic()}) + "\n")


def per_step(text: str, max_tokens: int, k: int) -> tuple[list[int], list[int]]:
    """Deterministic n-gram-like steps for one prompt: some propose nothing, the rest k
    drafts, accepted by a rule of the text; their tokens cover max_tokens - 1."""
    acc, dra, left, i = [], [], max_tokens - 1, len(text)
    while left > 0:
        i = (i * 1103515245 + 12345) % 2**31
        d = k if i % 5 < 3 else 0
        a = min(d, (i >> 8) % (k + 1), left - 1)
        acc.append(a)
        dra.append(d)
        left -= a + 1
    return acc, dra


def answer(text: str) -> str:
    """The greedy text a prompt gets, the same in every pass."""
    return f"answer-{zlib.crc32(text.encode()):08x}"


def serve(argv: list[str]) -> None:
    record_cpus("server")
    port = int(arg(argv, "--port"))
    spec = json.loads(arg(argv, "--speculative-config", "null") or "null")
    k = spec["num_speculative_tokens"] if spec else 0
    detailed = arg(argv, "--per-request-spec-decode-metrics") == "detailed"
    Path(os.environ.get("FAKE_VLLM_PIDFILE", os.devnull)).write_text(str(os.getpid()))
    log({"event": "server", "k": k, "pid": os.getpid(), "detailed": detailed,
         "kv_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
         "kv_bytes": arg(argv, "--kv-cache-memory-bytes")})
    print("CPU KV cache size: 51,712 tokens, Maximum concurrency ...", flush=True)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            text = body["messages"][0]["content"]
            n = int(body["max_tokens"])
            spec_metrics = None
            if k and detailed:
                acc, dra = per_step(text, n, k)
                spec_metrics = {"num_spec_steps": sum(1 for d in dra if d),
                                "num_accepted_draft_tokens": sum(acc),
                                "num_draft_tokens": sum(dra), "num_spec_tokens": k,
                                "per_step_accepted": acc, "per_step_drafted": dra}
            out = json.dumps({"id": f"chatcmpl-{len(text)}", "model": body["model"],
                              "choices": [{"index": 0, "finish_reason": "length",
                                           "message": {"role": "assistant",
                                                       "content": answer(text)}}],
                              "usage": {"prompt_tokens": len(text.split()),
                                        "completion_tokens": n},
                              "metrics": {"speculative_decoding": spec_metrics}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(out)

        def do_GET(self):
            body = b"ok" if self.path == "/health" else (
                f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {10 * k}\n'
                .encode())
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()


def bench(argv: list[str]) -> None:
    record_cpus("bench")
    n = int(arg(argv, "--num-prompts"))
    out = int(arg(argv, "--custom-output-len"))
    conc = arg(argv, "--max-concurrency")
    rate = arg(argv, "--request-rate")
    tail = argv[argv.index("--metadata") + 1:]
    meta = dict(x.split("=", 1) for x in tail[:next((i for i, x in enumerate(tail)
                                                       if x.startswith("--")), len(tail))])
    k = int(meta["dspark_k"])
    c = int(conc) if conc else 4
    shift = 0.02 * (int(meta.get("dspark_round", 2)) - 2)  # round 2 is the median
    log({"event": "bench", "setting": meta["dspark_setting"], "load": conc or rate,
         "round": int(meta.get("dspark_round", 0))})
    tpot = (50.0 + 4.0 * c * (1 + 0.5 * k)) * (1 - shift)
    texts = [json.loads(x)["prompt"] for x in
             Path(arg(argv, "--dataset-path")).read_text().splitlines() if x.strip()]
    random.Random(int(arg(argv, "--seed", 0))).shuffle(texts)
    sent = [texts[i % len(texts)] for i in range(n)]
    steps = [per_step(t, out, k) if k else ([0] * (out - 1), [0] * (out - 1)) for t in sent]
    lens = [len(t.split()) for t in sent]
    d = {"completed": n, "max_concurrency": int(conc) if conc else None,
         "request_rate": rate if rate == "inf" else float(rate),
         "total_input_tokens": sum(lens), "total_output_tokens": out * n,
         "input_lens": lens, "output_lens": [out] * n,
         "start_times": [0.5 * i for i in range(n)],
         "itls": [[tpot / 1e3] * len(a) for a, _ in steps],
         "generated_texts": [answer(t) for t in sent],
         "output_throughput": 1000.0 * c / tpot * (1 + 0.4 * k) / (1 + 0.5 * k),
         "median_tpot_ms": tpot, "median_ttft_ms": (200.0 + 10 * c) * (1 + 2 * shift),
         **meta}
    if k:  # the counters of the steps the server gives these prompts
        acc = [a for s in steps for a in s[0]]
        dra = [x for s in steps for x in s[1]]
        drafts = sum(1 for x in dra if x)
        d.update({"spec_decode_num_drafts": drafts, "spec_decode_draft_tokens": sum(dra),
                  "spec_decode_accepted_tokens": sum(acc),
                  "spec_decode_per_position_acceptance_rates": [
                      sum(1 for a in acc if a > j) / drafts for j in range(k)],
                  "spec_decode_acceptance_length": 1 + sum(acc) / drafts})
    result = Path(arg(argv, "--result-dir")) / arg(argv, "--result-filename")
    result.write_text(json.dumps(d))


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["-m"]:
        serve(argv)
    elif argv[:1] == ["-c"] and "--result-dir" in argv:
        bench(argv)
    else:
        print("0.0-fake")
