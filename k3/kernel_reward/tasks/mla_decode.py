"""Paged MLA decode attention in absorbed form (op ``mla_decode``, k3.ops.mla_decode): each request's one query
per head attends, in the latent space, to every cached row [c (R) | k_rope (Dr)] of its pages in the pool:
score_hj = SCALE (q_lat_h . c_j + q_rope_h . k_rope_j), o_lat_h = sum_j softmax_j(score_h) c_j."""

import torch

from k3.kernel_reward.task import Task, Tolerance, generator, randn

SCALE = (128 + 64) ** -0.5  # Gated MLA's softmax scale: 1 / sqrt(qk_nope + qk_rope head dims)
SIGNATURE = ("kernel(q_lat: bf16 [B, H, R], q_rope: bf16 [B, H, Dr], kv: bf16 [P, page_tokens, R + Dr], "
             "block_table: int32 [B, max_pages], kv_len: int32 [B]) -> o_lat: fp32 [B, H, R]; token t of request b "
             f"is row t % page_tokens of page block_table[b, t // page_tokens], for t < kv_len[b]; scale {SCALE!r}; "
             "a request with kv_len 0 gets zeros; pool rows of other requests or past kv_len may hold anything")
MAGNITUDE = {"normal": 1.0, "large": 8.0, "small": 1e-3}  # large: scores in the hundreds (softmax must be stable)


def make(shape, seed, magnitude, device):
    g = generator(seed, device)
    B, H, R, Dr, page, max_len = shape["B"], shape["H"], shape["R"], shape["Dr"], shape["page"], shape["max_len"]
    s = MAGNITUDE[magnitude]
    max_pages = -(-max_len // page)
    num_pages = B * max_pages + 3  # spare pages that no request uses
    q_lat = randn(g, B, H, R, device=device, dtype=torch.bfloat16, scale=s)
    q_rope = randn(g, B, H, Dr, device=device, dtype=torch.bfloat16, scale=s)
    kv = randn(g, num_pages, page, R + Dr, device=device, dtype=torch.bfloat16, scale=s)
    # each request's pages scattered through the pool; lengths from 0 to max_len (the first request full)
    perm = torch.randperm(num_pages, generator=g, device=device)[:B * max_pages]
    block_table = perm.view(B, max_pages).to(torch.int32)
    kv_len = torch.randint(0, max_len + 1, (B,), generator=g, device=device).to(torch.int32)
    kv_len[0] = max_len
    return q_lat, q_rope, kv, block_table, kv_len


def reference(q_lat, q_rope, kv, block_table, kv_len):
    B, H, R = q_lat.shape
    page = kv.shape[1]
    L = int(kv_len.max())
    if L == 0:
        return torch.zeros(B, H, R, dtype=torch.float64, device=q_lat.device)
    t = torch.arange(L, device=kv.device)
    valid = t[None, :] < kv_len.long()[:, None]
    pages = torch.where(valid, block_table.long().gather(1, (t // page)[None, :].expand(B, L)), 0)
    rows = kv[pages, (t % page)[None, :].expand(B, L)].double().masked_fill(~valid[:, :, None], 0.0)
    c, k_rope = rows[..., :R], rows[..., R:]
    scores = SCALE * (torch.einsum("bhr,blr->bhl", q_lat.double(), c)
                      + torch.einsum("bhd,bld->bhl", q_rope.double(), k_rope))
    probs = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("bhl,blr->bhr", probs, c)


def expert_triton(q_lat, q_rope, kv, block_table, kv_len):
    from k3.ops.mla_decode import mla_decode_paged_triton

    return mla_decode_paged_triton(q_lat, q_rope, kv, block_table, kv_len, SCALE, q_lat.shape[2])


def ours_torch(q_lat, q_rope, kv, block_table, kv_len):
    from k3.ops.mla_decode import mla_decode_paged_reference

    return mla_decode_paged_reference(q_lat, q_rope, kv, block_table, kv_len, SCALE, q_lat.shape[2])


def _bytes(s):
    """The rows the requests read (their lengths average max_len / 2 but the benchmark's first is full: counted at
    max_len for all, the upper bound) plus the queries and outputs."""
    return 2.0 * s["B"] * s["max_len"] * (s["R"] + s["Dr"]) + s["B"] * s["H"] * (2 * (s["R"] + s["Dr"]) + 4 * s["R"])


TASK = Task(
    name="mla_decode", signature=SIGNATURE, make=make, reference=reference, out_dtypes=(torch.float32,),
    tolerance=Tolerance(2**-7, 4e-3, "bf16 inputs, fp32 softmax and accumulation: the scores carry one bf16 rounding "
                        "of the probabilities in the weighted sum (2^-9 relative per term), summed over the context; "
                        "entries that cancel are held to 4e-3 of the largest"),
    bench={"B": 64, "H": 16, "R": 512, "Dr": 64, "page": 64, "max_len": 4096},
    bench_cpu={"B": 4, "H": 4, "R": 64, "Dr": 16, "page": 16, "max_len": 96},
    held_out=({"B": 1, "H": 1, "R": 16, "Dr": 16, "page": 16, "max_len": 1},
              {"B": 3, "H": 2, "R": 32, "Dr": 16, "page": 8, "max_len": 37},
              {"B": 2, "H": 5, "R": 48, "Dr": 16, "page": 16, "max_len": 130}),
    flops=lambda s: 4.0 * s["B"] * s["H"] * s["max_len"] * (s["R"] + s["Dr"] / 2),
    bytes=_bytes,
    experts={"cuda": "k3.kernel_reward.tasks.mla_decode:expert_triton",
             "cpu": "k3.kernel_reward.tasks.mla_decode:ours_torch"},
    variants={"ours": "k3.kernel_reward.tasks.mla_decode:ours_torch"},
    forbidden=("k3.ops.mla_decode:mla_decode_paged_triton", "k3.ops.mla_decode:mla_decode_paged_reference",
               "k3.ops.mla_decode:mla_decode_paged", "k3.kernel_reward.tasks.mla_decode:expert_triton",
               "k3.kernel_reward.tasks.mla_decode:ours_torch"),
)
