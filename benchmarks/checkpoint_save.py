"""Writing a checkpoint shard: serialize-then-hash-then-write against k3.tensor_files.write_safetensors, side by side.

    python benchmarks/checkpoint_save.py --gb 2 --out /tmp/ckbench          # the disk under --out is what is measured

`bytes`: `safetensors.torch.save` builds the file in memory, `hashlib.sha256` hashes it, then it is written and
fsynced (how k3 wrote shards and trainer state before). `stream`: `write_safetensors` writes the header and every
tensor from its own memory, hashing each piece in a second thread while the file is written, and fsyncs. The same
tensors (fp32, --gb GB in 64 MB tensors) for both; arms alternate for --repeats rounds; medians reported, and the
two files' SHA-256 compared with the value each arm returned.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    from k3.cli_args import RawDefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=RawDefaultsHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--out", default="/tmp/ckbench")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from safetensors.torch import save as st_save

    from k3.files import write_synced
    from k3.tensor_files import write_safetensors

    os.makedirs(args.out, exist_ok=True)
    n = max(1, int(args.gb * (1 << 30) // (64 << 20)))
    tensors = {f"w{i:04d}": torch.randn(16, 1024, 1024) for i in range(n)}
    gb = n * (64 << 20) / 1e9

    def old(path):
        data = st_save(tensors, metadata={"format": "pt"})
        digest = hashlib.sha256(data).hexdigest()
        write_synced(path, data)
        return digest

    def new(path):
        return write_safetensors(path, tensors, metadata={"format": "pt"})

    times = {"bytes": [], "stream": []}
    for _ in range(args.repeats):
        for name, fn in (("bytes", old), ("stream", new)):
            path = os.path.join(args.out, f"{name}.safetensors")
            t = time.perf_counter()
            digest = fn(path)
            times[name].append(time.perf_counter() - t)
            with open(path, "rb") as f:
                assert hashlib.sha256(f.read()).hexdigest() == digest, name
            os.remove(path)
    rows = {k: dict(seconds=round(statistics.median(v), 3), gb_per_s=round(gb / statistics.median(v), 3))
            for k, v in times.items()}
    print(json.dumps(dict(gb=round(gb, 3), repeats=args.repeats, arms=rows,
                          speedup=round(rows["bytes"]["seconds"] / rows["stream"]["seconds"], 3)), indent=1))


if __name__ == "__main__":
    main()
