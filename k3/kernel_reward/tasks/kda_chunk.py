"""The KDA chunk forward (op ``kda`` with T > 1, report §2.1.1): for every sequence and head the gate, the q/k
L2 norms and beta's sigmoid, then T steps of S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,
o_t = S_t^T (q_t / sqrt(K)), from a given initial state; returns every o_t and the final state. Any exact
reformulation (chunkwise, as fla's chunk_kda and k3's torch op do) is allowed."""

import torch

from k3.kernel_reward.task import Task, Tolerance
# the inputs, the fp64 recurrence and the two implementations are the decode task's, with T tokens per sequence
from k3.kernel_reward.tasks.kda_decode import expert as _fla_expert
from k3.kernel_reward.tasks.kda_decode import make, ours_torch, reference

CHUNK = 64  # the chunk length the FLOP count assumes (fla's and k3's)
SIGNATURE = ("kernel(q, k, v, z: bf16 [B, T, H, K], beta_logits: bf16 [B, T, H], A_log: fp32 [H], dt_bias: fp32 "
             "[H*K], state: fp32 [B, H, K, K]) -> (o: bf16 [B, T, H, K], final_state: fp32 [B, H, K, K]); the gate "
             "g = -5 sigmoid(exp(A_log) (z + dt_bias)), q and k L2-normalized, beta = sigmoid(beta_logits); the "
             "initial state is read-only")

MIN_FLA_K = 16  # fla's chunk_kda multiplies over the head dimension with tl.dot, which Triton compiles for K >= 16 only


def expert(*args):
    """fla-core's chunk_kda (timed on the benchmark shape); heads narrower than MIN_FLA_K, which that kernel does not
    compile (the held-out K = 8), go to k3's torch op, so that the expert is correct on every case."""
    if args[0].shape[-1] < MIN_FLA_K:
        return ours_torch(*args)
    return _fla_expert(*args)


def _flops(s):
    """Per token and head, the chunkwise form: the state read and write (2 x 2 K^2, the decayed S and k u^T), the
    output S^T q (2 K^2), and the intra-chunk attention and UT transform (~4 CHUNK K)."""
    return s["B"] * s["T"] * s["H"] * (6.0 * s["K"] ** 2 + 4.0 * CHUNK * s["K"])


TASK = Task(
    name="kda_chunk", signature=SIGNATURE, make=make, reference=reference, out_dtypes=(torch.bfloat16, torch.float32),
    tolerance=Tolerance(2**-6, 1e-2, "o is bf16: one rounding (2^-9) of a K-term sum that may cancel, so its small "
                        "entries are held to 1e-2 of the largest; the chunkwise fp32 state over T steps from bf16 "
                        "inputs stays within ~1e-5 of the fp64 recurrence (k3's torch op)"),
    bench={"B": 4, "T": 4096, "H": 16, "K": 128}, bench_cpu={"B": 1, "T": 256, "H": 2, "K": 32},
    held_out=({"B": 1, "T": 2, "H": 1, "K": 8}, {"B": 2, "T": 67, "H": 2, "K": 16}, {"B": 1, "T": 130, "H": 3, "K": 24}),
    flops=_flops,
    bytes=lambda s: s["B"] * s["T"] * s["H"] * (10.0 * s["K"] + 2) + 8.0 * s["B"] * s["H"] * s["K"] ** 2,
    experts={"cuda": "k3.kernel_reward.tasks.kda_chunk:expert", "cpu": "k3.kernel_reward.tasks.kda_decode:ours_torch"},
    variants={"ours": "k3.kernel_reward.tasks.kda_decode:ours_torch"},
    forbidden=("k3.ops.kda_backend:kda_fla", "k3.ops.kda_backend:kda_torch", "k3.ops.kda_backend:kda",
               "k3.ops.kda_naive:kda_recurrent_naive", "k3.ops.kda_naive:kda_chunk_naive", "k3.ops.kda:kda_chunk",
               "k3.ops.kda:kda_recurrent", "k3.kernel_reward.tasks.kda_decode:expert",
               "k3.kernel_reward.tasks.kda_decode:ours_torch", "k3.kernel_reward.tasks.kda_chunk:expert"),
)
