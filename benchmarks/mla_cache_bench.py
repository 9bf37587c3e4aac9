"""The contiguous MLA decode cache (k3.model.cache.MLACache): one-row appends into its backing tensors against the
form it replaced, a concatenation of the whole cache per append.

    python benchmarks/mla_cache_bench.py [--context 1024 8192 32768] [--batch 1] [--appends 64] [--device cpu]

For each `--context` length, a cache of `--batch` rows holding that many positions (k3's latent width 512 and rope
width 64, bf16) takes `--appends` one-position appends (a decode step of one MLA layer, or one drafting step of the
MTP layer's context). Side by side in one run: ``capacity`` (MLACache: each append writes its row into the room left
in the backing tensors; a new pair of tensors, a quarter larger than needed, when the room runs out) and ``concat``
(torch.cat of the held rows and the new one, per append). Reports the median microseconds per append (median of 5
repeats) and the ratio. One JSON line per context length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from k3.model.cache import MLACache

R, DR = 512, 64


class _Concat:
    def __init__(self, c, kr):
        self.c, self.kr = c, kr

    def append(self, c, kr):
        self.c = torch.cat([self.c, c], 1)
        self.kr = torch.cat([self.kr, kr], 1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(make, rows, device: torch.device, repeats: int = 5) -> float:
    """Median over `repeats` of the microseconds per append of `rows` to a fresh cache from `make`."""
    out = []
    for _ in range(repeats):
        cache = make()
        _sync(device)
        t0 = time.perf_counter()
        for c, kr in rows:
            cache.append(c, kr)
        _sync(device)
        out.append((time.perf_counter() - t0) * 1e6 / len(rows))
    return statistics.median(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 8192, 32768],
                    help="positions held before the appends, one run each")
    ap.add_argument("--batch", type=int, default=1, help="rows of the cache")
    ap.add_argument("--appends", type=int, default=64, help="one-position appends timed per repeat")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    args = ap.parse_args(argv)
    if min(args.context) < 1 or args.batch < 1 or args.appends < 1:
        ap.error("--context, --batch and --appends must be positive")
    device = torch.device(args.device)
    dt = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    for L in args.context:
        c0 = torch.randn(args.batch, L, R, generator=g).to(device, dt)
        k0 = torch.randn(args.batch, L, DR, generator=g).to(device, dt)
        rows = [(torch.randn(args.batch, 1, R, generator=g).to(device, dt),
                 torch.randn(args.batch, 1, DR, generator=g).to(device, dt)) for _ in range(args.appends)]

        def capacity():
            cache = MLACache()
            cache.append(c0, k0)
            return cache

        got = capacity()
        for c, kr in rows:
            got.append(c, kr)
        want = _Concat(c0, k0)
        for c, kr in rows:
            want.append(c, kr)
        if not (torch.equal(got.c, want.c) and torch.equal(got.k_rope, want.kr)):
            print(f"error: the two caches differ at context {L}", file=sys.stderr)
            return 1
        cap_us = _time(capacity, rows, device)
        cat_us = _time(lambda: _Concat(c0, k0), rows, device)
        print(json.dumps({"context": L, "batch": args.batch, "appends": args.appends, "device": str(device),
                          "capacity_us_per_append": round(cap_us, 2), "concat_us_per_append": round(cat_us, 2),
                          "speedup": round(cat_us / cap_us, 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
