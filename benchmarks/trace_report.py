"""Where the GPU time of a profiled step goes, from its Chrome trace (torch.profiler's export).

    python benchmarks/trace_report.py TRACE.json[.gz] [--top 5] [--gap-us 20]

`train_throughput.py --profile --trace F.json.gz` writes such a trace for one training step. The report, from
the trace alone (no GPU needed):

* the GPU timeline: span from the first to the last kernel, time with a kernel running, idle share;
* kernel time by k3 profiler range (k3.train.*, k3.fwd.*, k3.head_loss, ...): each kernel (device memcpy and
  memset included) is charged to the innermost range that was open on the host thread when it was launched (its
  launch, a CUDA runtime or driver call, and the kernel share a correlation id), with the range's top kernels. The
  backward runs on autograd's own thread, where no k3 range is open: its kernels show as "(outside ...)";
* kernel time by kind (GEMM, attention, fla, k3's Triton kernels, elementwise, ...);
* idle gaps of the GPU longer than --gap-us, charged to the range that launched the kernel after the gap (a
  gap is host time the GPU waited through: a sync, or launches slower than the kernels), with the largest gaps;
* per training phase (the k3.train.* range a kernel's launch fell in): kernel time, GPU idle time before its
  kernels, and the median time from a kernel's launch to its start: near zero means the device waited for the
  host (host-bound), large means the host ran ahead;
* the host's waits for the device (cudaStreamSynchronize / cudaDeviceSynchronize / cudaEventSynchronize calls),
  each with the host operators around it: a wait in the middle of a phase keeps the host from queueing ahead.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict

# Kernel kinds by name (first match wins).
KERNEL_KINDS = [
    ("attention (flex / flash)", ("flex_attention", "flash", "fmha", "attention")),
    ("fla (KDA, conv, AttnRes, norm)", ("chunk_", "kda", "causal_conv1d", "attnres", "recurrent", "l2norm", "gla_",
                                        "wy_", "solve_tril", "merge_", "layer_norm_gated")),
    ("k3 Triton (SiTU, combine, Muon)", ("_situ", "_combine_kernel", "_momentum_kernel", "_decay_add_kernel",
                                         "_mla_decode")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas", "grouped_mm", "bmm", "matmul")),
    ("other Triton / inductor", ("triton_",)),
    ("reduction", ("reduce", "norm", "softmax", "sum", "cumsum", "scan", "sort", "topk")),
    ("copy / cast / index", ("copy", "cat", "index", "gather", "scatter", "fill", "memset", "memcpy")),
    ("elementwise", ("elementwise", "vectorized", "foreach")),
]


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


class _Ranges:
    """The k3.* ranges of one host thread, for "innermost range open at time t"."""

    def __init__(self, spans: list[tuple[float, float, str]]):
        self.spans = sorted(spans)
        self.starts = [s for s, _, _ in self.spans]

    def at(self, t: float) -> str:
        best = None
        for i in range(bisect.bisect_right(self.starts, t) - 1, -1, -1):
            s, e, name = self.spans[i]
            if s <= t < e and (best is None or s >= best[0]):
                best = (s, name)
                break  # spans sorted by start: the latest-starting one containing t is the innermost
        return best[1] if best else "(outside k3 ranges)"


def _ranges_of(events: list[dict], prefix: str) -> dict:
    """Host thread id -> its profiler ranges whose names start with `prefix`."""
    spans = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(prefix):
            spans[e.get("tid")].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"]))
    return {tid: _Ranges(s) for tid, s in spans.items()}


def analyse(events: list[dict], top: int = 5, gap_us: float = 20.0) -> dict:
    """The report's numbers as a dict (see the module docstring)."""
    # device memcpy / memset are GPU work too (e.g. baddbmm copying its input): without them they would look idle
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    launches = {}
    for e in events:
        # runtime launches (cudaLaunchKernel, ...) and driver ones (cuLaunchKernelEx: Triton's kernels, cuBLAS's nvjet)
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e
    ranges = _ranges_of(events, "k3.")

    def range_of(kernel) -> str:
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is None or launch.get("tid") not in ranges:
            return "(outside k3 ranges)"
        return ranges[launch["tid"]].at(float(launch["ts"]))

    if not kernels:
        return {"kernels": 0}
    iv = sorted((float(k["ts"]), float(k["ts"]) + float(k.get("dur", 0)), k) for k in kernels)
    span = max(b for _, b, _ in iv) - iv[0][0]
    busy = busy_time([(a, b) for a, b, _ in iv])
    by_range: dict[str, dict] = defaultdict(lambda: {"kernels": 0, "us": 0.0, "top": defaultdict(float)})
    by_kind: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for a, b, k in iv:
        r = by_range[range_of(k)]
        r["kernels"] += 1
        r["us"] += b - a
        r["top"][k["name"]] += b - a
        kk = by_kind[kernel_kind(k["name"])]
        kk[0] += 1
        kk[1] += b - a
    gaps, end = [], iv[0][1]
    for a, b, k in iv[1:]:
        if a - end > gap_us:
            gaps.append((a - end, end, range_of(k), k["name"]))
        end = max(end, b)
    idle_by_range: dict[str, float] = defaultdict(float)
    for g, _, r, _ in gaps:
        idle_by_range[r] += g
    phases = _phases(events, iv, launches, gap_us)
    return {
        "kernels": len(iv), "span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_frac": 1 - busy / span,
        "ranges": {name: {"kernels": r["kernels"], "ms": r["us"] / 1e3,
                          "top": sorted(((n, us / 1e3) for n, us in r["top"].items()), key=lambda x: -x[1])[:top]}
                   for name, r in by_range.items()},
        "kinds": {kind: {"kernels": n, "ms": us / 1e3} for kind, (n, us) in by_kind.items()},
        "gaps_ms_by_range": {r: us / 1e3 for r, us in idle_by_range.items()},
        "largest_gaps": [{"us": round(g, 1), "at_ms": round((t - iv[0][0]) / 1e3, 3), "range": r, "next_kernel": n}
                         for g, t, r, n in sorted(gaps, key=lambda x: -x[0])[:top * 2]],
        "phases": phases,
        "syncs": _syncs(events, iv[0][0]),
    }


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _phases(events: list[dict], iv: list, launches: dict, gap_us: float) -> dict:
    """Kernel time, idle time before its kernels and median launch-to-start lag per k3.train.* phase."""
    ranges = _ranges_of(events, "k3.train.")
    out: dict[str, dict] = defaultdict(lambda: {"kernels": 0, "us": 0.0, "idle_us": 0.0, "lags": []})
    end = None
    for a, b, k in iv:
        launch = launches.get(k.get("args", {}).get("correlation"))
        name = "(outside k3.train ranges)"
        if launch is not None and launch.get("tid") in ranges:
            name = ranges[launch["tid"]].at(float(launch["ts"]))
        ph = out[name.replace("(outside k3 ranges)", "(outside k3.train ranges)")]
        ph["kernels"] += 1
        ph["us"] += b - a
        if end is not None and a - end > gap_us:
            ph["idle_us"] += a - end
        if launch is not None:
            ph["lags"].append(a - float(launch["ts"]))
        end = b if end is None else max(end, b)
    res = {}
    for name, ph in out.items():
        lags = sorted(ph["lags"])
        res[name] = {"kernels": ph["kernels"], "ms": ph["us"] / 1e3, "idle_ms": ph["idle_us"] / 1e3,
                     "median_lag_ms": lags[len(lags) // 2] / 1e3 if lags else None}
    return res


def _syncs(events: list[dict], t0: float) -> list[dict]:
    """Every host wait for the device, with the names of the host operators enclosing it (outermost first)."""
    ops = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
            ops[e.get("tid")].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), str(e.get("name"))))
    for v in ops.values():
        v.sort()
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and e.get("name") in SYNC_CALLS:
            t = float(e["ts"])
            thread = ops.get(e.get("tid"), [])
            hi = bisect.bisect_right(thread, (t, float("inf"), ""))
            stack = [n for s, f, n in thread[:hi] if s <= t <= f]
            out.append({"at_ms": round((t - t0) / 1e3, 3), "wait_ms": round(float(e.get("dur", 0)) / 1e3, 3),
                        "call": e["name"], "stack": stack})
    return sorted(out, key=lambda x: x["at_ms"])


def print_report(rep: dict) -> None:
    if not rep.get("kernels"):
        print("no GPU kernels in the trace")
        return
    print(f"GPU timeline: {rep['span_ms']:.1f} ms span, {rep['busy_ms']:.1f} ms with a kernel running, "
          f"idle {100 * rep['idle_frac']:.1f}%, {rep['kernels']} kernels")
    print(f"\n{'range (innermost, at launch)':<40}{'kernels':>9}{'GPU ms':>10}   top kernels (ms)")
    for name, r in sorted(rep["ranges"].items(), key=lambda kv: -kv[1]["ms"]):
        tops = "; ".join(f"{n[:48]} {ms:.1f}" for n, ms in r["top"][:3])
        print(f"{name:<40}{r['kernels']:>9}{r['ms']:>10.1f}   {tops}")
    print(f"\n{'kernel kind':<34}{'kernels':>9}{'GPU ms':>10}")
    for kind, r in sorted(rep["kinds"].items(), key=lambda kv: -kv[1]["ms"]):
        print(f"{kind:<34}{r['kernels']:>9}{r['ms']:>10.1f}")
    print(f"\n{'GPU idle before kernels of range':<40}{'ms':>10}")
    for name, ms in sorted(rep["gaps_ms_by_range"].items(), key=lambda kv: -kv[1]):
        print(f"{name:<40}{ms:>10.1f}")
    print("\nlargest gaps:")
    for g in rep["largest_gaps"]:
        print(f"  {g['us']:>9.1f} us at {g['at_ms']:>8.3f} ms before {g['next_kernel'][:60]} ({g['range']})")
    print(f"\n{'training phase (range at launch)':<34}{'kernels':>9}{'GPU ms':>10}{'idle ms':>10}{'median lag ms':>15}")
    for name, ph in sorted(rep["phases"].items(), key=lambda kv: -kv[1]["ms"]):
        lag = "-" if ph["median_lag_ms"] is None else f"{ph['median_lag_ms']:.2f}"
        print(f"{name:<34}{ph['kernels']:>9}{ph['ms']:>10.1f}{ph['idle_ms']:>10.1f}{lag:>15}")
    print(f"\nhost waits for the device ({len(rep['syncs'])}):")
    for w in rep["syncs"]:
        print(f"  at {w['at_ms']:>8.3f} ms, {w['wait_ms']:>8.3f} ms {w['call']}: {' > '.join(n[:40] for n in w['stack'][-4:])}")


def main() -> None:
    from k3.cli_args import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("trace", help="Chrome trace from torch.profiler (.json or .json.gz)")
    ap.add_argument("--top", type=int, default=5, help="kernels listed per range")
    ap.add_argument("--gap-us", type=float, default=20.0, help="GPU idle gaps shorter than this are not counted")
    ap.add_argument("--json", action="store_true", help="print the numbers as one JSON object instead")
    args = ap.parse_args()
    try:
        events = load(args.trace)
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"trace_report: cannot read {args.trace}: {e}") from None
    rep = analyse(events, args.top, args.gap_us)
    if args.json:
        print(json.dumps(rep))
    else:
        print_report(rep)


if __name__ == "__main__":
    main()
