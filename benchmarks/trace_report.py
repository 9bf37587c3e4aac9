"""Where the GPU time of a profiled step goes, from its Chrome trace (torch.profiler's export).

    python benchmarks/trace_report.py TRACE.json[.gz] [--top 5] [--gap-us 20]

`train_throughput.py --profile --trace F.json.gz` writes such a trace for one training step. The report, from
the trace alone (no GPU needed):

* the GPU timeline: span from the first to the last kernel, time with a kernel running, idle share;
* kernel time by k3 profiler range (k3.train.*, k3.fwd.*, k3.head_loss, ...): each kernel is charged to the
  innermost range that was open on the host thread when it was launched (its launch and the kernel share a
  correlation id), with the range's top kernels;
* kernel time by kind (GEMM, attention, fla, k3's Triton kernels, elementwise, ...);
* idle gaps of the GPU longer than --gap-us, charged to the range that launched the kernel after the gap (a
  gap is host time the GPU waited through: a sync, or launches slower than the kernels), with the largest gaps.
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


def analyse(events: list[dict], top: int = 5, gap_us: float = 20.0) -> dict:
    """The report's numbers as a dict (see the module docstring)."""
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    launches = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e
    spans = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("k3."):
            spans[e.get("tid")].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"]))
    ranges = {tid: _Ranges(s) for tid, s in spans.items()}

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
    return {
        "kernels": len(iv), "span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_frac": 1 - busy / span,
        "ranges": {name: {"kernels": r["kernels"], "ms": r["us"] / 1e3,
                          "top": sorted(((n, us / 1e3) for n, us in r["top"].items()), key=lambda x: -x[1])[:top]}
                   for name, r in by_range.items()},
        "kinds": {kind: {"kernels": n, "ms": us / 1e3} for kind, (n, us) in by_kind.items()},
        "gaps_ms_by_range": {r: us / 1e3 for r, us in idle_by_range.items()},
        "largest_gaps": [{"us": round(g, 1), "at_ms": round((t - iv[0][0]) / 1e3, 3), "range": r, "next_kernel": n}
                         for g, t, r, n in sorted(gaps, key=lambda x: -x[0])[:top * 2]],
    }


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
