"""The flex_attention MLA backend against the reference (block masks on CPU; compiled kernel on GPU, marked `gpu`)."""

import warnings

import pytest
import torch

from helpers import rel_err
from k3.ops import mla, mla_flex
from k3.ops.mla import max_logit, mla_attention
from k3.ops.mla_flex import causal_block_mask, flex_available, flex_kernel_options, mla_attention_flex
from k3.ops.registry import FLEX_OPTION_KEYS, Backends, Target, backends_from_env

pytestmark = pytest.mark.skipif(not flex_available(Target(torch.device("cpu")))[0],
                                reason="this torch has no flex_attention")


def _qkv(B, T, H, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, 192, generator=g).to(device, dtype) for _ in range(2))
    v = torch.randn(B, T, H, 128, generator=g).to(device, dtype)
    return q, k, v


def _segments(B, T, seed):
    """Packed documents with boundaries anywhere (inside and on 128-token blocks), ids increasing per row."""
    g = torch.Generator().manual_seed(seed)
    seg = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        cuts = torch.randint(1, T, (int(torch.randint(0, 5, (1,), generator=g)),), generator=g).tolist()
        cuts += [128] if b == 0 and T > 128 else []
        for c in cuts:
            seg[b, c:] += 1
    return seg


@pytest.mark.parametrize("T,packed", [(100, False), (300, False), (300, True), (513, True)])
def test_block_mask_gives_the_reference_attention(T, packed):
    # Uncompiled flex on CPU computes every tile it is given with the element mask: this checks which tiles
    # the block mask lists (skipped / whole / masked). fp32, tolerance 1e-5 relative.
    q, k, v = _qkv(2, T, 3)
    seg = _segments(2, T, seed=T) if packed else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex without torch.compile warns that it is unfused
        o = mla_attention_flex(q, k, v, 0.07, segment_ids=seg, compiled=False)
    assert rel_err(o, mla_attention(q, k, v, 0.07, segment_ids=seg)) < 1e-5


def test_block_mask_skips_tiles_across_documents():
    T = 512  # four 128-token blocks; documents [0, 256) and [256, 512)
    seg = torch.tensor([[0] * 256 + [1] * 256])
    bm = causal_block_mask(T, torch.device("cpu"), seg)
    dense = bm.to_dense()[0, 0]  # [4, 4] 1 where a tile is computed
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]])
    assert torch.equal(dense.cpu().int(), expected.int())


def test_block_mask_is_built_once_per_batch():
    # Every MLA layer of a forward asks for the same mask: the second call returns the first one's object; another
    # tensor, the same tensor modified in place, or another length builds a new one.
    seg = torch.tensor([[0] * 256 + [1] * 256])
    cpu = torch.device("cpu")
    first = causal_block_mask(512, cpu, seg)
    assert causal_block_mask(512, cpu, seg) is first
    assert causal_block_mask(512, cpu, seg.clone()) is not first
    again = causal_block_mask(512, cpu, seg)
    seg[0, 100:] = 1  # documents [0, 100) and [100, 512) now
    changed = causal_block_mask(512, cpu, seg)
    assert changed is not again
    assert torch.equal(changed.to_dense()[0, 0].int(), torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0],
                                                                     [1, 1, 1, 1]]).int())
    assert causal_block_mask(384, cpu, seg[:, :384]) is not changed
    assert causal_block_mask(512, cpu, None) is not causal_block_mask(256, cpu, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("packed,autotune", [(False, False), (True, False), (True, True)],
                         ids=["causal", "packed", "packed-max-autotune"])
def test_compiled_flex_matches_reference_forward_backward_and_max_logit(packed, autotune):
    # bf16 on GPU against the fp32 reference: 2e-2 relative for outputs and gradients; the max logit
    # within bf16 rounding of q.k (1e-2 relative). max-autotune (K3_FLEX_AUTOTUNE=1) picks other block sizes.
    B, T, H = 2, 1024, 4
    q, k, v = (t.requires_grad_() for t in _qkv(B, T, H, "cuda", torch.bfloat16))
    seg = _segments(B, T, seed=1).cuda() if packed else None
    dy = torch.randn(B, T, H, 128, device="cuda")
    o, m = mla_attention_flex(q, k, v, 192 ** -0.5, seg, return_max_logit=True, autotune=autotune)
    grads = torch.autograd.grad((o.float() * dy).sum(), [q, k, v])
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    o_ref = mla_attention(q32, k32, v32, 192 ** -0.5, segment_ids=seg)
    g_ref = torch.autograd.grad((o_ref * dy).sum(), [q32, k32, v32])
    assert rel_err(o.float(), o_ref) < 2e-2
    for a, b in zip(grads, g_ref):
        assert rel_err(a.float(), b) < 2e-2
    assert rel_err(m, max_logit(q32, k32, 192 ** -0.5, seg)) < 1e-2


def test_flex_autotune_setting_is_checked():
    assert Backends().flex_autotune is False
    assert backends_from_env({}).flex_autotune is False
    assert backends_from_env({"K3_FLEX_AUTOTUNE": "1"}).flex_autotune is True
    with pytest.raises(ValueError, match="K3_FLEX_AUTOTUNE='yes' is invalid"):
        backends_from_env({"K3_FLEX_AUTOTUNE": "yes"})
    with pytest.raises(ValueError, match="flex_autotune='yes' is invalid"):
        Backends(flex_autotune="yes")


def test_flex_kernel_options_come_from_the_table_or_the_backends():
    # The compiled GPU test above runs with the table's tiles on the GPUs it lists (the H200's sm90 entry).
    q, _, v = _qkv(1, 8, 1)
    env = backends_from_env
    assert flex_kernel_options(q, v) is None  # CPU tensors: torch's defaults
    assert flex_kernel_options(q, v, env({})) is None
    opts = env({"K3_FLEX_KERNEL_OPTIONS": '{"bwd_BLOCK_M1": 32, "bwd_num_warps": 8}'})
    assert flex_kernel_options(q, v, opts) == {"bwd_BLOCK_M1": 32, "bwd_num_warps": 8}
    assert flex_kernel_options(q, v, Backends(flex_kernel_options={"bwd_num_warps": 8})) == {"bwd_num_warps": 8}
    assert flex_kernel_options(q, v, env({"K3_FLEX_KERNEL_OPTIONS": "{}"})) is None
    for bad, match in [("{bwd", "not valid JSON"), ('{"BLOCK_M": 64}', "keys among"),
                       ('{"fwd_num_warps": 0}', "positive integers"), ("[64]", "JSON object")]:
        with pytest.raises(ValueError, match=match):
            env({"K3_FLEX_KERNEL_OPTIONS": bad})
    with pytest.raises(ValueError, match="keys among"):
        Backends(flex_kernel_options={"BLOCK_M": 64})


def test_tuned_tables_use_the_keys_backends_accepts():
    # The per-GPU table and Backends.flex_kernel_options name the same flex_attention options (the registry holds
    # the key set, so that it checks a Backends without importing this op's files).
    for cap, opts in mla_flex._FLEX_TUNED.items():
        assert set(opts) <= FLEX_OPTION_KEYS, cap
        assert Backends(flex_kernel_options=opts).flex_kernel_options == opts


def test_max_logit_from_the_kernel_only_on_cuda():
    # flex_attention keeps no running maxima off CUDA: asking for them there is an error naming the reference's
    # blockwise max_logit (the op never sends CPU tensors to flex).
    q, k, v = _qkv(1, 8, 1)
    with pytest.raises(ValueError, match="CUDA only.*max_logit"):
        mla_attention_flex(q, k, v, 0.1, return_max_logit=True, compiled=False)


def test_flex_names_stay_importable_from_mla():
    for name in ("causal_block_mask", "compiled_flex", "flex_available", "flex_kernel_options", "mla_attention_flex"):
        assert getattr(mla, name) is getattr(mla_flex, name)
