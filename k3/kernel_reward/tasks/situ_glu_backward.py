"""SiTU-GLU backward (op ``situ``): the gradients of gate and up for an output gradient dy, fp32 inside, bf16 out."""

import torch

from k3.kernel_reward.task import Task, Tolerance, generator, randn
from k3.kernel_reward.tasks.situ_glu import SCALE

SIGNATURE = ("kernel(gate: bf16 [n, F], up: bf16 [n, F], dy: bf16 [n, F]) -> (dgate, dup): bf16 [n, F] each, the "
             "gradients of sum(dy * situ_glu(gate, up)) (beta1 = 4, beta2 = 25), computed in fp32")


def make(shape, seed, magnitude, device):
    g = generator(seed, device)
    s = SCALE[magnitude]
    gate, up = (randn(g, shape["n"], shape["F"], device=device, dtype=torch.bfloat16, scale=s) for _ in range(2))
    return gate, up, randn(g, shape["n"], shape["F"], device=device, dtype=torch.bfloat16)


def _grads(fn, gate, up, dy):
    gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
    with torch.enable_grad():
        y = fn(gate, up)
        dg, du = torch.autograd.grad(y, (gate, up), dy.to(y.dtype))
    return dg, du


def reference(gate, up, dy):
    from k3.ops.situ import situ_glu

    return _grads(situ_glu, gate.double(), up.double(), dy.double())


def expert(gate, up, dy):
    from k3.ops.situ_triton import situ_glu_split

    return _grads(situ_glu_split, gate, up, dy)


def ours_torch(gate, up, dy):
    from k3.ops.situ import situ_glu

    return _grads(situ_glu, gate, up, dy)


TASK = Task(
    name="situ_glu_backward", signature=SIGNATURE, make=make, reference=reference,
    out_dtypes=(torch.bfloat16, torch.bfloat16),
    tolerance=Tolerance(2**-7, 1e-3, "one bf16 rounding of each gradient; the gate's derivative is a sum of two terms "
                        "of opposite sign for gate < 0, so its fp32 cancellation is bounded against the largest entry"),
    bench={"n": 16384, "F": 3584}, bench_cpu={"n": 256, "F": 512},
    # the first held-out shape is also the "large" case's: not the single element, whose saturated gradients
    # underflow to ~1e-23 and leave no scale for the tolerance (any fp32 computation then fails it)
    held_out=({"n": 7, "F": 100}, {"n": 1, "F": 1}, {"n": 33, "F": 1027}),
    flops=lambda s: 40.0 * s["n"] * s["F"],
    bytes=lambda s: 10.0 * s["n"] * s["F"],
    experts={"cuda": "k3.kernel_reward.tasks.situ_glu_backward:expert",
             "cpu": "k3.kernel_reward.tasks.situ_glu_backward:ours_torch"},
    variants={"naive": "k3.kernel_reward.tasks.situ_glu_backward:ours_torch"},
    forbidden=("k3.ops.situ_triton:situ_glu_split", "k3.ops.situ_triton:situ_glu_fused", "k3.ops.situ:situ_glu",
               "k3.ops.situ:situ_glu_any", "k3.kernel_reward.tasks.situ_glu_backward:expert",
               "k3.kernel_reward.tasks.situ_glu_backward:ours_torch"),
)
