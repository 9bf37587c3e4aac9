"""Row softmax in fp32 (a familiar example): exp(x - max) / sum(exp(x - max)) over the last dimension."""

import torch

from k3.kernel_reward.task import Task, Tolerance, generator, randn

SIGNATURE = "kernel(x: fp32 [rows, cols]) -> fp32 [rows, cols]: softmax over the last dimension, in fp32"
# large: logits of 1e3 overflow exp without the max shift; small: nearly uniform rows; precision: logits of a few
# units over long rows, where a bf16 or fp16 evaluation is off by ~1e-3 relative
SCALE = {"normal": 1.0, "large": 1e3, "small": 1e-3, "precision": 4.0}


def make(shape, seed, magnitude, device):
    g = generator(seed, device)
    return (randn(g, shape["rows"], shape["cols"], device=device, scale=SCALE[magnitude]),)


def reference(x):
    return torch.softmax(x.double(), dim=-1)


def expert(x):
    return torch.softmax(x, dim=-1)


TASK = Task(
    name="softmax", signature=SIGNATURE, make=make, reference=reference, out_dtypes=(torch.float32,),
    tolerance=Tolerance(1e-5, 1e-7, "fp32 exp is within a few ulps and the row sum's order changes its value by "
                        "~sqrt(cols) ulps; bf16/fp16/TF32-like arithmetic is off by 1e-4 to 1e-2"),
    precision=Tolerance(1e-5, 1e-7, "as the tolerance, on rows of 4K logits of scale 4"),
    bench={"rows": 32768, "cols": 4096}, bench_cpu={"rows": 512, "cols": 1024},
    held_out=({"rows": 1, "cols": 1}, {"rows": 3, "cols": 1000}, {"rows": 17, "cols": 4099}),
    flops=lambda s: 5.0 * s["rows"] * s["cols"],
    bytes=lambda s: 8.0 * s["rows"] * s["cols"],
    experts={"cpu": "k3.kernel_reward.tasks.softmax:expert"},
    forbidden=("k3.kernel_reward.tasks.softmax:expert",),
)
