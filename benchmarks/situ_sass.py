"""Static instruction count of the fused SiTU-GLU kernels, compiled offline for a CUDA architecture.

The kernel is issue-bound rather than memory-bound when it spends too many instructions per element (see the
"Speed" paragraph of k3/ops/situ_triton.py): an H200 issues about 33 T lane-instructions/s (132 SMs x 128 lanes
x ~1.98 GHz), so at 134M elements (262144 x 512) each instruction per element costs ~4 us against a ~190 us copy
floor for the forward. This script compiles the same kernel Triton's JIT would build on the device (bf16
operands, pointers, strides and sizes specialized as divisible by 16, as at runtime for the model's shapes) with
Triton's bundled ptxas, disassembles it with cuobjdump and prints SASS instructions per element and the most
frequent opcodes. No GPU is needed; it is a static count (no timing), to compare kernel versions.

    python benchmarks/situ_sass.py [--arch 90] [--block-f 512] [--tile 4096] [--warps 8]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile


def tool(name: str) -> str:
    """Triton's bundled CUDA binary `name` (cuobjdump), else one on PATH."""
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    found = bundled if os.path.exists(bundled) else shutil.which(name)
    if not found:
        sys.exit(f"error: {name} not found (neither bundled with Triton at {bundled} nor on PATH)")
    return found


def compile_kernel(backward: bool, block_f: int, tile: int, warps: int, arch: int, approx_rcp: bool):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from k3.ops import situ_triton

    kernel = situ_triton._kernel(False, False)  # compiled (not interpreted), untuned
    ptr = "*bf16"
    sig = {"g_ptr": ptr, "u_ptr": ptr, "y_ptr": ptr, "dy_ptr": ptr, "dg_ptr": ptr, "du_ptr": ptr,
           **{n: "i32" for n in ("n_rows", "n_cols", "stride_g", "stride_u", "stride_y", "stride_dy", "stride_dg",
                                 "stride_du")},
           **{n: "fp32" for n in ("beta1", "beta2", "inv_beta1", "inv_beta2")}, "rows_log2": "i32"}
    consts = {"BACKWARD": backward, "TILE": tile, "BLOCK_N": tile // block_f, "BLOCK_F": block_f,
              "APPROX_RCP": approx_rcp}
    unused = ("y_ptr",) if backward else ("dy_ptr", "dg_ptr", "du_ptr")
    consts.update({n: None for n in unused})
    for n in list(consts):
        sig[n] = "constexpr"
    names = list(sig)
    if names != list(kernel.arg_names):
        sys.exit(f"error: the kernel's arguments changed ({kernel.arg_names}); update this script")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n] in (ptr, "i32")}
    src = ASTSource(kernel, sig, constexprs={(names.index(n),): v for n, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})


def sass_counts(cubin: bytes) -> collections.Counter:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def main() -> None:
    from k3.cli_args import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: H100/H200)")
    ap.add_argument("--block-f", type=int, default=512, help="columns per program (power of two, <= 1024)")
    ap.add_argument("--tile", type=int, default=4096, help="elements per program")
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--exact-division", action="store_true",
                    help="the IEEE division the interpreter uses instead of PTX's approximate reciprocal")
    args = ap.parse_args()
    for name, v in (("--block-f", args.block_f), ("--tile", args.tile), ("--warps", args.warps)):
        if v <= 0 or v & (v - 1):
            sys.exit(f"error: {name} must be a positive power of two, got {v}")
    if args.block_f > 1024 or args.tile < args.block_f:
        sys.exit("error: need --block-f <= 1024 and --tile >= --block-f")
    per_thread = args.tile // (32 * args.warps)
    if per_thread < 1:
        sys.exit("error: --tile must be at least 32 x --warps elements")
    for backward in (False, True):
        c = compile_kernel(backward, args.block_f, args.tile, args.warps, args.arch, not args.exact_division)
        ops = sass_counts(c.asm["cubin"])
        total = sum(ops.values())
        print(json.dumps({"pass": "bwd" if backward else "fwd", "arch": f"sm_{args.arch}", "tile": args.tile,
                          "warps": args.warps, "approx_rcp": not args.exact_division, "sass_instructions": total,
                          "per_element": round(total / per_thread, 2),
                          "top": {k: round(v / per_thread, 2) for k, v in ops.most_common(8)}}), flush=True)


if __name__ == "__main__":
    main()
