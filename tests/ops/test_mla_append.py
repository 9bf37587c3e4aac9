"""The MLA latent rows' write into the page pool as one kernel (op ``mla_append``, k3.ops.mla_append) against the
PyTorch write: the same pool bytes and the same lengths, exactly (Triton's interpreter on CPU, except fp32 rows cast
into a bf16 pool, which the interpreter truncates: within one bf16 step; compiled on a GPU in the `gpu` test, bf16),
and in the serving engine."""

import pytest
import torch

from k3.ops.mla_append import mla_append, mla_append_triton


@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _case(B, T, pool_dtype, row_dtype, device="cpu", pt=8, R=40, Dr=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages = 4 * B + 3
    # a page stride past one page's rows, as the pool's typed view has (pages of the larger page kind)
    raw = torch.randn(pages, pt * (R + Dr) + 16, generator=g).to(device, pool_dtype)
    kv = raw[:, :pt * (R + Dr)].view(pages, pt, R + Dr)
    tables = torch.stack([torch.randperm(pages, generator=g)[:4] for _ in range(B)]).to(device)
    pos = torch.randint(0, 4 * pt - T, (B,), generator=g).to(device)
    pos[0] = pt - 1  # the rows of request 0 cross a page boundary (T > 1)
    c = torch.randn(B, T, R, generator=g).to(device, row_dtype)
    k_rope = torch.randn(B, T, Dr, generator=g).to(device, row_dtype)
    return raw, kv, tables, pos, c, k_rope


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("pool_dtype,row_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                  (torch.bfloat16, torch.float32)], ids=["fp32", "bf16", "cast"])
def test_interpreted_kernel_writes_what_the_reference_writes(interpret, T, pool_dtype, row_dtype):
    raw, kv, tables, pos, c, k_rope = _case(3, T, pool_dtype, row_dtype)
    raw2 = raw.clone()
    kv2 = raw2[:, :kv.shape[1] * kv.shape[2]].view(kv.shape)
    want = mla_append(kv, tables, pos, c, k_rope)
    got = mla_append_triton(kv2, tables, pos, c, k_rope)
    assert torch.equal(got, want) and want.shape == (3 * T,) and torch.equal(want[:T], pos[0] + 1 + torch.arange(T))
    if pool_dtype == row_dtype:
        assert torch.equal(raw2, raw)  # every byte, the bytes past each page's rows included
    else:  # the interpreter casts fp32 to bf16 by truncation (a GPU rounds to nearest, as PyTorch: the gpu test)
        assert torch.allclose(raw2.float(), raw.float(), rtol=2 ** -7, atol=0)
    assert not torch.equal(raw, _case(3, T, pool_dtype, row_dtype)[0])  # the write did change the pool


def test_strided_positions_and_tables(interpret):
    # positions and block tables as the static decode buffers hand them: views with strides (a column of a wider
    # tensor, a table of one MLA layer out of several)
    raw, kv, tables, pos, c, k_rope = _case(3, 2, torch.float32, torch.float32)
    wide_pos = torch.stack([pos, pos + 100], 1)[:, 0]
    wide_tab = torch.stack([tables, tables.flip(1)], 1)[:, 0]
    assert wide_pos.stride(0) != 1 and wide_tab.stride(0) != tables.stride(0)
    raw2 = raw.clone()
    kv2 = raw2[:, :kv.shape[1] * kv.shape[2]].view(kv.shape)
    assert torch.equal(mla_append_triton(kv2, wide_tab, wide_pos, c, k_rope), mla_append(kv, tables, pos, c, k_rope))
    assert torch.equal(raw2, raw)


def test_bad_inputs_are_named(interpret):
    _, kv, tables, pos, c, k_rope = _case(2, 1, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="pool rows of R \\+ Dr = 48"):
        mla_append_triton(kv[:, :, :40], tables, pos, c, k_rope)
    with pytest.raises(ValueError, match="need B=2 tables and positions"):
        mla_append_triton(kv, tables[:1], pos, c, k_rope)
    with pytest.raises(ValueError, match="integer tensors"):
        mla_append_triton(kv, tables, pos.float(), c, k_rope)


def test_the_engine_with_the_kernel_keeps_greedy_output(interpret):
    # a served tiny model with the paged decode: prefill, then decode steps writing their rows through the kernel
    from k3.config import K3Config
    from k3.model.model import K3ForCausalLM
    from k3.ops.registry import Backends
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.sampling import SamplingParams

    cfg = K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0, vocab_size=256)
    m = K3ForCausalLM(cfg).init_weights(seed=4).eval()
    prompts = [torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 30)]
    outs = []
    for backends in (Backends(per_op={"mla_decode": "triton"}),
                     Backends(per_op={"mla_decode": "triton", "mla_append": "triton"})):
        m.set_backends(backends)
        eng = LLMEngine(m, None, EngineConfig(cache_memory_mb=4.0, page_tokens=16, hash_block_tokens=16))
        eng.eos_id = None
        seqs = [eng.add_request(p, SamplingParams(max_tokens=20, temperature=0)) for p in prompts]
        while eng.has_work():
            eng.step()
        outs.append([s.output_ids for s in seqs])
    assert outs[0] == outs[1]  # decode rows cross page boundaries (16-token pages, 20 new tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B,T", [(1, 1), (64, 1), (16, 4)])
def test_gpu_kernel_writes_what_the_reference_writes(B, T):
    raw, kv, tables, pos, c, k_rope = _case(B, T, torch.bfloat16, torch.bfloat16, device="cuda", pt=64, R=512,
                                            Dr=64)
    raw2 = raw.clone()
    kv2 = raw2[:, :kv.shape[1] * kv.shape[2]].view(kv.shape)
    assert torch.equal(mla_append_triton(kv2, tables, pos, c, k_rope), mla_append(kv, tables, pos, c, k_rope))
    assert torch.equal(raw2, raw)
