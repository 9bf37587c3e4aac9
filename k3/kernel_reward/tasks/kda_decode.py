"""One KDA decode step (op ``kda`` with T = 1, report §2.1.1): the gate, the q/k L2 norms and beta's sigmoid, then
S' = (I - beta k k^T) Diag(alpha) S + beta k v^T and o = S'^T (q / sqrt(K)), for every sequence and head."""

import math

import torch

from k3.kernel_reward.task import Task, Tolerance, generator, randn

SIGNATURE = ("kernel(q, k, v, z: bf16 [B, 1, H, K], beta_logits: bf16 [B, 1, H], A_log: fp32 [H], dt_bias: fp32 "
             "[H*K], state: fp32 [B, H, K, K]) -> (o: bf16 [B, 1, H, K], new_state: fp32 [B, H, K, K]); the gate "
             "g = -5 sigmoid(exp(A_log) (z + dt_bias)), q and k L2-normalized, beta = sigmoid(beta_logits); the "
             "state is read-only (return the new one)")
LOWER_BOUND = -5.0
SCALE = {"normal": 1.0, "large": 1e3, "small": 1e-3}  # on q, k, v, z: the norms and the gate's sigmoid saturate


def make(shape, seed, magnitude, device):
    """The kernel's arguments (also k3.kernel_reward.tasks.kda_chunk's, whose shapes carry T)."""
    g = generator(seed, device)
    B, T, H, K = shape["B"], shape.get("T", 1), shape["H"], shape["K"]  # T: the chunk task's tokens
    s = SCALE[magnitude]
    q, k, v = (randn(g, B, T, H, K, device=device, dtype=torch.bfloat16, scale=s) for _ in range(3))
    z = randn(g, B, T, H, K, device=device, dtype=torch.bfloat16, scale=min(s, 10.0))
    beta_logits = randn(g, B, T, H, device=device, dtype=torch.bfloat16)
    A_log = torch.rand(H, generator=g, device=device) * math.log(16.0)
    dt_bias = randn(g, H * K, device=device, scale=0.5)
    state = randn(g, B, H, K, K, device=device, scale=0.1)
    return q, k, v, z, beta_logits, A_log, dt_bias, state


def reference(q, k, v, z, beta_logits, A_log, dt_bias, state):
    from k3.ops.kda_naive import kda_recurrent_naive

    return kda_recurrent_naive(q, k, v, z, beta_logits, A_log, dt_bias, LOWER_BOUND, initial_state=state)


def _run(fn, q, k, v, z, beta_logits, A_log, dt_bias, state):
    with torch.no_grad():
        o, new = fn(q, k, v, z, beta_logits, A_log, dt_bias, LOWER_BOUND, initial_state=state.clone())
    return o.to(v.dtype), new.float()


def expert(*args):
    from k3.ops.kda_backend import kda_fla

    return _run(kda_fla, *args)


def ours_torch(*args):
    from k3.ops.kda_backend import kda_torch

    return _run(kda_torch, *args)


TASK = Task(
    name="kda_decode", signature=SIGNATURE, make=make, reference=reference, out_dtypes=(torch.bfloat16, torch.float32),
    tolerance=Tolerance(2**-6, 1e-2, "o is bf16: one rounding (2^-9) of a K-term sum that may cancel, so its small "
                        "entries are held to 1e-2 of the largest; the fp32 state from the bf16 inputs is within ~1e-7 of "
                        "the fp64 recurrence (k3's torch op, normalizing q and k in fp32)"),
    bench={"B": 256, "H": 32, "K": 128}, bench_cpu={"B": 8, "H": 4, "K": 32},
    held_out=({"B": 1, "H": 1, "K": 8}, {"B": 3, "H": 2, "K": 16}, {"B": 2, "H": 3, "K": 24}),
    flops=lambda s: 8.0 * s["B"] * s["H"] * s["K"] ** 2,
    bytes=lambda s: 8.0 * s["B"] * s["H"] * s["K"] ** 2 + 10.0 * s["B"] * s["H"] * s["K"],
    experts={"cuda": "k3.kernel_reward.tasks.kda_decode:expert", "cpu": "k3.kernel_reward.tasks.kda_decode:ours_torch"},
    variants={"ours": "k3.kernel_reward.tasks.kda_decode:ours_torch"},
    forbidden=("k3.ops.kda_backend:kda_fla", "k3.ops.kda_backend:kda_torch", "k3.ops.kda_backend:kda",
               "k3.ops.kda_naive:kda_recurrent_naive", "k3.ops.kda:kda_recurrent",
               "k3.kernel_reward.tasks.kda_decode:expert", "k3.kernel_reward.tasks.kda_decode:ours_torch"),
)
