"""The latent MoE's combine (op ``moe_combine``): u[n] = sum_j weights[n, j] y[pos[n*k + j]], in fp32, stored bf16."""

import torch

from k3.kernel_reward.task import Task, Tolerance, generator, randn

SIGNATURE = ("kernel(y: bf16 [N*k, L], pos: int64 [N*k], weights: fp32 [N, k]) -> bf16 [N, L]: "
             "u[n] = sum_j weights[n, j] * y[pos[n*k + j]] in fp32 (y in expert order, pos a permutation)")
SCALE = {"normal": 1.0, "large": 1e4, "small": 1e-4}


def make(shape, seed, magnitude, device):
    g = generator(seed, device)
    N, k, L = shape["N"], shape["k"], shape["L"]
    y = randn(g, N * k, L, device=device, dtype=torch.bfloat16, scale=SCALE[magnitude])
    pos = torch.randperm(N * k, generator=g, device=device)
    weights = torch.softmax(randn(g, N, k, device=device), dim=-1)
    return y, pos, weights


def reference(y, pos, weights):
    N, k = weights.shape
    return (y[pos].view(N, k, -1).double() * weights.double()[:, :, None]).sum(1)


def expert(y, pos, weights):
    from k3.ops.moe_combine import moe_combine_triton

    return moe_combine_triton(y, pos, weights, torch.bfloat16)


def ours_torch(y, pos, weights):
    from k3.ops.moe_combine import moe_combine_torch

    return moe_combine_torch(y, pos, weights, torch.bfloat16)


TASK = Task(
    name="moe_combine", signature=SIGNATURE, make=make, reference=reference, out_dtypes=(torch.bfloat16,),
    tolerance=Tolerance(2**-7, 1e-5, "one bf16 rounding of the output (2^-7 when truncated); the fp32 k-term sums "
                        "differ only in order"),
    bench={"N": 32768, "k": 8, "L": 1024}, bench_cpu={"N": 256, "k": 4, "L": 256},
    held_out=({"N": 1, "k": 1, "L": 1}, {"N": 5, "k": 3, "L": 100}, {"N": 17, "k": 8, "L": 513}),
    flops=lambda s: 2.0 * s["N"] * s["k"] * s["L"],
    bytes=lambda s: 2.0 * s["N"] * s["k"] * s["L"] + 12.0 * s["N"] * s["k"] + 2.0 * s["N"] * s["L"],
    experts={"cuda": "k3.kernel_reward.tasks.moe_combine:expert", "cpu": "k3.kernel_reward.tasks.moe_combine:ours_torch"},
    variants={"naive": "k3.kernel_reward.tasks.moe_combine:ours_torch"},
    forbidden=("k3.ops.moe_combine:moe_combine_triton", "k3.ops.moe_combine:moe_combine_torch",
               "k3.ops.moe_combine:moe_combine", "k3.kernel_reward.tasks.moe_combine:expert",
               "k3.kernel_reward.tasks.moe_combine:ours_torch"),
)
