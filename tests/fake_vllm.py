#!/usr/bin/env python3
"""A stand-in for a vLLM environment's interpreter, for testing the live runner without
vLLM: ``-m vllm.entrypoints.openai.api_server ... --port P`` serves /health and /metrics
on 127.0.0.1:P until signalled; ``-c CODE ...`` (the bench client) writes a result JSON
shaped like ``vllm bench serve --save-result --save-detailed``; ``-c`` with anything
else prints a version."""

import json
import os
import sys
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


def serve(argv: list[str]) -> None:
    record_cpus("server")
    port = int(arg(argv, "--port"))
    spec = json.loads(arg(argv, "--speculative-config", "null") or "null")
    k = spec["num_speculative_tokens"] if spec else 0
    Path(os.environ.get("FAKE_VLLM_PIDFILE", os.devnull)).write_text(str(os.getpid()))
    print("CPU KV cache size: 51,712 tokens, Maximum concurrency ...", flush=True)

    class Handler(BaseHTTPRequestHandler):
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
    meta = dict(x.split("=", 1) for x in argv[argv.index("--metadata") + 1:][:2])
    k = int(meta["dspark_k"])
    c = int(conc) if conc else 4
    tpot = 50.0 + 4.0 * c * (1 + 0.5 * k)
    d = {"completed": n, "max_concurrency": int(conc) if conc else None,
         "request_rate": rate if rate == "inf" else float(rate),
         "total_input_tokens": 100 * n, "total_output_tokens": out * n,
         "input_lens": [100] * n, "output_lens": [out] * n,
         "start_times": [0.5 * i for i in range(n)],
         "output_throughput": 1000.0 * c / tpot * (1 + 0.4 * k) / (1 + 0.5 * k),
         "median_tpot_ms": tpot, "median_ttft_ms": 200.0 + 10 * c, **meta}
    if k:
        d.update({"spec_decode_num_drafts": 100, "spec_decode_draft_tokens": 100 * k,
                  "spec_decode_accepted_tokens": 40 * k,
                  "spec_decode_per_position_acceptance_rates": [0.4] * k,
                  "spec_decode_acceptance_length": 1 + 0.4 * k})
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
