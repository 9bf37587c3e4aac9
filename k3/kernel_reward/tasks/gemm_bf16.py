"""bf16 matrix product with fp32 accumulation (a familiar example): c = bf16(a @ b)."""

import torch

from k3.kernel_reward.task import Task, Tolerance, generator, randn

SIGNATURE = "kernel(a: bf16 [M, K], b: bf16 [K, N]) -> bf16 [M, N]: a @ b accumulated in fp32"
# large: products overflow fp16 (|c| ~ 1e5 K^0.5); small: products of 1e-8 vanish in fp16's subnormals
SCALE = {"normal": 1.0, "large": 300.0, "small": 1e-4}


def make(shape, seed, magnitude, device):
    g = generator(seed, device)
    s = SCALE[magnitude]
    a = randn(g, shape["M"], shape["K"], device=device, dtype=torch.bfloat16, scale=s)
    b = randn(g, shape["K"], shape["N"], device=device, dtype=torch.bfloat16, scale=s)
    return a, b


def reference(a, b):
    return a.double() @ b.double()


def expert(a, b):
    # cuBLAS may reduce split-K partial sums in bf16 unless told not to (torch's default allows it): the task asks
    # for fp32 accumulation, so the expert turns that off for its call and restores the setting
    m = torch.backends.cuda.matmul
    prev = m.allow_bf16_reduced_precision_reduction
    m.allow_bf16_reduced_precision_reduction = False
    try:
        return a @ b
    finally:
        m.allow_bf16_reduced_precision_reduction = prev


TASK = Task(
    name="gemm_bf16", signature=SIGNATURE, make=make, reference=reference, out_dtypes=(torch.bfloat16,),
    tolerance=Tolerance(2**-7, 1e-3, "one bf16 rounding of the output (2^-8, 2^-7 truncated); fp32 accumulation "
                        "errors stay far below 1e-3 of the largest entry for K up to 8K"),
    bench={"M": 8192, "N": 8192, "K": 8192}, bench_cpu={"M": 256, "N": 256, "K": 256},
    held_out=({"M": 1, "N": 1, "K": 1}, {"M": 33, "N": 17, "K": 65}, {"M": 7, "N": 130, "K": 300},
              {"M": 128, "N": 1, "K": 77}),
    flops=lambda s: 2.0 * s["M"] * s["N"] * s["K"],
    bytes=lambda s: 2.0 * (s["M"] * s["K"] + s["K"] * s["N"] + s["M"] * s["N"]),
    experts={"cpu": "k3.kernel_reward.tasks.gemm_bf16:expert"},
    forbidden=("k3.kernel_reward.tasks.gemm_bf16:expert",),
)
