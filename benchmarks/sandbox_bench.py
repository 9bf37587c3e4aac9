"""Sandbox life-cycle latencies and density (report §5.3.2; AgentENV: 133 ms checkpoint, 49 ms resume).

Medians and p99 of: create (from a small image directory) and close, a tool call (`true`, `python3 -c pass`, and
the same interpreter started on the host without a sandbox, for scale), fork, snapshot and restore; and how many
idle sandboxes fit in 1 GB. An idle sandbox runs no process (a call's whole process tree ends with the call), so
what it holds is its files (allocated blocks of its workspace) plus the host-side Python object and its uid lock;
both are counted. Workspaces live in the temp dir: set TMPDIR to measure another filesystem (e.g. /dev/shm).

    python benchmarks/sandbox_bench.py --kind bwrap --repeats 50 --out sandbox_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc

import k3.env.sandbox as sandbox_module
from k3.env.sandbox import create_sandbox


def make_image(root: str, files: int, size: int) -> str:
    """A small repository-like image: `files` files of `size` bytes in a few directories."""
    for i in range(files):
        path = os.path.join(root, f"pkg{i % 4}", f"mod{i}.py")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(("x = 1\n" * (size // 6 + 1))[:size])
    return root


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def timed_pair(make, end, repeats: int) -> tuple[dict, dict]:
    """Time `make()` and then `end(made)`, one after the other: the steady state of sandboxes that come and go
    (removing a workspace costs the filesystem work that the next operation may wait behind)."""
    made_ms, end_ms = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = make()
        t1 = time.perf_counter()
        end(x)
        made_ms.append((t1 - t0) * 1e3)
        end_ms.append((time.perf_counter() - t1) * 1e3)
    return summary(made_ms), summary(end_ms)


def summary(ms: list[float]) -> dict:
    ms = sorted(ms)
    return {"median_ms": statistics.median(ms), "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))], "n": len(ms)}


def disk_bytes(path: str) -> int:
    total = os.lstat(path).st_blocks * 512
    for d, dirs, files in os.walk(path):
        total += sum(os.lstat(os.path.join(d, n)).st_blocks * 512 for n in dirs + files)
    return total


def main() -> None:
    from k3.cli_args import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--kind", default="bwrap", choices=["bwrap", "none"])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--files", type=int, default=20, help="files in the image")
    ap.add_argument("--file-bytes", type=int, default=2048)
    ap.add_argument("--idle", type=int, default=100, help="idle sandboxes created to measure what one holds")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as image_dir:
        image = make_image(image_dir, args.files, args.file_bytes)
        results = {}
        results["create"], results["close"] = timed_pair(lambda: create_sandbox(args.kind, image),
                                                         lambda s: s.close(), args.repeats)
        with create_sandbox(args.kind, image) as sb:
            sb.exec("true")
            results["call: true"] = summary(timed(lambda: sb.exec("true"), args.repeats))
            results["call: python3 -c pass"] = summary(timed(lambda: sb.exec(["python3", "-c", "pass"]), args.repeats))
            host = [sys.executable, "-c", "pass"]
            results["host, unsandboxed: python -c pass"] = summary(timed(lambda: subprocess.run(host), args.repeats))
            results["fork"], _ = timed_pair(sb.fork, lambda f: f.close(), args.repeats)
            copy_mode = sandbox_module.last_copy_mode   # "reflink" (copy-on-write) or "copy"
            snaps = []
            results["snapshot"] = summary(timed(lambda: snaps.append(sb.snapshot()), args.repeats))
            results["restore"] = summary(timed(lambda: sb.restore(snaps[0]), args.repeats))

        tracemalloc.start()
        idle = [create_sandbox(args.kind, image) for _ in range(args.idle)]
        py_bytes = tracemalloc.get_traced_memory()[0] / args.idle
        tracemalloc.stop()
        disk = statistics.mean(disk_bytes(os.path.dirname(s.workspace)) for s in idle)
        for s in idle:
            s.close()
        per = disk + py_bytes
        results["idle sandbox"] = {"disk_bytes": disk, "host_memory_bytes": py_bytes, "processes": 0,
                                   "per_GB": int((1 << 30) // per)}

    print(f"sandbox kind {args.kind}, image {args.files} files x {args.file_bytes} B, {args.repeats} repeats; "
          f"fork/snapshot/restore copy files by {copy_mode}")
    print(f"{'operation':<36}{'median ms':>11}{'p99 ms':>10}")
    for name, r in results.items():
        if "median_ms" in r:
            print(f"{name:<36}{r['median_ms']:>11.2f}{r['p99_ms']:>10.2f}")
    r = results["idle sandbox"]
    print(f"idle sandbox: {r['disk_bytes'] / 1024:.1f} KiB on disk + {r['host_memory_bytes'] / 1024:.1f} KiB host "
          f"memory, no process -> {r['per_GB']} per GB")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"kind": args.kind, "files": args.files, "file_bytes": args.file_bytes,
                       "repeats": args.repeats, "copy_mode": copy_mode,
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
