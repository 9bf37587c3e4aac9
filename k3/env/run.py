"""`k3 env run`: many episodes against one policy, concurrently, with trajectories and a summary table.

    specs = parse_task_specs(["arith:20", "code:10"])
    jobs = plan_jobs(specs, ["react", "coder"], split="test", seed=0)
    summary = run_jobs(jobs, policy, out_dir, concurrency=4, sandbox_kind="bwrap")

Every (task, harness) pair is one episode. Each finished episode is appended to `OUT/trajectories.jsonl` at once
(one flushed line), so an interrupted run keeps what it finished, and `resume=True` runs only the pairs that have
no record yet. `OUT/summary.json` and `OUT/summary.md` are rewritten atomically from all records at the end: per
task family and harness, the episodes, success rate, mean reward, mean turns, mean completion tokens, tool errors,
harness errors (episodes that ended with reason "error": the policy or the sandbox failed) and mean wall time.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

from k3.env.client import Policy
from k3.env.episode import Episode
from k3.env.presets import load_harness
from k3.env.sandbox import Limits
from k3.env.task import Task, check_split, get_family
from k3.env.trajectory import Trajectory, append_jsonl, read_jsonl
from k3.files import atomic_write_text

TRAJECTORIES = "trajectories.jsonl"
SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"
DEFAULT_EPISODES = 10


@dataclass(frozen=True)
class Job:
    task: Task
    harness: str          # a preset name or a harness JSON file, as given

    @property
    def key(self) -> tuple[str, str]:
        return self.task.id, self.harness_name

    @property
    def harness_name(self) -> str:
        return load_harness(self.harness).name


def parse_task_specs(specs: list[str]) -> list[tuple[str, int]]:
    """["arith:20", "code"] -> [("arith", 20), ("code", DEFAULT_EPISODES)]; names are checked against the
    registered families."""
    out = []
    for spec in specs:
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            name, _, n = part.partition(":")
            get_family(name)   # raises ValueError naming the known families
            if n:
                if not n.isdigit() or int(n) < 1:
                    raise ValueError(f"--tasks {part!r}: N must be a positive integer (FAMILY[:N], the count after "
                                     "':')")
                count = int(n)
            else:
                count = DEFAULT_EPISODES
            out.append((name, count))
    if not out:
        raise ValueError("--tasks names no task family")
    return out


def task_instances(specs: list[str], split: str, seed: int = 0) -> list[Task]:
    """The tasks `specs` name (FAMILY[:N], see parse_task_specs), instances of `split`, in spec order."""
    return [t for name, n in parse_task_specs(specs) for t in get_family(name).instances(split, n, seed)]


def plan_jobs(specs: list[tuple[str, int]], harnesses: list[str], split: str = "test", seed: int = 0) -> list[Job]:
    """Every instance of every family spec, once per harness (the same instances for each harness)."""
    check_split(split)
    if not harnesses:
        raise ValueError("at least one harness is needed")
    for h in harnesses:
        load_harness(h)   # fail before any episode runs
    names = [load_harness(h).name for h in harnesses]
    if len(set(names)) != len(names):
        raise ValueError(f"two harnesses share a name ({names}): their trajectories could not be told apart")
    jobs = []
    for family, n in specs:
        tasks = list(get_family(family).instances(split, n, seed))
        for h in harnesses:
            jobs.extend(Job(t, h) for t in tasks)
    return jobs


def done_keys(path: str) -> set[tuple[str, str]]:
    if not os.path.exists(path):
        return set()
    return {(t.task_id, t.harness) for t in read_jsonl(path)}


def run_jobs(jobs: list[Job], policy: Policy, out_dir: str, *, concurrency: int = 4, sandbox_kind: str = "bwrap",
             limits: Limits | None = None, resume: bool = False, progress: bool = True,
             kernel_device: str = "cpu") -> dict:
    """Run the jobs `concurrency` at a time; returns the summary (also written to OUT/summary.json and .md)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, TRAJECTORIES)
    if os.path.exists(path) and os.path.getsize(path) > 0 and not resume:
        raise ValueError(f"{path} already holds trajectories: pass --resume to run only the episodes it lacks, "
                         f"or choose another --out")
    done = done_keys(path) if resume else set()
    todo = [j for j in jobs if j.key not in done]
    wins = 0

    def one(job: Job) -> Trajectory:
        return Episode(job.task, job.harness, policy, sandbox_kind=sandbox_kind, limits=limits,
                       kernel_device=kernel_device).run()

    def record(i: int, job: Job, traj: Trajectory) -> str:  # Episode.run never raises for the policy or sandbox
        nonlocal wins
        append_jsonl(path, traj)
        wins += traj.success
        return f"success={wins}/{i + 1}"

    run_pooled(todo, one, record, concurrency=concurrency, desc="k3 env run", total=len(jobs),
               initial=len(jobs) - len(todo), progress=progress)
    summary = summarize(read_jsonl(path))
    write_summary(out_dir, summary)
    return summary


def run_pooled(items: list, fn, on_done, *, concurrency: int, desc: str, total: int | None = None, initial: int = 0,
               progress: bool = True) -> None:
    """`fn(item)` for every item, `concurrency` at a time in threads; `on_done(k, item, result)` for the k-th result
    to finish (k counts from 0), under a lock, in completion order; it returns the progress bar's postfix text. A
    tqdm bar on stderr counts episodes (`total`, starting at `initial`). Ctrl-C cancels what has not started."""
    lock = threading.Lock()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(items) if total is None else total, initial=initial, unit="episode", desc=desc,
                   file=sys.stderr, dynamic_ncols=True)
    finished = 0
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = {pool.submit(fn, x): x for x in items}
        try:
            for fut in as_completed(futures):
                out = fut.result()
                with lock:
                    note = on_done(finished, futures[fut], out)
                    finished += 1
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix_str(note)
        except KeyboardInterrupt:
            for f in futures:
                f.cancel()
            raise
        finally:
            if bar is not None:
                bar.close()


def summarize(trajectories: list[Trajectory]) -> dict:
    """Per (family, harness) and overall: counts and means over the episodes."""
    groups: dict[tuple[str, str], list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault((t.family, t.harness), []).append(t)
    rows = [_row(f, h, ts) for (f, h), ts in sorted(groups.items())]
    return {"rows": rows, "total": _row("all", "all", trajectories), "written_at": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _row(family: str, harness: str, ts: list[Trajectory]) -> dict:
    n = len(ts)

    def mean(values):
        values = list(values)
        return sum(values) / len(values) if values else 0.0

    return {"family": family, "harness": harness, "episodes": n,
            "success_rate": mean(t.success for t in ts),
            "mean_reward": mean(t.reward for t in ts),
            "mean_turns": mean(t.counts["turns"] for t in ts),
            "mean_completion_tokens": mean(t.counts["completion_tokens"] for t in ts),
            "tool_calls": sum(t.counts["tool_calls"] for t in ts),
            "tool_errors": sum(t.counts["tool_errors"] for t in ts),
            "harness_errors": sum(t.end_reason == "error" for t in ts),
            "mean_wall_s": mean(t.wall_s for t in ts),
            "end_reasons": dict(sorted(Counter(t.end_reason for t in ts).items()))}


COLUMNS = (("family", "family", "{}"), ("harness", "harness", "{}"), ("episodes", "episodes", "{}"),
           ("success", "success_rate", "{:.1%}"), ("reward", "mean_reward", "{:.3f}"),
           ("turns", "mean_turns", "{:.1f}"), ("tokens", "mean_completion_tokens", "{:.0f}"),
           ("tool errors", "tool_errors", "{}"), ("harness errors", "harness_errors", "{}"),
           ("time (s)", "mean_wall_s", "{:.1f}"))


def format_table(summary: dict) -> str:
    """The summary as a Markdown table, one row per family and harness and a total row."""
    head = "| " + " | ".join(c[0] for c in COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in COLUMNS) + "|"
    lines = [head, sep]
    for r in summary["rows"] + [summary["total"]]:
        lines.append("| " + " | ".join(fmt.format(r[k]) for _, k, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def write_summary(out_dir: str, summary: dict) -> None:
    atomic_write_text(os.path.join(out_dir, SUMMARY_JSON), json.dumps(summary, indent=1) + "\n")
    atomic_write_text(os.path.join(out_dir, SUMMARY_MD), format_table(summary) + "\n")
