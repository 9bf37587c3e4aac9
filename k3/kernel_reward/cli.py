"""``k3 kernel-reward``: list the tasks, score candidates (one, or a batch: checks in parallel, timing serialized)."""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["add_parser"]


def add_parser(sub) -> None:
    p = sub.add_parser("kernel-reward", help="score candidate kernels for correctness and speed (report §4.2.4)")
    s = p.add_subparsers(dest="kr_command", required=True)
    ls = s.add_parser("list", help="the tasks, their signatures and tolerances")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(fn=cmd_list)
    sc = s.add_parser("score", help="score CANDIDATE.py files (each defines `kernel`) on TASK")
    sc.add_argument("task")
    sc.add_argument("candidates", nargs="+", metavar="CANDIDATE.py")
    sc.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    sc.add_argument("--json", action="store_true", help="print the results as JSON")
    sc.add_argument("--jobs", type=int, default=4, help="candidates checked at once in a batch (timing is serial)")
    sc.add_argument("--no-timing", action="store_true", help="checks and detectors only (reward null)")
    sc.add_argument("--time-limit", type=float, default=300.0, help="seconds per phase per candidate")
    sc.add_argument("--memory-gib", type=float, default=8.0, help="address-space cap of a CPU candidate's process")
    sc.add_argument("--anchor-processes", type=int, default=None, metavar="N",
                    help="fresh processes the expert's anchor time is the median of (default: 3 on cuda, 1 on cpu)")
    sc.add_argument("--forkserver", action="store_true",
                    help="fork candidates from one fresh interpreter that has imported torch (faster batches)")
    sc.set_defaults(fn=cmd_score)


def cmd_list(args) -> int:
    from k3.kernel_reward.tasks import all_tasks

    tasks = all_tasks()
    if args.json:
        print(json.dumps([{"name": t.name, "signature": t.signature, "tolerance": t.tolerance.why,
                           "bench": dict(t.bench), "bench_cpu": dict(t.bench_cpu), "experts": dict(t.experts)}
                          for t in tasks.values()], indent=1))
        return 0
    for t in tasks.values():
        print(f"{t.name}\n  {t.signature}\n  tolerance: rtol {t.tolerance.rtol:g}, atol {t.tolerance.atol:g} x max|ref| "
              f"({t.tolerance.why})\n  expert: {t.expert('cuda')} (cuda), {t.expert('cpu')} (cpu)")
    return 0


def cmd_score(args) -> int:
    from k3.kernel_reward.runner import Limits
    from k3.kernel_reward.scoring import score, score_many
    from k3.kernel_reward.tasks import get

    try:
        task = get(args.task)
    except KeyError as e:
        raise ValueError(e.args[0]) from None
    sources = []
    for path in args.candidates:
        if not os.path.isfile(path):
            raise ValueError(f"candidate {path!r} is not a file")
        with open(path) as f:
            sources.append((path, f.read()))
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    if args.anchor_processes is not None and args.anchor_processes < 1:
        raise ValueError(f"--anchor-processes must be >= 1, got {args.anchor_processes}")
    limits = Limits(check_s=args.time_limit, time_s=args.time_limit, memory_bytes=int(args.memory_gib * 2**30),
                    start="forkserver" if args.forkserver else "subprocess")
    timed = not args.no_timing
    if len(sources) == 1:
        results = [score(task, sources[0][1], args.device, name=sources[0][0], timed=timed, limits=limits,
                         anchor_processes=args.anchor_processes)]
    else:
        results = score_many(task, sources, args.device, jobs=args.jobs, timed=timed, limits=limits,
                             anchor_processes=args.anchor_processes)
    if args.json:
        out = [r.to_dict() for r in results]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=1))
    else:
        for r in results:
            print(r.summary())
    sys.stdout.flush()
    return 0
