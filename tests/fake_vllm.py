#!/usr/bin/env python3
"""A stand-in for a vLLM environment's interpreter, for testing the live runner without
vLLM: ``-m vllm.entrypoints.openai.api_server ... --port P`` serves /health, /metrics
and POST /v1/chat/completions (with ``--per-request-spec-decode-metrics detailed`` and
speculation, each response carries per-step proposed and accepted drafts) on
127.0.0.1:P until signalled; ``-c CODE ...`` (the bench client) writes a result JSON
shaped like ``vllm bench serve --save-result --save-detailed``, its figures moved by a
few per cent per ``dspark_round`` (round 2 is the median): like vLLM's client it sends
the prompt file in a seeded shuffle, and its lengths, texts and acceptance counters are
those the server gives each prompt (a prompt's length: its words); ``-c`` with a
``--dataset-path`` and no ``--result-dir`` (vLLM's sampler, run for a prefix-caching
measurement) writes, per request count, the prompts the bench sends as token ids (a
word's id: its checksum, so prompts sharing words share ids); ``-c`` with anything else
prints a version. With ``--enable-prefix-caching`` the server also answers POST
/reset_prefix_cache (under VLLM_SERVER_DEV_MODE=1, as vLLM) and a warm-up's POST
/v1/completions, and every /metrics scrape advances its prefix-cache counters by 1000
queried and 250 hit tokens (block 128). FAKE_VLLM_LOG, if set, gets one JSON line per
server start, per bench run and per cache reset."""

import json
import os
import random
import sys
import time
import zlib
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path


def stand_in(folder: Path) -> tuple[Path, Path]:
    """An interpreter path that runs this stand-in with the current Python, and a model
    folder (a ``config.json``), both in ``folder``: what the live runner is given."""
    wrapper = folder / "python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} \"$@\"\n")
    wrapper.chmod(0o755)
    model = folder / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return wrapper, model


def events(log: Path, kind: str) -> list[dict]:
    """The ``kind`` events (``server``, ``bench``, ``reset``, ``completion``) the stand-in
    logged to ``log`` (FAKE_VLLM_LOG), in order; none where it logged nothing."""
    return [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == kind] \
        if log.is_file() else []


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
    caching = "--enable-prefix-caching" in argv
    dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
    scrapes = [0]
    Path(os.environ.get("FAKE_VLLM_PIDFILE", os.devnull)).write_text(str(os.getpid()))
    log({"event": "server", "k": k, "pid": os.getpid(), "detailed": detailed,
         "kv_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
         "kv_bytes": arg(argv, "--kv-cache-memory-bytes")})
    print("CPU KV cache size: 51,712 tokens, Maximum concurrency ...", flush=True)

    class Handler(BaseHTTPRequestHandler):
        def reply(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            if self.path == "/reset_prefix_cache":
                if not (caching and dev_mode):
                    return self.reply(404, b'{"detail": "Not Found"}')
                log({"event": "reset", "k": k})
                return self.reply(200, b'{"success": true}')
            if self.path == "/v1/completions":
                log({"event": "completion", "k": k, "prompt": body["prompt"]})
                return self.reply(200, json.dumps({"choices": [{"text": "hi"}]}).encode())
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
            if self.path == "/metrics":
                scrapes[0] += 1 if caching else 0
                n = scrapes[0]
                body += (f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} '
                         f'{1000.0 * n}\n'
                         f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} '
                         f'{250.0 * n}\n'
                         f'vllm:cache_config_info{{block_size="128",engine="0",'
                         f'enable_prefix_caching="{caching}",hash_block_size="None"}} 1.0\n'
                         ).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()


def sampled(argv: list[str], n: int) -> list[str]:
    """The prompts the bench sends: the file in a seeded shuffle (in order with
    --disable-shuffle), cycled up to ``n``."""
    texts = [json.loads(x)["prompt"] for x in
             Path(arg(argv, "--dataset-path")).read_text().splitlines() if x.strip()]
    if "--disable-shuffle" not in argv:
        random.Random(int(arg(argv, "--seed", 0))).shuffle(texts)
    return [texts[i % len(texts)] for i in range(n)]


def sample(argv: list[str]) -> None:
    """vLLM's sampler: per request count, [prompt length, token ids] of each request."""
    out, counts = argv[2], json.loads(argv[3])
    res = {str(n): [[len(t.split()), [zlib.crc32(w.encode()) % 49152 for w in t.split()]]
                    for t in sampled(argv, n)] for n in counts}
    Path(out).write_text(json.dumps(res))


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
         "round": int(meta.get("dspark_round", 0)), "warmups": arg(argv, "--num-warmups")})
    tpot = (50.0 + 4.0 * c * (1 + 0.5 * k)) * (1 - shift)
    sent = sampled(argv, n)
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
    elif argv[:1] == ["-c"] and "--dataset-path" in argv:
        sample(argv)
    else:
        print("0.0-fake")
