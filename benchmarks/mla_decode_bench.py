"""One MLA decode step at k3-mini sizes (H = 8, R = 256, Dr = 64, Dn = Dv = 128, bf16 cache, 2048-token pages):
the paged Triton kernel (k3.ops.mla_decode) vs the current serving path (gather the request's pages into a
contiguous tensor, as k3.serve.cache.views.PagedMLAView does, then k3.ops.mla.mla_absorbed), against the bandwidth
roofline.

Every request holds `context` tokens in pages scattered through a CachePool (shuffled page order). Per case
(batch, context) one JSON line:

  kernel_ms        mla_decode_paged alone (q_lat -> o_lat), do_bench median
  kernel_graph_ms  the same replayed from a CUDA graph (GPU time without launch overhead)
  decode_ms        mla_decode_absorbed: the kernel plus the w_kc / w_vc absorb einsums
  gather_ms        gather pages + mla_absorbed (the current path, same inputs and outputs as decode_ms)
  MB               bytes the step must read: valid tokens x (R + Dr) x 2 bytes, over all requests
  roofline_ms      MB / the copy bandwidth (--bw-tbs, 4.0 TB/s measured on an H200)
  of_roofline      roofline_ms / kernel_graph_ms
  speedup          gather_ms / decode_ms

    python benchmarks/mla_decode_bench.py --batches 1 16 64 --contexts 4096 32768
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from k3.config import K3Config
from k3.ops.mla import mla_absorbed
from k3.serve.cache.pool import CachePool


def bench(cfg: K3Config, B: int, ctx: int, page_tokens: int, num_splits: int | None, bw_tbs: float,
          rep_ms: int) -> dict:
    import triton.testing

    from k3.ops.mla_decode import default_num_splits, mla_decode_absorbed, mla_decode_paged

    H, R, Dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    Dn, Dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    scale = (Dn + Dr) ** -0.5
    dev = "cuda"
    pages_per = -(-ctx // page_tokens)
    pool = CachePool(cfg, B * pages_per, page_tokens, dtype=torch.bfloat16, device=dev)
    kv = pool.pages[:, : pool.mla_page_bytes].view(torch.bfloat16).view(pool.num_pages, page_tokens, -1)
    kv.normal_()
    table = torch.randperm(pool.num_pages, device=dev).view(B, pages_per).to(torch.int32)
    kv_len = torch.full((B,), ctx, device=dev, dtype=torch.int32)

    q_nope = torch.randn(B, H, Dn, device=dev, dtype=torch.bfloat16)
    q_rope = torch.randn(B, H, Dr, device=dev, dtype=torch.bfloat16)
    w_kc = torch.randn(H, Dn, R, device=dev, dtype=torch.bfloat16) / Dn**0.5
    w_vc = torch.randn(H, Dv, R, device=dev, dtype=torch.bfloat16) / R**0.5
    q_lat = torch.einsum("bhn,hnr->bhr", q_nope.float(), w_kc.float())
    splits = num_splits or default_num_splits(B, H, ctx, dev)  # fixed: no device read inside the timing

    def kernel():
        return mla_decode_paged(q_lat, q_rope, kv, table, kv_len, scale, R, splits)

    def decode():
        return mla_decode_absorbed(q_nope, q_rope, kv, table, kv_len, w_kc, w_vc, scale, splits)

    def gather():  # k3.serve.cache.views.PagedMLAView.append's read, then the absorbed attention
        rows = pool.mla_pages(table.reshape(-1).long()).reshape(B, pages_per * page_tokens, -1)[:, :ctx]
        c, k_rope = rows[..., :R], rows[..., R:]
        return mla_absorbed(q_nope[:, None], q_rope[:, None], c, k_rope, w_kc, w_vc, scale, kv_len=kv_len)[:, 0]

    # The two paths agree (bf16 outputs of the same math; loose bound, the benchmark is not the test).
    torch.testing.assert_close(decode().float(), gather().float(), rtol=3e-2, atol=3e-2)

    def timed(fn):
        return triton.testing.do_bench(fn, warmup=5, rep=rep_ms, return_mode="median")

    with torch.no_grad():
        kernel_ms, decode_ms, gather_ms = timed(kernel), timed(decode), timed(gather)
        graph_ms = triton.testing.do_bench_cudagraph(kernel, rep=rep_ms, return_mode="median")
    nbytes = B * ctx * (R + Dr) * kv.element_size()
    roofline_ms = nbytes / (bw_tbs * 1e12) * 1e3
    return {"batch": B, "context": ctx, "heads": H, "num_splits": splits, "kernel_ms": round(kernel_ms, 4),
            "kernel_graph_ms": round(graph_ms, 4), "decode_ms": round(decode_ms, 4), "gather_ms": round(gather_ms, 4),
            "MB": round(nbytes / 1e6, 1), "roofline_ms": round(roofline_ms, 4),
            "of_roofline": round(roofline_ms / graph_ms, 3), "speedup": round(gather_ms / decode_ms, 2)}


def main():
    from k3.cli_args import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 16, 64])
    ap.add_argument("--contexts", nargs="*", type=int, default=[4096, 32768])
    ap.add_argument("--preset", default="k3-mini", help="model preset giving H, R, Dr, Dn, Dv")
    ap.add_argument("--page-tokens", type=int, default=2048)
    ap.add_argument("--num-splits", type=int, default=None, help="fixed split count (default: chosen per case)")
    ap.add_argument("--bw-tbs", type=float, default=4.0, help="copy bandwidth for the roofline, TB/s (H200: 4.0)")
    ap.add_argument("--rep-ms", type=int, default=100, help="timing budget per measurement (do_bench rep)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("mla_decode_bench.py needs a CUDA device (the kernel runs on GPU; see k3.ops._triton.runnable)")
    cfg = K3Config.from_preset(args.preset)
    for B in args.batches:
        for ctx in args.contexts:
            row = bench(cfg, B, ctx, args.page_tokens, args.num_splits, args.bw_tbs, args.rep_ms)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
