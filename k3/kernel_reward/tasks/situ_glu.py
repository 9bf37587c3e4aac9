"""SiTU-GLU forward (op ``situ``, report §2.3.2): [4 tanh(g/4) sigmoid(g)] * [25 tanh(u/25)], fp32 inside, bf16 out."""

import torch

from k3.kernel_reward.task import Task, Tolerance, generator, randn

SIGNATURE = ("kernel(gate: bf16 [n, F], up: bf16 [n, F]) -> bf16 [n, F]: "
             "4 tanh(gate/4) sigmoid(gate) * 25 tanh(up/25), computed in fp32")
SCALE = {"normal": 2.0, "large": 300.0, "small": 1e-3}  # large: both caps saturate; small: the SwiGLU-like regime


def make(shape, seed, magnitude, device):
    g = generator(seed, device)
    s = SCALE[magnitude]
    return tuple(randn(g, shape["n"], shape["F"], device=device, dtype=torch.bfloat16, scale=s) for _ in range(2))


def reference(gate, up):
    from k3.ops.situ import situ_glu

    return situ_glu(gate.double(), up.double())


TASK = Task(
    name="situ_glu", signature=SIGNATURE, make=make, reference=reference, out_dtypes=(torch.bfloat16,),
    tolerance=Tolerance(2**-7, 1e-6, "one bf16 rounding of the output (2^-7 when truncated); fp32 tanh and sigmoid "
                        "are exact to ~1e-6"),
    bench={"n": 16384, "F": 3584}, bench_cpu={"n": 256, "F": 512},
    held_out=({"n": 1, "F": 1}, {"n": 7, "F": 100}, {"n": 33, "F": 1027}),
    flops=lambda s: 20.0 * s["n"] * s["F"],
    bytes=lambda s: 6.0 * s["n"] * s["F"],
    experts={"cuda": "k3.ops.situ_triton:situ_glu_split", "cpu": "k3.ops.situ:situ_glu"},
    variants={"naive": "k3.ops.situ:situ_glu"},
    forbidden=("k3.ops.situ_triton:situ_glu_split", "k3.ops.situ_triton:situ_glu_fused", "k3.ops.situ:situ_glu",
               "k3.ops.situ:situ_glu_any"),
)
