"""``k3 env``: list the task families and harness presets; run episodes against a model.

    k3 env list
    k3 env run --endpoint http://127.0.0.1:8000/v1 --model tiny --tasks arith:20 code:10 \\
               --harness react --harness coder --out runs/env
    k3 env run --ckpt runs/k3 --tasks arith:20 --harness react --out runs/env
    k3 env demos --tasks arith:200 code:50 --harness terminal --harness coder --out demos.jsonl

`--endpoint` takes any OpenAI-compatible server (`k3 serve`, vLLM, SGLang, a hosted API). `--ckpt` loads a k3
checkpoint into this process and serves it on a free loopback port for the episodes, through the same chat
endpoint `k3 serve` has, so the two give the same results. `k3 env demos` plays each task's scripted solution
through the same episodes and writes the successful ones as `k3 sft` conversations (the RL cold start, k3.env.demos).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

__all__ = ["add_parser"]


def add_parser(sub) -> None:
    p = sub.add_parser("env", help="agent environments: task families, harnesses, episodes (report §4.2)")
    s = p.add_subparsers(dest="env_command", required=True)
    ls = s.add_parser("list", help="the task families and the harness presets")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(fn=cmd_list)

    r = s.add_parser("run", help="run episodes of task families with harnesses against a model")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--endpoint", help="an OpenAI-compatible server's URL (its root or /v1)")
    src.add_argument("--ckpt", help="a k3 checkpoint (or run directory) to serve in this process")
    r.add_argument("--model", help="the model name to request (with --endpoint; default: the server's first model)")
    r.add_argument("--api-key", default=None, help="bearer token for --endpoint (default: $K3_API_KEY)")
    r.add_argument("--tasks", nargs="+", required=True, metavar="FAMILY[:N]",
                   help="task families and episodes of each (default N: 10), e.g. arith:20 code:10")
    r.add_argument("--harness", action="append", metavar="PRESET|FILE",
                   help="a harness preset or JSON file (repeatable; every task runs with each; default: react)")
    r.add_argument("--out", required=True, help="directory for trajectories.jsonl and summary.{json,md}")
    r.add_argument("--split", choices=["train", "test"], default="test", help="which instances (default: held out)")
    r.add_argument("--seed", type=int, default=0, help="instance seed")
    r.add_argument("--concurrency", type=int, default=4, help="episodes at once (default 4)")
    r.add_argument("--sandbox", choices=["bwrap", "none"], default="bwrap",
                   help="bwrap: isolated (default); none: run agent commands UNISOLATED on this machine")
    r.add_argument("--resume", action="store_true", help="run only the episodes --out has no trajectory of")
    r.add_argument("--no-progress", dest="progress", action="store_false")
    r.add_argument("--device", default="auto", help="with --ckpt: where the model runs")
    r.add_argument("--cache-memory-mb", type=float, default=None, help="with --ckpt: the page pool's size")
    r.set_defaults(fn=cmd_run)

    d = s.add_parser("demos", help="SFT cold-start conversations: scripted solutions played through real episodes")
    d.add_argument("--tasks", nargs="+", required=True, metavar="FAMILY[:N]",
                   help="task families and instances of each (default N: 10), e.g. arith:200 code:50")
    d.add_argument("--harness", action="append", metavar="PRESET|FILE",
                   help="a harness preset or JSON file (repeatable; every task is played with each; default: react)")
    d.add_argument("--out", required=True, metavar="FILE.jsonl", help="the conversations, one JSON record a line")
    d.add_argument("--split", choices=["train", "test"], default="train", help="which instances (default: train)")
    d.add_argument("--seed", type=int, default=0, help="instance seed")
    d.add_argument("--concurrency", type=int, default=4, help="episodes at once (default 4)")
    d.add_argument("--sandbox", choices=["bwrap", "none"], default="bwrap",
                   help="bwrap: isolated (default); none: run the commands UNISOLATED on this machine")
    d.add_argument("--no-stand-ins", dest="stand_ins", action="store_false",
                   help="fail a task whose harness lacks a tool of its solution, instead of another tool doing it")
    d.add_argument("--no-progress", dest="progress", action="store_false")
    d.set_defaults(fn=cmd_demos)


def cmd_list(args) -> int:
    from k3.env.presets import PRESETS
    from k3.env.task import families

    fams = {name: make() for name, make in families().items()}
    if args.json:
        print(json.dumps({"families": {n: f.description for n, f in fams.items()},
                          "harnesses": {n: c.to_dict() for n, c in PRESETS.items()}}, indent=1))
        return 0
    print("task families:")
    for n, f in fams.items():
        print(f"  {n:<12} {f.description}")
    print("harness presets:")
    for n, c in PRESETS.items():
        tools = ", ".join(t.exposed for t in c.tools)
        print(f"  {n:<12} tools: {tools}; context: {c.context.strategy}")
    return 0


def cmd_run(args) -> int:
    from k3.env.client import OpenAIChatPolicy
    from k3.env.run import format_table, parse_task_specs, plan_jobs, run_jobs

    if args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    specs = parse_task_specs(args.tasks)
    jobs = plan_jobs(specs, args.harness or ["react"], split=args.split, seed=args.seed)
    with _policy_server(args) as (base_url, model, api_key):
        policy = OpenAIChatPolicy(base_url, model, api_key=api_key)
        try:
            summary = run_jobs(jobs, policy, args.out, concurrency=args.concurrency, sandbox_kind=args.sandbox,
                               resume=args.resume, progress=args.progress)
        finally:
            policy.close()
    print(format_table(summary))
    print(f"k3 env run: {summary['total']['episodes']} episodes in {os.path.join(args.out, 'trajectories.jsonl')}")
    sys.stdout.flush()
    return 0


def cmd_demos(args) -> int:
    from k3.env.demos import format_counts, make_demos, plan_demo_jobs, write_demos
    from k3.env.run import parse_task_specs

    if args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    jobs = plan_demo_jobs(parse_task_specs(args.tasks), args.harness or ["react"], split=args.split, seed=args.seed)
    t0 = time.monotonic()
    report = make_demos(jobs, concurrency=args.concurrency, sandbox_kind=args.sandbox, stand_ins=args.stand_ins,
                        progress=args.progress)
    failures = report.failures
    if failures:
        first = failures[0]
        print(f"k3 env demos: warning: {len(failures)} of {len(jobs)} episodes kept no demonstration; the first, "
              f"{first.task_id} ({first.harness}): {first.reason}", file=sys.stderr)
    records = report.records
    if not records:
        print("k3 env demos: no episode succeeded: nothing written", file=sys.stderr)
        return 1
    write_demos(args.out, records)
    print(f"k3 env demos: kept {len(records)}/{len(jobs)} ({format_counts(report)}) in {args.out} "
          f"({time.monotonic() - t0:.1f} s)")
    sys.stdout.flush()
    return 0


@contextlib.contextmanager
def _policy_server(args):
    """(base URL, model name, API key) of the policy: the given endpoint, or the checkpoint served here."""
    if args.endpoint:
        api_key = args.api_key or os.environ.get("K3_API_KEY")
        yield args.endpoint, args.model or _first_model(args.endpoint, api_key), api_key
        return
    from k3.cli_args import _resolve_ckpt
    from k3.serve.app import create_app
    from k3.serve.build import build_engine
    from k3.serve.local import serve_in_thread

    ckpt = _resolve_ckpt(args.ckpt)  # a checkpoint, or a training run's latest
    engine, tokenizer, template = build_engine(ckpt, cache_memory_mb=args.cache_memory_mb, device=args.device)
    name = os.path.basename(os.path.normpath(ckpt)) or "k3"
    app = create_app(engine, tokenizer, name, chat_template=template)
    with serve_in_thread(app) as port:
        yield f"http://127.0.0.1:{port}/v1", name, None


def _first_model(endpoint: str, api_key: str | None) -> str:
    import httpx

    base = endpoint.rstrip("/")
    url = base + ("/models" if base.endswith("/v1") else "/v1/models")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url, headers=headers, timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise ValueError(f"could not read the model name from {url} ({type(e).__name__}: {e}); pass --model") \
            from None
