"""RMSNorm of bf16 activations with an fp32 weight (op ``rms_norm``): y = bf16(w * bf16(x / rms(x)))."""

import torch

from k3.kernel_reward.task import Task, Tolerance, generator, randn

SIGNATURE = ("kernel(x: bf16 [rows, dim], weight: fp32 [dim], eps: float) -> bf16 [rows, dim]: "
             "weight * x / sqrt(mean(x^2, -1) + eps), computed in fp32")
SCALE = {"normal": 1.0, "large": 1e4, "small": 1e-4}  # large: x^2 overflows fp16; small: eps dominates the mean


def make(shape, seed, magnitude, device):
    g = generator(seed, device)
    x = randn(g, shape["rows"], shape["dim"], device=device, dtype=torch.bfloat16, scale=SCALE[magnitude])
    weight = 1.0 + randn(g, shape["dim"], device=device, scale=0.1)
    return x, weight, 1e-6


def reference(x, weight, eps):
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def expert_cpu(x, weight, eps):
    from k3.ops.rms_norm import rms_norm_reference

    return rms_norm_reference(x, weight, eps)


TASK = Task(
    name="rms_norm", signature=SIGNATURE, make=make, reference=reference, out_dtypes=(torch.bfloat16,),
    tolerance=Tolerance(2**-6, 1e-6, "two bf16 roundings (x_hat and y), each under 2^-8 relative even when "
                        "truncated, plus fp32 sums"),
    bench={"rows": 16384, "dim": 7168}, bench_cpu={"rows": 64, "dim": 1024},
    held_out=({"rows": 1, "dim": 7}, {"rows": 33, "dim": 1000}, {"rows": 5, "dim": 4099}),
    flops=lambda s: 4.0 * s["rows"] * s["dim"],
    bytes=lambda s: 4.0 * s["rows"] * s["dim"] + 4.0 * s["dim"],
    experts={"cuda": "k3.ops.rms_norm:rms_norm_triton", "cpu": "k3.kernel_reward.tasks.rms_norm:expert_cpu"},
    variants={"naive": "k3.kernel_reward.tasks.rms_norm:expert_cpu"},
    forbidden=("k3.ops.rms_norm:rms_norm_triton", "k3.ops.rms_norm:rms_norm_reference", "k3.ops.rms_norm:rms_norm_any"),
)
