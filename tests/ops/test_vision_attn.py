"""Op vision_attn: block-diagonal attention over packed images, its reference against an explicit float64 softmax,
the flex block mask on CPU (eager flex), and the GPU paths (varlen, compiled flex; marked `gpu`).

Tolerances: fp32 against float64 or fp32 against fp32, 1e-5 of the largest magnitude; bf16 fast paths against the
fp32 reference, outputs and gradients 2e-2 (bf16 rounding of q.k and of the output)."""

import math
import warnings

import pytest
import torch

from helpers import rel_err
from k3.ops.registry import Backends, Target, dispatch, ops
from k3.ops.vision_attn import (ImagePacking, flex_available, image_block_mask, vision_attention,
                                vision_attention_flex, vision_attention_reference, vision_attention_varlen)

HAS_FLEX = flex_available(Target(torch.device("cpu")))[0]


def _qkv(T, H=3, D=16, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(T, H, D, generator=g).to(device, dtype) for _ in range(3))


def dense_reference(q, k, v, lengths):
    """softmax(q k^T / sqrt(D) + mask) v in float64 with an explicit [T, T] block-diagonal mask."""
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = seg[:, None] == seg[None, :]
    q, k, v = q.double(), k.double(), v.double()
    s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(s, -1), v)


# Image patch counts: one image, boundaries inside and on 128-token tiles, many small images, one long.
PACKINGS = [(40,), (24, 64, 168, 8, 24), (128, 256, 100), (4,) * 37, (300, 1, 77)]


@pytest.mark.parametrize("lengths", PACKINGS)
def test_reference_is_block_diagonal_softmax_attention(lengths):
    T = sum(lengths)
    q, k, v = _qkv(T, seed=T)
    assert rel_err(vision_attention_reference(q, k, v, ImagePacking(lengths)), dense_reference(q, k, v, lengths)) < 1e-5


def test_no_attention_across_images():
    lengths = (24, 64, 30)
    q, k, v = _qkv(sum(lengths))
    o = vision_attention_reference(q, k, v, ImagePacking(lengths))
    v2 = v.clone()
    v2[24:88] += 1.0  # only the second image's values change
    k2 = k.clone()
    k2[24:88] *= 2.0
    o2 = vision_attention_reference(q, k2, v2, ImagePacking(lengths))
    assert torch.equal(o[:24], o2[:24]) and torch.equal(o[88:], o2[88:])
    assert not torch.allclose(o[24:88], o2[24:88])


def test_dispatch_keeps_the_reference_on_cpu_and_names_what_the_fast_paths_need():
    q, _, _ = _qkv(8)
    assert dispatch("vision_attn", q).name == "torch"
    for name in ("varlen", "flex"):
        with pytest.raises(ValueError, match=f"vision_attn={name} needs CUDA"):
            dispatch("vision_attn", q, Backends(per_op={"vision_attn": name}))
    op = ops()["vision_attn"]
    assert [f.name for f in op.fast] == ["varlen", "flex"]
    ok, why = op.fast[0].available(Target(torch.device("cuda"), torch.float32))
    assert not ok and "bf16/fp16" in why
    # auto on CUDA (both paths validated on a GPU): varlen for bf16 where this torch has it; fp32 goes to flex (varlen
    # takes bf16/fp16 only) where flex can run, else the reference
    cuda16, cuda32 = Target(torch.device("cuda"), torch.bfloat16), Target(torch.device("cuda"), torch.float32)
    assert [f.validated for f in op.fast] == [True, True]
    assert dispatch("vision_attn", cuda16).name == ("varlen" if op.fast[0].available(cuda16)[0] else
                                                    "flex" if op.fast[1].available(cuda16)[0] else "torch")
    assert dispatch("vision_attn", cuda32).name == ("flex" if op.fast[1].available(cuda32)[0] else "torch")


def test_packing_is_checked():
    for bad in [(3, 0), (2, -1), (2.0,), (True,)]:
        with pytest.raises(ValueError, match="positive int"):
            ImagePacking(bad)
    p = ImagePacking((3, 5))
    assert p.offsets == (0, 3, 8) and p.total == 8 and p.max_len == 5 and len(p) == 2
    assert p.cu_seqlens(torch.device("cpu")).tolist() == [0, 3, 8]
    assert p.segment_ids(torch.device("cpu")).tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    q, k, v = _qkv(9)
    with pytest.raises(ValueError, match=r"total tokens = 8"):
        vision_attention(q, k, v, p)


@pytest.mark.skipif(not HAS_FLEX, reason="this torch has no flex_attention")
@pytest.mark.parametrize("lengths", PACKINGS)
def test_flex_block_mask_gives_the_reference(lengths):
    # Uncompiled flex on CPU computes every tile the block mask lists with the element mask: this checks which
    # tiles it lists (skipped / whole / masked). fp32, 1e-5.
    T = sum(lengths)
    q, k, v = _qkv(T, seed=T + 1)
    p = ImagePacking(lengths)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex without torch.compile warns that it is unfused
        o = vision_attention_flex(q, k, v, p, compiled=False)
    assert rel_err(o, vision_attention_reference(q, k, v, p)) < 1e-5


@pytest.mark.skipif(not HAS_FLEX, reason="this torch has no flex_attention")
def test_flex_block_mask_skips_tiles_across_images():
    # images [0, 128), [128, 384), [384, 484): tiles 0 | 1, 2 | 3 (tile 3 = tokens 384..483, one image)
    dense = image_block_mask(ImagePacking((128, 256, 100)), torch.device("cpu")).to_dense()[0, 0]
    assert dense.int().tolist() == [[1, 0, 0, 0], [0, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 1]]
    # a tile shared by two images is computed against both images' tiles
    dense = image_block_mask(ImagePacking((100, 200)), torch.device("cpu")).to_dense()[0, 0]
    assert dense.int().tolist() == [[1, 1, 1], [1, 1, 1], [1, 1, 1]]
    p = ImagePacking((100, 200))
    assert p.block_mask(torch.device("cpu")) is p.block_mask(torch.device("cpu"))  # built once, for every layer


# --- GPU (not run on CPU) ------------------------------------------------------------------------------------------
def _fwd_bwd(fn, q, k, v, packing, dy):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v, packing)
    return (o, *torch.autograd.grad((o.float() * dy).sum(), [q, k, v]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name,dtype,tol", [("varlen", torch.bfloat16, 2e-2), ("flex", torch.bfloat16, 2e-2),
                                            ("flex", torch.float32, 1e-5)])
@pytest.mark.parametrize("lengths", [(1024,), (24, 64, 1680, 8, 2400, 256), (4,) * 300])
def test_gpu_fast_path_matches_reference_forward_and_backward(name, dtype, tol, lengths):
    T, H, D = sum(lengths), 4, 128  # the release's head_dim
    q, k, v = _qkv(T, H, D, "cuda", dtype, seed=T)
    dy = torch.randn(T, H, D, device="cuda")
    p = ImagePacking(lengths)
    fn = {"varlen": vision_attention_varlen, "flex": vision_attention_flex}[name]
    got = _fwd_bwd(fn, q, k, v, p, dy)
    want = _fwd_bwd(vision_attention_reference, q.float(), k.float(), v.float(), p, dy)
    for a, b in zip(got, want):
        assert rel_err(a.float(), b) < tol
    assert dispatch("vision_attn", q, Backends(per_op={"vision_attn": name})).name == name
