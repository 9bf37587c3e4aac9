"""The kernel reward of k3's own implementations, for every task: the expert (0.5 by construction, up to timing
noise), our own kernel where it is not the expert, and the naive reference; plus the harness's overhead per
candidate. Prints a table and writes JSON.

    python benchmarks/kernel_reward.py [--device cuda|cpu] [--tasks rms_norm,softmax] [--out kernel_reward.json]
    python benchmarks/kernel_reward.py --anchor 3 [--anchor-processes P] [--tasks ...]   # how steady the 0.5 is

`--anchor N`: for each task, N rounds of fresh processes: the expert timed with nothing run before (alone, one
process), the expert's anchor as the harness takes it (checked, then timed in the same process; the median of P
such processes, the harness's default unless `--anchor-processes P`), and the expert scored as a candidate against
that anchor (checked, then timed). Scored over anchor is the reward's 0.5 point: its spread is the
run-to-run noise of the anchor. Alone over anchor shows what the checks leave behind in a process.

Each implementation is scored like any candidate (its own process, every check and detector, timed on fresh
inputs), except that calling the task's expert or reference is allowed. Record results in BENCHMARKS.md with the
command, the date and the hardware.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from k3.kernel_reward import Limits, all_tasks, expert_time, score, source_of


def anchor(names, tasks, device, limits, rounds: int, out_path: str, processes: int | None = None) -> int:
    rows = []
    for name in names:
        task = tasks[name]
        for k in range(rounds):
            _, alone = expert_time(task, device, limits=limits, refresh=True, checked=False, processes=1)
            # again, in new processes
            impl, anchored = expert_time(task, device, limits=limits, refresh=True, processes=processes)
            r = score(task, source_of(impl), device, name=impl, limits=limits, expert=(impl, anchored), trusted=True)
            ratio = r.time_s / anchored if r.time_s else float("nan")
            rows.append({"task": name, "round": k, "alone_s": alone, "anchor_s": anchored, "scored_s": r.time_s,
                         "scored_over_anchor": ratio, "alone_over_anchor": alone / anchored, "reward": r.reward,
                         "reason": r.reason})
            print(f"{name:<20} round {k}: alone {alone * 1e3:9.4g} ms, anchor {anchored * 1e3:9.4g} ms, scored "
                  f"{(r.time_s or 0) * 1e3:9.4g} ms, scored/anchor {ratio:5.2f}, alone/anchor {alone / anchored:5.2f}, "
                  f"reward {r.reward if r.reward is not None else 0:.3f} {r.reason[:80]}", flush=True)
    with open(out_path, "w") as f:
        json.dump({"device": device, "anchor": rows}, f, indent=1)
    print(f"wrote {out_path}")
    return 0


def main(argv=None) -> int:
    from k3.cli_args import DefaultsHelpFormatter

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tasks", default="", help="comma-separated task names (default: all)")
    p.add_argument("--out", default="kernel_reward.json")
    p.add_argument("--time-limit", type=float, default=600.0)
    p.add_argument("--anchor", type=int, default=0, metavar="N", help="measure the expert anchor's steadiness instead")
    p.add_argument("--anchor-processes", type=int, default=None, metavar="P",
                   help="processes the anchor is the median of (default: the harness's, 3 on cuda and 1 on cpu)")
    args = p.parse_args(argv)
    tasks = all_tasks()
    names = [n for n in args.tasks.split(",") if n] or sorted(tasks)
    unknown = [n for n in names if n not in tasks]
    if unknown:
        p.error(f"unknown task(s) {', '.join(unknown)}; the tasks are {', '.join(sorted(tasks))}")
    limits = Limits(check_s=args.time_limit, time_s=args.time_limit)
    if args.anchor:
        return anchor(names, tasks, args.device, limits, args.anchor, args.out, args.anchor_processes)
    out = []

    def save():  # after every row: a run cut short keeps what it measured
        with open(args.out, "w") as f:
            json.dump({"device": args.device, "results": out}, f, indent=1)

    print(f"{'task':<20} {'role':<7} {'time ms':>10} {'expert ms':>10} {'roof ms':>10} {'roof %':>7} {'reward':>7} "
          f"{'overhead s':>10}  implementation / reason", flush=True)
    for name in names:
        task = tasks[name]
        try:
            expert = expert_time(task, args.device, limits=limits, processes=args.anchor_processes)
        except RuntimeError as e:  # the expert failed its checks or its process: no anchor, say so, keep going
            print(f"{name}: {e}", file=sys.stderr, flush=True)
            out.append({"task": name, "role": "expert", "error": str(e)})
            save()
            continue
        impls = {"expert": task.expert(args.device)}
        for label, impl in task.variants.items():
            if impl not in impls.values():
                impls[label] = impl
        for label, impl in impls.items():
            try:
                r = score(task, source_of(impl), args.device, name=impl, limits=limits, expert=expert, trusted=True)
            except Exception as e:  # an implementation that cannot run here (fla missing): say so, keep going
                print(f"{name} {label} {impl}: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            d = r.to_dict()
            d["role"] = label
            out.append(d)
            t = lambda x: f"{x * 1e3:10.4g}" if x is not None else f"{'-':>10}"
            frac = f"{r.roofline_fraction:7.1%}" if r.roofline_fraction is not None else f"{'-':>7}"
            print(f"{name:<20} {label:<7} {t(r.time_s)} {t(r.expert_time_s)} {t(r.roofline_time_s)} {frac} "
                  f"{r.reward if r.reward is not None else 0:7.3f} {r.overhead_s:10.1f}  {impl} {r.reason[:120]}",
                  flush=True)
            save()
    save()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
