"""Block Attention Residuals, one site (op ``attn_res``, report §2.2): softmax over depth of RMSNorm(v_i) . w, mixing
the raw sources."""

import torch

from k3.kernel_reward.task import Task, Tolerance, generator, randn

SIGNATURE = ("kernel(sources: bf16 [N, T, D], w: fp32 [D]) -> bf16 [T, D]: sum_i softmax_i(rmsnorm(v_i) . w) v_i "
             "(rmsnorm without affine, eps 1e-5; fp32 inside)")
SCALE = {"normal": 1.0, "large": 1e3, "small": 1e-3}  # small: eps 1e-5 against mean(v^2) ~ 1e-6


def make(shape, seed, magnitude, device):
    g = generator(seed, device)
    N, T, D = shape["N"], shape["T"], shape["D"]
    sources = randn(g, N, T, D, device=device, dtype=torch.bfloat16, scale=SCALE[magnitude])
    w = randn(g, D, device=device, scale=3.0 / D**0.5)
    return sources, w


def reference(sources, w):
    v = sources.double()
    scores = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()).sum(-1)
    return (torch.softmax(scores, dim=0)[..., None] * v).sum(0)


MIN_FLA_D = 16  # fla's fused_attnres does not compile a 1-wide row block (D = 1: Triton's PassManager fails)


def expert(sources, w):
    """fla-core's fused kernel (timed on the benchmark shape); rows narrower than MIN_FLA_D, which that kernel does not
    compile (the held-out D = 1), go to k3's torch implementation, so that the expert is correct on every case. (Two
    held-out shapes slice the stacked sources at addresses fla cannot read from; attn_res_fla copies those.)"""
    from k3.ops.attn_res import attn_res, attn_res_fla

    parts = list(sources.unbind(0))
    return attn_res(parts, w) if sources.shape[-1] < MIN_FLA_D else attn_res_fla(parts, w)


TASK = Task(
    name="attn_res", signature=SIGNATURE, make=make, reference=reference, out_dtypes=(torch.bfloat16,),
    tolerance=Tolerance(2**-7, 1e-4, "one bf16 rounding of the output (a convex combination of the sources); fp32 "
                        "scores move the weights by ~1e-6"),
    bench={"N": 10, "T": 16384, "D": 4096}, bench_cpu={"N": 4, "T": 128, "D": 256},
    held_out=({"N": 1, "T": 1, "D": 1}, {"N": 3, "T": 5, "D": 100}, {"N": 9, "T": 17, "D": 513}),
    flops=lambda s: 5.0 * s["N"] * s["T"] * s["D"],
    bytes=lambda s: 2.0 * s["N"] * s["T"] * s["D"] + 2.0 * s["T"] * s["D"] + 4.0 * s["D"],
    experts={"cuda": "k3.kernel_reward.tasks.attn_res:expert", "cpu": "k3.ops.attn_res:attn_res"},
    variants={"ours": "k3.ops.attn_res:attn_res"},
    forbidden=("k3.ops.attn_res:attn_res", "k3.ops.attn_res:attn_res_fla", "k3.ops.attn_res:attn_res_any",
               "k3.kernel_reward.tasks.attn_res:expert"),
)
