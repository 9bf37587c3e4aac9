"""Memory of the HTTP server under load: RSS before and after rounds of requests, which should stay near the
baseline (no per-request state kept, large bodies refused and their memory handed back).

    python benchmarks/serve_memory.py [--ckpt DIR] [--rounds 3] [--requests 300] [--big 4] [--max-request-mb 4]

Starts `create_app` under uvicorn in this process (127.0.0.1, a free port) over DIR, or over a random tiny
checkpoint written by `k3 init` (CPU). After a warm-up of small requests it reads the baseline RSS (VmRSS of
/proc/self/status), then runs the rounds: each sends `--requests` small completions and chats from 8 client threads,
`--big` bodies of 5 MiB (over the limit: each must be answered 413) and `--big` prompts just under the limit (far
over the context: each must be answered 400 without being tokenized). RSS is printed after every round, with the
peak (VmHWM). The client runs in the same process and reuses its large bodies, so it adds little to the numbers.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _start(app):
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not server.started:
        raise RuntimeError("uvicorn did not start")
    return server, thread, sock, sock.getsockname()[1]


def main() -> int:
    from k3.cli_args import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--ckpt", default=None, help="checkpoint directory (default: a random tiny one, made here)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=300, help="small requests per round")
    ap.add_argument("--big", type=int, default=4, help="5 MiB bodies (413) and near-limit prompts (400) per round")
    ap.add_argument("--max-request-mb", type=float, default=4.0)
    ap.add_argument("--warmup", type=int, default=50)
    args = ap.parse_args()
    if not os.path.exists("/proc/self/status"):
        print("serve_memory: needs /proc/self/status (Linux)", file=sys.stderr)
        return 2

    from k3.checkpoint import from_pretrained
    from k3.cli import main as k3_main
    from k3.data.tokenizer import load_any_tokenizer
    from k3.serve.chat import load_chat_template
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.scheduler import SchedulerConfig
    from k3.serve.app import create_app

    tmp = None
    ckpt = args.ckpt
    if ckpt is None:
        tmp = tempfile.TemporaryDirectory()
        ckpt = os.path.join(tmp.name, "tiny")
        if k3_main(["init", "--preset", "tiny", "--out", ckpt]) != 0:
            return 1
    model = from_pretrained(ckpt)
    tok = load_any_tokenizer(ckpt)
    cfg = EngineConfig(cache_memory_mb=64, page_tokens=256, hash_block_tokens=64, max_model_len=1024,
                       scheduler=SchedulerConfig(max_num_seqs=32, max_step_tokens=1024, prefill_chunk=512))
    engine = LLMEngine(model, tok, cfg)
    limit = int(args.max_request_mb * 2**20)
    app = create_app(engine, tok, "bench", chat_template=load_chat_template(ckpt), max_request_bytes=limit)
    server, thread, sock, port = _start(app)

    over_limit = b"z" * (5 * 2**20)
    head = b'{"model": "bench", "prompt": "'
    near_limit = head + b"x" * (limit - len(head) - 2) + b'"}'
    assert len(over_limit) > limit >= len(near_limit)

    def small(client: httpx.Client, i: int) -> int:
        if i % 2:
            body = {"model": "bench", "prompt": f"request {i}: tell me something", "max_tokens": 4}
            return client.post("/v1/completions", json=body).status_code
        body = {"model": "bench", "messages": [{"role": "user", "content": f"message {i}"}], "max_tokens": 4}
        return client.post("/v1/chat/completions", json=body).status_code

    local = threading.local()
    clients: list[httpx.Client] = []

    def client() -> httpx.Client:
        c = getattr(local, "client", None)
        if c is None:
            c = local.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=120)
            clients.append(c)
        return c

    # One pool for the whole run: its threads and their clients (each with its TLS context) are made once, so
    # the client side stops allocating after the warm-up.
    pool = ThreadPoolExecutor(8)

    def round_of_small(n: int) -> dict:
        codes = list(pool.map(lambda i: small(client(), i), range(n)))
        return {k: codes.count(k) for k in sorted(set(codes))}

    try:
        t0 = time.perf_counter()
        warm = round_of_small(args.warmup)
        base = _status_mb("VmRSS")
        print(f"warm-up: {args.warmup} small requests {warm}; baseline RSS {base:.1f} MB "
              f"(peak so far {_status_mb('VmHWM'):.1f} MB)", flush=True)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=120) as big:
            for r in range(1, args.rounds + 1):
                codes = round_of_small(args.requests)
                for _ in range(args.big):
                    s413 = big.post("/v1/completions", content=over_limit,
                                    headers={"Content-Type": "application/json"}).status_code
                    s400 = big.post("/v1/completions", content=near_limit,
                                    headers={"Content-Type": "application/json"}).status_code
                    if (s413, s400) != (413, 400):
                        raise AssertionError(f"big bodies got {s413} and {s400}, want 413 and 400")
                    codes[413] = codes.get(413, 0) + 1
                    codes[400] = codes.get(400, 0) + 1
                rss = _status_mb("VmRSS")
                print(f"round {r}: {args.requests} small + {args.big} x 5 MiB (413) + {args.big} x "
                      f"{len(near_limit) / 2**20:.1f} MiB prompts (400) {codes}; RSS {rss:.1f} MB "
                      f"({rss - base:+.1f} MB vs baseline), peak {_status_mb('VmHWM'):.1f} MB", flush=True)
        print(f"done in {time.perf_counter() - t0:.0f} s")
    finally:
        pool.shutdown()
        for c in clients:
            c.close()
        server.should_exit = True
        thread.join(30)
        sock.close()
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
