"""`k3 route` in front of three tiny `k3 serve` instances on loopback (report §5.4.3): prefix-cache hit rate and time
to first token per request class with session affinity against round-robin, class budgets against none, and what a
killed instance costs.

    python benchmarks/route_bench.py                       # all four runs, a few minutes on a 2-core CPU
    python benchmarks/route_bench.py --runs affinity kill  # some of them

The load: --sessions multi-turn sessions (starting --session-gap seconds apart), each a unique first prompt of --first-chars characters that grows by
--turn-chars each turn (--turns turns, --think seconds apart, the session's turns in order), and --bursts bursts of
--burst-size long requests of --long-chars characters, unique (no cache can help them), --burst-every seconds apart
from the --burst-at-th second. Every request streams (max_tokens --max-tokens, greedy); TTFT is measured by the load
generator from sending the request to its first output event. The checkpoint is `k3 init --preset tiny --tokenizer
bytes` (a character is a token, so the router's estimate is exact at --bytes-per-token 1); the instances use
--hash-block-tokens 64 and --page-tokens 128, so that a turn's growth spans a few hash blocks.

Runs (each on three freshly started instances, so every run starts with empty caches):
- affinity: `k3 route` (its defaults: affinity, classes short:2048:0.5 long:inf:0.5 of --fleet-tokens);
- round-robin: --policy round-robin, the same budgets;
- no-budget: affinity with one class taking all of --fleet-tokens (all:inf:1), so a long burst takes the capacity
  that short requests need;
- kill: affinity, and kill -9 --kill-at seconds in of the instance that served the most sessions' first turns so
  far (not restarted). A request lost (no answer and no error) is
  counted; a stream that fails after output ends with the router's error event and is sent again, once, by the
  load generator; "extra prefill" is the prompt tokens computed over the whole fleet (the killed instance's counter
  read just before the kill) minus those of the affinity run, the same load without the kill.

Prefix hit rate: the instances' own counters, k3_prompt_tokens_cached_total / (cached + k3_prompt_tokens_computed_
total), over all requests and over the sessions' turns after their first (from the responses' usage, whose
prompt_tokens_details.cached_tokens is the same counter per request).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import httpx

from k3.route.local import free_port, start_fleet

MODEL = "tiny"
WORDS = ["the", "cache", "holds", "every", "prefix", "a", "session", "has", "sent", "so", "turn", "that", "grows", "by",
         "suffix", "computes", "only", "new", "tokens", "while", "router", "keeps", "each", "on", "instance", "it"]
RUNS = ("affinity", "round-robin", "no-budget", "kill")


def text(rng: random.Random, n: int) -> str:
    out, size = [], 0
    while size < n:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


def metrics(url: str) -> dict:
    out = {}
    for line in httpx.get(f"{url}/metrics", trust_env=False, timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


class Load:
    """The load generator of one run: sessions and bursts, each request's outcome recorded."""

    def __init__(self, base: str, args):
        self.base, self.args = base, args
        self.records: list[dict] = []

    async def request(self, c: httpx.AsyncClient, prompt: str, kind: str, turn: int = 0, session=None) -> dict:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": self.args.max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        rec = {"kind": kind, "session": session, "turn": turn, "prompt_chars": len(prompt), "ttft": None, "status": None,
               "outcome": "lost", "cached": None, "backend": None, "resent": 0}
        for attempt in range(3):  # one resend after a failed stream; a 429 waits its Retry-After once
            t0 = time.monotonic()
            try:
                async with c.stream("POST", f"{self.base}/v1/completions", json=body) as resp:
                    rec["status"], rec["backend"] = resp.status_code, resp.headers.get("x-k3-backend")
                    if resp.status_code != 200:
                        await resp.aread()
                        if resp.status_code in (429, 502, 503) and attempt < 2:
                            rec["resent"] += 1
                            await asyncio.sleep(float(resp.headers.get("retry-after", "1")))
                            continue
                        rec["outcome"] = f"http {resp.status_code}"
                        break
                    done, failed = False, False
                    async for line in resp.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: {"):
                            obj = json.loads(line[6:])
                            if "error" in obj:
                                failed = True
                            elif obj.get("usage"):
                                rec["cached"] = obj["usage"]["prompt_tokens_details"]["cached_tokens"]
                            elif rec["ttft"] is None and obj["choices"]:
                                rec["ttft"] = time.monotonic() - t0
                    if done:
                        rec["outcome"] = "ok"
                        break
                    if failed and attempt < 2:  # the router's error event: the stream had started; send it again
                        rec["resent"] += 1
                        rec["ttft"] = None
                        continue
                    rec["outcome"] = "failed mid-stream" if failed else "lost"
                    break
            except httpx.HTTPError as e:
                rec["outcome"] = f"lost ({type(e).__name__})"
                break
        self.records.append(rec)
        return rec

    async def session(self, c, i: int) -> None:
        await asyncio.sleep(i * self.args.session_gap)
        rng = random.Random(f"session-{i}")
        prompt = f"Session {i:03d}. " + text(rng, self.args.first_chars)
        for turn in range(self.args.turns):
            await self.request(c, prompt, "short", turn, i)
            prompt += " " + text(rng, self.args.turn_chars)
            await asyncio.sleep(self.args.think)

    async def burst(self, c, k: int, at: float) -> None:
        await asyncio.sleep(at)
        rng = random.Random(f"burst-{k}")
        await asyncio.gather(*(self.request(c, f"Long {k}.{j}. " + text(rng, self.args.long_chars), "long")
                               for j in range(self.args.burst_size)))

    async def run(self, on_time=None) -> float:
        t0 = time.monotonic()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(trust_env=False, timeout=600, limits=limits) as c:
            tasks = [self.session(c, i) for i in range(self.args.sessions)]
            tasks += [self.burst(c, k, self.args.burst_at + k * self.args.burst_every) for k in range(self.args.bursts)]
            if on_time is not None:
                tasks.append(on_time())
            await asyncio.gather(*tasks)
        return time.monotonic() - t0


def start_router(urls, policy: str, classes, args, log: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "k3", "route", "--port", str(port), "--policy", policy, "--bytes-per-token", "1",
           "--session-prefix", "64", "--fleet-tokens", str(args.fleet_tokens), "--queue-wait", "120",
           "--health-interval", "0.5", "--log-level", "warning", "--classes", *classes]
    for u in urls:
        cmd += ["--backend", u]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("K3_API_KEY", None)
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", trust_env=False, timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the router did not start; see {log}")


def one_run(name: str, ckpt: str, args, work: str) -> dict:
    serve_args = ["--cache-memory-mb", "256", "--page-tokens", "128", "--hash-block-tokens", "64"]
    fleet = start_fleet(ckpt, 3, serve_args, log_dir=work)
    policy = "round-robin" if name == "round-robin" else "affinity"
    classes = ["all:inf:1"] if name == "no-budget" else ["short:2048:0.5", "long:inf:0.5"]
    router, base = start_router([p.url for p in fleet], policy, classes, args, os.path.join(work, f"route-{name}.log"))
    killed: dict = {}
    try:
        load = Load(base, args)

        async def kill_one():
            if name != "kill":
                return
            await asyncio.sleep(args.kill_at)
            first_turns = [r["backend"] for r in load.records if r["kind"] == "short" and r["turn"] == 0]
            victim = max(fleet, key=lambda p: first_turns.count(p.url))  # the primary of the most sessions so far
            killed["metrics"] = await asyncio.to_thread(metrics, victim.url)
            victim.kill()
            killed["url"], killed["at"] = victim.url, args.kill_at

        wall = asyncio.run(load.run(kill_one))
        per_backend = {p.url: (metrics(p.url) if p.alive() else killed["metrics"]) for p in fleet}
        route_m = metrics(base)
    finally:
        router.terminate()
        router.wait(15)
        for p in fleet:
            p.stop()
    return summarize(name, load.records, per_backend, route_m, killed, wall)


def summarize(name, records, per_backend, route_m, killed, wall) -> dict:
    cached = sum(m["k3_prompt_tokens_cached_total"] for m in per_backend.values())
    computed = sum(m["k3_prompt_tokens_computed_total"] for m in per_backend.values())
    later = [r for r in records if r["kind"] == "short" and r["turn"] > 0 and r["cached"] is not None]
    out = {"run": name, "wall_s": round(wall, 1), "requests": len(records),
           "hit_rate_all": cached / max(1, cached + computed),
           "hit_rate_later_turns": sum(r["cached"] for r in later) / max(1, sum(r["prompt_chars"] for r in later)),
           "computed_tokens": int(computed), "cached_tokens": int(cached),
           "outcomes": {}, "resent": sum(r["resent"] for r in records)}
    for r in records:
        out["outcomes"][r["outcome"]] = out["outcomes"].get(r["outcome"], 0) + 1
    for cls in ("short", "long"):
        t = [r["ttft"] for r in records if r["kind"] == cls and r["ttft"] is not None]
        out[f"ttft_{cls}_p50"], out[f"ttft_{cls}_p99"], out[f"n_{cls}"] = pct(t, 50), pct(t, 99), len(t)
    for key in ("retries", "failovers", "errors", "affinity_hits", "requests"):
        total = int(sum(v for k, v in route_m.items() if k.startswith(f"k3_route_backend_{key}_total")))
        out[f"backend_{key}" if key == "requests" else key] = total
    out["rejected"] = int(sum(v for k, v in route_m.items() if k.startswith("k3_route_class_rejected_total")))
    # sessions that changed instance (a failover), and where their later turns went
    moved, to = 0, set()
    for i in {r["session"] for r in records if r["kind"] == "short"}:
        turns = sorted((r for r in records if r["session"] == i and r["kind"] == "short"), key=lambda r: r["turn"])
        backends = [r["backend"] for r in turns]
        if len(set(backends)) > 1 and name != "round-robin":
            moved += 1
            to.add(backends[-1])
    out["sessions_moved"], out["moved_to_instances"] = moved, len(to)
    out["killed"] = killed.get("url")
    return out


def main() -> None:
    from k3.cli_args import RawDefaultsHelpFormatter

    p = argparse.ArgumentParser(description=__doc__, formatter_class=RawDefaultsHelpFormatter)
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--first-chars", type=int, default=1000)
    p.add_argument("--turn-chars", type=int, default=150)
    p.add_argument("--think", type=float, default=0.5)
    p.add_argument("--session-gap", type=float, default=0.3, help="seconds between the sessions' starts")
    p.add_argument("--bursts", type=int, default=2)
    p.add_argument("--burst-size", type=int, default=4)
    p.add_argument("--burst-at", type=float, default=3.0)
    p.add_argument("--burst-every", type=float, default=12.0)
    p.add_argument("--long-chars", type=int, default=6000)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--fleet-tokens", type=int, default=24000)
    p.add_argument("--kill-at", type=float, default=5.0)
    p.add_argument("--ckpt", help="a checkpoint to serve (default: a random tiny one with the byte tokenizer)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="route-bench-") as work:
        ckpt = args.ckpt
        if ckpt is None:
            ckpt = os.path.join(work, MODEL)
            subprocess.run([sys.executable, "-m", "k3", "init", "--preset", "tiny", "--tokenizer", "bytes", "--out",
                            ckpt], check=True, stdout=subprocess.DEVNULL)
        results = []
        for name in args.runs:
            r = one_run(name, ckpt, args, work)
            results.append(r)
            print(json.dumps(r), flush=True)
    print()
    print("| run | prefix hit rate (all / later turns) | TTFT short p50 / p99 (s) | TTFT long p50 / p99 (s) | "
          "prompt tokens computed | outcomes | retried | resent | 429 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items()))
        print(f"| {r['run']} | {r['hit_rate_all']:.1%} / {r['hit_rate_later_turns']:.1%} | "
              f"{r['ttft_short_p50']:.2f} / {r['ttft_short_p99']:.2f} | {r['ttft_long_p50']:.2f} / "
              f"{r['ttft_long_p99']:.2f} | {r['computed_tokens']:,} | {outcomes} | {r['retries']} | {r['resent']} | "
              f"{r['rejected']} |")
    base = next((r for r in results if r["run"] == "affinity"), None)
    kill = next((r for r in results if r["run"] == "kill"), None)
    if base and kill:
        print(f"\nkill -9 of one instance: extra prefill {kill['computed_tokens'] - base['computed_tokens']:,} "
              f"prompt tokens; lost {sum(v for k, v in kill['outcomes'].items() if k.startswith('lost'))}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
