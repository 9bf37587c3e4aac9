"""Paged MLA decode kernel (k3.ops.mla_decode) against its torch reference and k3.ops.mla.mla_absorbed.

CPU tests run the Triton kernels in Triton's interpreter: the module reads TRITON_INTERPRET at each call, so
the `interpret` fixture sets it in-process. GPU tests (marked `gpu`) run the compiled kernels.

The pools are real CachePool pages (tiny config: R = 32, Dr = 16; the page stride is the pool's page size,
larger than page_tokens x (R + Dr)) with 24 tokens a page and BLOCK_N = 16, so blocks straddle pages; block
tables list pages out of order; every byte not holding a valid token (slots past kv_len, unused pages, the
page tails past the MLA view) is NaN.

Tolerances. fp32 pool: rtol = atol = 1e-5 (outputs are O(1); the kernel's products are exact fp32, only the
summation order differs). bf16/fp16 pool, against the same rounded cache values in fp32: rtol = 1e-2 and
atol = 1e-2 x max |expected| (the kernel multiplies the probabilities rounded to the pool dtype; the
interpreter rounds fp32 -> bf16 by truncation, the GPU to nearest). Results for different num_splits agree
to 1e-5 in fp32.
"""

import sys

import pytest
import torch

from k3.config import K3Config
from k3.ops.mla import mla_absorbed
from k3.ops.mla_decode import (
    default_num_splits,
    mla_decode_absorbed,
    mla_decode_paged,
    mla_decode_paged_reference,
    mla_decode_paged_triton,
)
from k3.serve.cache.pool import CachePool

H, DN, DV = 5, 12, 10
SCALE = 0.25
PAGE_TOKENS = 24
BLOCK_N = 16
LENS = [1, 23, 70]
# Out of order; the 70-token request spans three pages; entries past a request's pages are 0 (an unused page).
TABLE = [[7, 0, 0, 0], [3, 0, 0, 0], [10, 2, 5, 0]]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def assert_matches(actual, expected, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol,
                               atol=tol * max(1.0, float(expected.abs().max())) if dtype != torch.float32 else tol)


class Case:
    """A CachePool holding len(lens) requests, NaN everywhere else, plus random queries and weights."""

    def __init__(self, dtype, lens=LENS, table=TABLE, heads=H, seed=0, device="cpu", q_std=2.0):
        cfg = K3Config.from_preset("tiny")
        self.R, self.Dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        num_pages = 12
        pool = CachePool(cfg, num_pages, PAGE_TOKENS, dtype=dtype, device=device)
        pool.pages.fill_(255)  # all-ones bytes: NaN in bf16, fp16 and fp32
        g = torch.Generator().manual_seed(seed)
        B = len(lens)
        self.lens = torch.tensor(lens, device=device)
        self.table = torch.tensor(table, device=device, dtype=torch.int32)
        for b, n in enumerate(lens):
            t = torch.arange(n)
            pages = self.table[b].cpu()[t // PAGE_TOKENS]
            rows = torch.randn(n, self.R + self.Dr, generator=g)
            pool.write_mla(pages.to(device), (t % PAGE_TOKENS).to(device), rows.to(device))
        self.pool = pool
        self.kv = pool.pages[:, :pool.mla_page_bytes].view(dtype).view(num_pages, PAGE_TOKENS, -1)
        assert self.kv.stride(0) > PAGE_TOKENS * (self.R + self.Dr)
        self.q_nope = (torch.randn(B, heads, DN, generator=g) * q_std).to(device)
        self.q_rope = (torch.randn(B, heads, self.Dr, generator=g) * q_std).to(device)
        self.w_kc = (torch.randn(heads, DN, self.R, generator=g) / DN**0.5).to(device)
        self.w_vc = (torch.randn(heads, DV, self.R, generator=g) / self.R**0.5).to(device)
        self.q_lat = torch.einsum("bhn,hnr->bhr", self.q_nope, self.w_kc)

    def args(self):
        return self.q_lat, self.q_rope, self.kv, self.table, self.lens, SCALE, self.R

    def gathered(self):
        """(c [B, L, R], k_rope [B, L, Dr]) of every request, padded with NaN past its length."""
        L = int(self.lens.max())
        B = len(self.lens)
        out = torch.full((B, L, self.R + self.Dr), float("nan"), device=self.kv.device)
        for b in range(B):
            t = torch.arange(int(self.lens[b]), device=self.kv.device)
            out[b, : len(t)] = self.kv[self.table[b].long()[t // PAGE_TOKENS], t % PAGE_TOKENS].float()
        return out[..., : self.R], out[..., self.R:]

    def absorbed(self):
        """mla_absorbed (Tq = 1) on the gathered tokens: [B, H, Dv] fp32."""
        c, k_rope = self.gathered()
        o = mla_absorbed(self.q_nope[:, None], self.q_rope[:, None], c, k_rope, self.w_kc, self.w_vc, SCALE,
                         kv_len=self.lens)
        return o[:, 0]


# --- CPU: Triton interpreter --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
def test_kernel_matches_reference_and_absorbed(interpret, dtype, num_splits):
    # num_splits = 8 leaves empty splits (more splits than blocks) for every request; 2 and 3 split the
    # 23-token request into one block and an empty split.
    case = Case(dtype)
    o_lat = mla_decode_paged(*case.args(), num_splits, block_n=BLOCK_N)
    assert o_lat.shape == (3, H, case.R) and o_lat.dtype == torch.float32
    assert torch.isfinite(o_lat).all()
    ref = mla_decode_paged_reference(*case.args())
    assert_matches(o_lat, ref, dtype)
    # The reference against mla_absorbed in latent space: o = o_lat @ w_vc^T.
    o_ref = torch.einsum("bhr,hvr->bhv", ref, case.w_vc)
    torch.testing.assert_close(o_ref, case.absorbed(), rtol=1e-5, atol=1e-5)

    o = mla_decode_absorbed(case.q_nope, case.q_rope, case.kv, case.table, case.lens, case.w_kc, case.w_vc, SCALE,
                            num_splits)
    assert o.shape == (3, H, DV) and o.dtype == case.q_nope.dtype
    assert_matches(o, case.absorbed(), dtype)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_the_combine_inside_the_absorption_equals_the_decode_then_the_absorption(interpret, monkeypatch, num_splits,
                                                                                  w_dtype):
    # op mla_combine_absorb_v: the split kernel's partials combined by the absorption's kernel give what the
    # decode's own combine kernel followed by the absorption's kernel give (the same fp32 operations per column;
    # 8 splits leave empty ones, the zero-length row every one); the padding row's output is 0
    from helpers import count_fast_calls
    from k3.ops.registry import Backends

    calls = count_fast_calls(monkeypatch, "mla_combine_absorb_v", "mla_absorb_v")
    case = Case(torch.float32, lens=[1, 23, 70, 0], table=TABLE + [[0, 0, 0, 0]])
    w_vc = case.w_vc.to(w_dtype)
    q_nope = case.q_nope.to(w_dtype)
    args = (q_nope, case.q_rope, case.kv, case.table, case.lens, case.w_kc.to(w_dtype), w_vc, SCALE, num_splits)
    two = mla_decode_absorbed(*args, backends=Backends(per_op={"mla_absorb_v": "triton"}))
    one = mla_decode_absorbed(*args, backends=Backends(per_op={"mla_absorb_v": "triton",
                                                              "mla_combine_absorb_v": "triton"}))
    assert calls == ["mla_absorb_v", "mla_combine_absorb_v"]
    assert one.dtype == w_dtype and torch.equal(one, two)
    assert not one[3].any()
    part, lse = mla_decode_paged_triton(*case.args(), num_splits, partials=True)
    assert part.shape == (4, num_splits, H, case.R) and (lse is None) == (num_splits == 1)


def test_more_splits_than_tokens(interpret):
    case = Case(torch.float32)
    ref = mla_decode_paged_reference(*case.args())
    o_lat = mla_decode_paged(*case.args(), 75, block_n=BLOCK_N)  # > 70 tokens: most splits are empty
    assert_matches(o_lat, ref, torch.float32)


def test_result_does_not_depend_on_num_splits(interpret):
    case = Case(torch.float32, seed=1)
    outs = [mla_decode_paged(*case.args(), s, block_n=BLOCK_N) for s in (1, 2, 4, 5)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-5, atol=1e-5)
    # block_n changes the blocking, not the result.
    torch.testing.assert_close(mla_decode_paged(*case.args(), 3, block_n=32), outs[0], rtol=1e-5, atol=1e-5)
    # The default split count (1 at these lengths) too.
    torch.testing.assert_close(mla_decode_paged(*case.args(), block_n=BLOCK_N), outs[0], rtol=1e-5, atol=1e-5)


def test_fp16_pool_and_low_precision_queries(interpret):
    case = Case(torch.float16, seed=2)
    q_lat, q_rope, *rest = case.args()
    # q in bf16 and strided (a transposed copy viewed back); the kernel reads it with its strides in fp32.
    q_lat16 = q_lat.to(torch.bfloat16).transpose(0, 1).contiguous().transpose(0, 1)
    o_lat = mla_decode_paged(q_lat16, q_rope, *rest, 2, block_n=BLOCK_N)
    ref = mla_decode_paged_reference(q_lat16, q_rope, *rest)
    assert_matches(o_lat, ref, torch.float16)


def test_int64_tables_and_zero_length_rows(interpret):
    # kv_len = 0 marks a padding row of a fixed-size batch: its output is 0, and the other rows are unaffected.
    case = Case(torch.float32, lens=[70, 0, 23], table=[[10, 2, 5, 0], [0, 0, 0, 0], [3, 0, 0, 0]], seed=3)
    q_lat, q_rope, kv, table, lens, scale, R = case.args()
    for S in (1, 4):
        o_lat = mla_decode_paged(q_lat, q_rope, kv, table.long(), lens.int(), scale, R, S, block_n=BLOCK_N)
        ref = mla_decode_paged_reference(q_lat, q_rope, kv, table.long(), lens.int(), scale, R)
        assert torch.equal(o_lat[1], torch.zeros_like(o_lat[1])) and torch.equal(ref[1], o_lat[1])
        assert_matches(o_lat, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_general_sizes(interpret, dtype):
    # R and Dr not powers of two (padded to 32 and 16), 7-token pages, H = 65 (five head groups of 16), the
    # page dimension strided (every other page of a larger pool), garbage everywhere else.
    g = torch.Generator().manual_seed(4)
    R, Dr, pt, heads = 24, 6, 7, 65
    lens = torch.tensor([5, 30])
    big = torch.full((16, pt, R + Dr + 3), float("nan"), dtype=dtype)
    kv = big[::2, :, : R + Dr]  # 8 pages, page stride 2 * pt * (R + Dr + 3)
    table = torch.tensor([[6, 1, 1, 1, 1], [2, 7, 0, 4, 3]])
    for b in range(2):
        t = torch.arange(int(lens[b]))
        kv[table[b][t // pt], t % pt] = torch.randn(len(t), R + Dr, generator=g).to(dtype)
    q_lat = torch.randn(2, heads, R, generator=g)
    q_rope = torch.randn(2, heads, Dr, generator=g)
    ref = mla_decode_paged_reference(q_lat, q_rope, kv, table, lens, 0.3, R)
    for S in (1, 3):
        assert_matches(mla_decode_paged(q_lat, q_rope, kv, table, lens, 0.3, R, S, block_n=BLOCK_N), ref, dtype)


def test_validation(interpret):
    case = Case(torch.float32)
    q_lat, q_rope, kv, table, lens, scale, R = case.args()
    bad = {
        "q_lat must be 3-D": dict(q_lat=q_lat[0]),
        "q_lat must be a floating": dict(q_lat=q_lat.long()),
        "q_rope must have shape": dict(q_rope=q_rope[:2]),
        "kv_rank": dict(kv_rank=R - 1),
        "kv's rows": dict(kv=kv[..., :-1]),
        "kv must be bfloat16, float16 or float32": dict(kv=kv.double()),
        "block_table must have shape": dict(block_table=table[:2]),
        "block_table must be int32 or int64": dict(block_table=table.float()),
        "kv_len must have shape": dict(kv_len=lens[:2]),
        "kv_len must be int32 or int64": dict(kv_len=lens.float()),
        "scale must be a finite": dict(scale=float("nan")),
        "num_splits must be an int >= 1": dict(num_splits=0),
        "num_splits must be at most 1024": dict(num_splits=1025),
    }
    names = ["q_lat", "q_rope", "kv", "block_table", "kv_len", "scale", "kv_rank", "num_splits"]
    for match, change in bad.items():
        kwargs = dict(zip(names, case.args()), num_splits=None) | change
        for fn in (mla_decode_paged, mla_decode_paged_reference):
            with pytest.raises(ValueError, match=match):
                fn(**kwargs)
    with pytest.raises(ValueError, match="kv_len must be in"):
        mla_decode_paged(q_lat, q_rope, kv, table, torch.tensor([1, 2, 97]), scale, R)  # > 4 pages x 24
    with pytest.raises(ValueError, match="kv_len must be in"):
        mla_decode_paged_reference(q_lat, q_rope, kv, table, torch.tensor([-1, 2, 3]), scale, R)
    with pytest.raises(ValueError, match="page ids"):
        mla_decode_paged_reference(q_lat, q_rope, kv, table + 100, lens, scale, R)
    with pytest.raises(ValueError, match="block_n"):
        mla_decode_paged(*case.args(), block_n=24)
    empty = (q_lat[:0], q_rope[:0], kv, table[:0], lens[:0], scale, R)  # an empty batch is fine
    assert mla_decode_paged(*empty).shape == mla_decode_paged_reference(*empty).shape == (0, H, R)
    with pytest.raises(ValueError, match="w_vc must have shape"):
        mla_decode_absorbed(case.q_nope, q_rope, kv, table, lens, case.w_kc, case.w_vc[:, :, :-1], scale)


def test_reference_without_interpreter(monkeypatch):
    # Without the interpreter and without CUDA, mla_decode_paged is the reference; the kernel path says why not.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = Case(torch.bfloat16)
    if not torch.cuda.is_available():
        assert torch.equal(mla_decode_paged(*case.args(), 3), mla_decode_paged_reference(*case.args()))
        with pytest.raises(RuntimeError, match="MLA decode Triton kernels cannot run"):
            mla_decode_paged_triton(*case.args())
    monkeypatch.setitem(sys.modules, "triton", None)  # Triton not importable: the reference everywhere
    assert torch.equal(mla_decode_paged(*case.args()), mla_decode_paged_reference(*case.args()))


def test_default_num_splits():
    # k3-mini heads (one group of 16 padded heads); 132 SMs when no CUDA device is named.
    assert default_num_splits(64, 8, 32768) == 9  # ceil(4 * 132 / 64) programs per request
    assert default_num_splits(1, 8, 4096) == 16  # at least 256 tokens a split
    assert default_num_splits(1, 8, 10**6) == 128  # at most 128 splits
    assert default_num_splits(3, 5, 70) == 1
    assert default_num_splits(2, 8, 0) == 1
    assert default_num_splits(4, 96, 32768) == 44  # K3's 96 heads: three groups of 32


# --- GPU: compiled kernels ----------------------------------------------------------------------------------


def paged_cache(B, lens, R, Dr, pt, dtype, seed=0):
    """A shuffled page pool on the GPU holding `lens` tokens per request, NaN in every unused slot and page."""
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // pt) for n in lens]
    num_pages = sum(pages_per) + 3
    kv = torch.full((num_pages, pt, R + Dr), float("nan"), dtype=dtype, device="cuda")
    perm = torch.randperm(num_pages, generator=g)[: sum(pages_per)]
    max_pages = max(pages_per)
    table = torch.zeros(B, max_pages, dtype=torch.int32)
    i = 0
    for b, n in enumerate(lens):
        table[b, : pages_per[b]] = perm[i: i + pages_per[b]]
        i += pages_per[b]
        t = torch.arange(n)
        kv[table[b][t // pt].long().cuda(), (t % pt).cuda()] = torch.randn(n, R + Dr, generator=g).to("cuda", dtype)
    return kv, table.cuda(), torch.tensor(lens, device="cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [None, 1, 7, 32])
def test_gpu_k3_mini_sizes(num_splits):
    B, heads, R, Dr, pt = 64, 8, 256, 64, 2048
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(1, 32768 + 1, (B,), generator=g).tolist()
    lens[:4] = [1, 2048, 2049, 32768]
    kv, table, kv_len = paged_cache(B, lens, R, Dr, pt, torch.bfloat16)
    q_lat = torch.randn(B, heads, R, generator=g).cuda() * 3
    q_rope = torch.randn(B, heads, Dr, generator=g).cuda() * 3
    scale = 192**-0.5
    o_lat = mla_decode_paged(q_lat, q_rope, kv, table, kv_len, scale, R, num_splits)
    ref = mla_decode_paged_reference(q_lat, q_rope, kv, table, kv_len, scale, R)
    assert torch.isfinite(o_lat).all()
    assert_matches(o_lat, ref, torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_small_cases_match_the_interpreter_cases(dtype):
    case = Case(dtype, device="cuda")
    ref = mla_decode_paged_reference(*case.args())
    for S in (1, 3, 8, 75):
        assert_matches(mla_decode_paged(*case.args(), S), ref, dtype)
        assert_matches(mla_decode_paged(*case.args(), S, block_n=BLOCK_N), ref, dtype)
    o = mla_decode_absorbed(case.q_nope, case.q_rope, case.kv, case.table, case.lens, case.w_kc, case.w_vc, SCALE)
    assert_matches(o, case.absorbed(), dtype)


@pytest.mark.gpu
@needs_cuda
def test_gpu_k3_heads_and_rank():
    # K3's latent rank and head count (96 heads: three groups of 32), bf16.
    B, heads, R, Dr, pt = 4, 96, 512, 64, 64
    lens = [1, 100, 4000, 777]
    kv, table, kv_len = paged_cache(B, lens, R, Dr, pt, torch.bfloat16, seed=6)
    q_lat = torch.randn(B, heads, R, device="cuda")
    q_rope = torch.randn(B, heads, Dr, device="cuda")
    o_lat = mla_decode_paged(q_lat, q_rope, kv, table, kv_len, 192**-0.5, R)
    assert_matches(o_lat, mla_decode_paged_reference(q_lat, q_rope, kv, table, kv_len, 192**-0.5, R), torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_replay_with_new_lengths():
    # Fixed num_splits: nothing is read back, so the step captures; replays see new lengths and block tables.
    B, heads, R, Dr, pt = 8, 8, 256, 64, 256
    lens = [4096] * B
    kv, table, kv_len = paged_cache(B, lens, R, Dr, pt, torch.bfloat16, seed=7)
    q_lat = torch.randn(B, heads, R, device="cuda")
    q_rope = torch.randn(B, heads, Dr, device="cuda")
    args = (q_lat, q_rope, kv, table, kv_len, 192**-0.5, R)
    mla_decode_paged(*args, 16)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = mla_decode_paged(*args, 16)
    torch.cuda.current_stream().wait_stream(stream)
    for new_lens in ([1, 2, 3, 4, 5, 6, 7, 8], [4096, 1, 300, 2048, 4095, 17, 999, 256]):
        kv_len.copy_(torch.tensor(new_lens))
        table.copy_(table.flip(1))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, mla_decode_paged_reference(*args), torch.bfloat16)
