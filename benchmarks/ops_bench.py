"""Per-op GPU timings of the fast backends against their reference and their roofline (k3-mini shapes).

    python benchmarks/ops_bench.py [--ops kda attn_res mla moe moe_combine] [--tokens 65536] [--flex-autotune]

Each line is one JSON record: the op, the backend, the median time of forward and forward+backward
(triton.testing.do_bench), and the roofline of that op: FLOPs over the measured bf16 matrix peak
(803 TFLOP/s) for the compute-bound ops (MLA, the MoE expert GEMMs), bytes over the measured copy bandwidth
(4.0 TB/s) for the memory-bound ones (AttnRes). KDA is compared with fla's standalone `chunk_kda` called
directly at the same shape (the in-model call adds the backend dispatch and argument preparation).
Inputs are random, never all-zero.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton.testing

PEAK_BF16 = 803e12
COPY_BW = 4.0e12


def _t(fn, grad: bool) -> float:
    if grad:
        return triton.testing.do_bench(fn, warmup=5, rep=30)
    with torch.no_grad():
        return triton.testing.do_bench(fn, warmup=5, rep=30)


def _emit(**rec) -> None:
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()}), flush=True)


def bench_kda(tokens: int, H: int = 8, K: int = 128, T: int = 8192) -> None:
    from fla.ops.kda import chunk_kda

    from k3.ops.kda_backend import kda
    from k3.ops.registry import Backends

    fla = Backends(per_op={"kda": "fla"})

    B = max(1, tokens // T)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v, z = (mk(B, T, H, K) for _ in range(4))
    beta = mk(B, T, H)
    A_log = torch.zeros(H, device="cuda")
    dt_bias = torch.randn(H * K, device="cuda")
    common = dict(A_log=A_log, dt_bias=dt_bias, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, safe_gate=True)
    fns = {
        "k3 (in-model call)": lambda: kda(q, k, v, z, beta, A_log, dt_bias, -5.0, backends=fla)[0],
        "fla chunk_kda (standalone)": lambda: chunk_kda(q, k, v, z, beta, **common)[0],
    }
    for name, f in fns.items():
        _emit(op="kda", shape=f"{B}x{T}x{H}x{K}", impl=name, fwd_ms=_t(f, False),
              fwd_bwd_ms=_t(lambda: f().float().sum().backward(), True))


def bench_attn_res(tokens: int, D: int = 1024, sources: int = 5) -> None:
    from k3.ops.attn_res import attn_res, attn_res_fla

    srcs = [torch.randn(tokens, D, device="cuda", dtype=torch.float32, requires_grad=True) for _ in range(sources)]
    w = torch.randn(D, device="cuda", requires_grad=True)
    dy = torch.randn(tokens, D, device="cuda")
    fwd_bytes = (sources + 1) * tokens * D * 4  # read every source, write the mix
    bwd_bytes = (2 * sources + 2) * tokens * D * 4  # read sources + dy, write every source's gradient (+ recompute)
    for name, fn in (("fla fused", attn_res_fla), ("torch reference", attn_res)):
        f = lambda fn=fn: fn(srcs, w, 1e-5)  # noqa: E731
        tf = _t(f, False)
        tfb = _t(lambda: torch.autograd.grad((f() * dy).sum(), [*srcs, w]), True)
        _emit(op="attn_res", shape=f"{sources}x{tokens}x{D} fp32", impl=name, fwd_ms=tf, fwd_bwd_ms=tfb,
              fwd_floor_ms=fwd_bytes / COPY_BW * 1e3, fwd_bw_frac=fwd_bytes / COPY_BW * 1e3 / tf,
              fwd_bwd_floor_ms=(fwd_bytes + bwd_bytes) / COPY_BW * 1e3)


def bench_mla(tokens: int, H: int = 8, T: int = 8192, flex_autotune: bool = False) -> None:
    from k3.ops.mla import causal_block_mask, mla_attention, mla_attention_flex

    B = max(1, tokens // T)
    mk = lambda d: torch.randn(B, T, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = mk(192), mk(192), mk(128)
    seg = torch.zeros(B, T, dtype=torch.long, device="cuda")
    seg[:, T // 2:] = 1  # two packed documents per row
    scale = 192 ** -0.5
    # FLOPs actually needed: causal within each of the two documents (half the causal square each).
    pairs = B * 2 * (T // 2) ** 2 / 2
    fwd_flops = 2 * pairs * H * (192 + 128)
    bm = causal_block_mask(T, q.device, seg)
    fns = {
        "flex (compiled, document mask)": lambda: mla_attention_flex(q, k, v, scale, seg, block_mask=bm),
        "flex + max logit": lambda: mla_attention_flex(q, k, v, scale, seg, block_mask=bm, return_max_logit=True)[0],
        "reference (SDPA, dense mask)": lambda: mla_attention(q, k, v, scale, segment_ids=seg),
    }
    if flex_autotune:  # inductor benchmarks block sizes per shape: minutes on a machine without its cache
        fns["flex + max logit, max-autotune (flex_autotune)"] = lambda: mla_attention_flex(
            q, k, v, scale, seg, block_mask=bm, return_max_logit=True, autotune=True)[0]
    for name, f in fns.items():
        tf = _t(f, False)
        tfb = _t(lambda f=f: f().float().sum().backward(), True)
        _emit(op="mla", shape=f"{B}x{T}x{H} 192/128, 2 docs/row", impl=name, fwd_ms=tf, fwd_bwd_ms=tfb,
              fwd_tflops=fwd_flops / tf / 1e9, fwd_frac_of_peak=fwd_flops / tf / 1e9 / (PEAK_BF16 / 1e12),
              fwd_bwd_tflops=3.5 * fwd_flops / tfb / 1e9)


def bench_moe(tokens: int, E: int = 128, k: int = 8, L: int = 512, F: int = 768) -> None:
    from k3.model.latent_moe import GroupedExperts
    from k3.ops.moe import moe_experts, moe_experts_grouped, route

    ex = GroupedExperts(E, L, F, 4.0, 25.0).cuda()
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.02)
    r = route(torch.randn(tokens, E, device="cuda"), None, k)
    z = torch.randn(tokens, L, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flops = 2 * tokens * k * L * (3 * F)  # gate+up (L -> 2F) and down (F -> L)
    fns = {
        "grouped GEMM + fused SiTU": lambda: moe_experts_grouped(z, r.weights, r.indices, ex.w1, ex.w3, ex.w2,
                                                                 ex.act_fused),
        "reference per-expert loop": lambda: moe_experts(z, r.weights, r.indices, ex.w1, ex.w3, ex.w2, ex.act),
    }
    # The GEMMs alone (what the >= 50% of matmul peak criterion is about), same grouping.
    order = torch.argsort(r.indices.reshape(-1), stable=True)
    offs = torch.cumsum(torch.bincount(r.indices.reshape(-1), minlength=E), 0).to(torch.int32)
    x = z.detach()[order // k]
    w1, w3, w2 = (w.detach().bfloat16() for w in (ex.w1, ex.w3, ex.w2))
    hid = torch.randn(x.shape[0], F, device="cuda", dtype=torch.bfloat16)
    gemms = lambda: (torch._grouped_mm(x, w1.transpose(1, 2), offs=offs),  # noqa: E731
                     torch._grouped_mm(x, w3.transpose(1, 2), offs=offs),
                     torch._grouped_mm(hid, w2.transpose(1, 2), offs=offs))
    tg = _t(gemms, False)
    _emit(op="moe", shape=f"{tokens} tok x top-{k} of {E}, L={L}, F={F}", impl="grouped GEMMs only (fwd)",
          fwd_ms=tg, tflops=flops / tg / 1e9, frac_of_peak=flops / tg / 1e9 / (PEAK_BF16 / 1e12))
    for name, f in fns.items():
        tf = _t(f, False)
        tfb = _t(lambda f=f: f().float().sum().backward(), True)
        _emit(op="moe", shape=f"{tokens} tok x top-{k} of {E}, L={L}, F={F}", impl=name, fwd_ms=tf, fwd_bwd_ms=tfb,
              fwd_tflops=flops / tf / 1e9, fwd_bwd_tflops=3 * flops / tfb / 1e9)


def bench_moe_combine(tokens: int, k: int = 8, L: int = 512) -> None:
    """The MoE combine (u[n] = sum_j w[n, j] y[pos[n, j]]): Triton kernel vs the PyTorch form, against the bytes
    the kernel must move (read y in bf16 and the weights, write u in bf16; backward: read y and du, write dy)."""
    from k3.ops.moe_combine import moe_combine_torch, moe_combine_triton

    y = torch.randn(tokens * k, L, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = torch.randperm(tokens * k, device="cuda")
    w = torch.rand(tokens, k, device="cuda", requires_grad=True)
    fwd_bytes = (tokens * k * L + tokens * L) * 2 + tokens * k * 12
    bwd_bytes = (2 * tokens * k * L + tokens * L) * 2 + tokens * k * 16
    for name, fn in (("triton kernel", moe_combine_triton), ("torch (gather, fp32 multiply, sum)", moe_combine_torch)):
        f = lambda fn=fn: fn(y, pos, w, torch.bfloat16)  # noqa: E731
        tf = _t(f, False)
        tfb = _t(lambda f=f: f().float().sum().backward(), True)
        _emit(op="moe_combine", shape=f"{tokens} tok x top-{k}, L={L}", impl=name, fwd_ms=tf, fwd_bwd_ms=tfb,
              fwd_floor_ms=fwd_bytes / COPY_BW * 1e3, fwd_bwd_floor_ms=(fwd_bytes + bwd_bytes) / COPY_BW * 1e3)


def main() -> None:
    from k3.cli_args import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    ops = ["kda", "attn_res", "mla", "moe", "moe_combine"]
    ap.add_argument("--ops", nargs="*", default=ops, choices=ops)
    ap.add_argument("--tokens", type=int, default=65536, help="tokens per call (B x T)")
    ap.add_argument("--flex-autotune", action="store_true",
                    help="also time the MLA flex kernels compiled with max-autotune (minutes of compiling)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ops_bench.py measures GPU kernels: no CUDA device here")
    benches = {"kda": bench_kda, "attn_res": bench_attn_res, "moe": bench_moe, "moe_combine": bench_moe_combine,
               "mla": functools.partial(bench_mla, flex_autotune=args.flex_autotune)}
    for op in args.ops:
        try:
            benches[op](args.tokens)
        except Exception as e:  # one op failing must not hide the others' numbers
            _emit(op=op, error=f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
