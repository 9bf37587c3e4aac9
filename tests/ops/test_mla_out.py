"""Gated MLA's value absorption and output gate kernels (ops ``mla_absorb_v`` and ``mla_gate``, k3.ops.mla_out)
against their definitions, and in the serving engine.

CPU tests run the kernels in Triton's interpreter (TRITON_INTERPRET=1, set in-process); the `gpu` tests run them
compiled at k3-mini's and the release's shapes. Tolerances, relative to the largest reference entry: fp32 1e-5 for
the absorption (the same products summed in another order) and 1e-6 for the gate (a sigmoid from one exponential);
bf16 one bf16 step on a GPU (2^-7: the same fp32 values rounded once), two in the interpreter, which truncates.
"""

import pytest
import torch

from helpers import count_fast_calls, rel_err
from k3.ops.mla import split_kv_b
from k3.ops.mla_out import (combine_splits, mla_absorb_v, mla_absorb_v_triton, mla_combine_absorb_v,
                            mla_combine_absorb_v_gate, mla_combine_absorb_v_gate_triton, mla_combine_absorb_v_triton,
                            mla_gate, mla_gate_any, mla_gate_triton)


@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _absorb_inputs(B, H, Dn, Dv, R, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    o_lat = torch.randn(B, H, R, generator=g).to(device)
    kv_b = (torch.randn(H * (Dn + Dv), R, generator=g) / R ** 0.5).to(device, dtype)
    _, w_vc = split_kv_b(kv_b, H, Dn, Dv)  # a strided view of the checkpoint's weight, as the layer passes it
    return o_lat, w_vc


def _gate_inputs(shape, dtype, device="cpu", seed=0, strided=True):
    g = torch.Generator().manual_seed(seed)
    if strided:  # the gate as a column slice of the stacked projections' output
        wide = (torch.randn(*shape[:-1], shape[-1] + 48, generator=g) * 3).to(device, dtype)
        gate = wide[..., 16:16 + shape[-1]]
    else:
        gate = (torch.randn(*shape, generator=g) * 3).to(device, dtype)
    return gate, torch.randn(*shape, generator=g).to(device, dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -6)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,H,Dn,Dv,R", [(1, 2, 32, 32, 32), (3, 8, 16, 40, 200)], ids=["tiny", "odd"])
def test_interpreted_absorption_matches_the_definition(interpret, dtype, tol, B, H, Dn, Dv, R):
    o_lat, w_vc = _absorb_inputs(B, H, Dn, Dv, R, dtype)
    assert not w_vc.is_contiguous()
    want = mla_absorb_v(o_lat, w_vc, dtype)
    got = mla_absorb_v_triton(o_lat, w_vc, dtype)
    assert got.dtype == dtype and got.shape == (B, H, Dv)
    assert rel_err(got.float(), want.float()) <= tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2 ** -6)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strided", [True, False], ids=["slice", "contiguous"])
def test_interpreted_gate_matches_the_definition(interpret, dtype, tol, strided):
    gate, o = _gate_inputs((2, 3, 1100), dtype, strided=strided)  # more columns than one block
    want = mla_gate(gate, o, dtype)
    got = mla_gate_triton(gate, o, dtype)
    assert got.dtype == dtype and got.shape == o.shape
    assert rel_err(got.float(), want.float()) <= tol
    g = gate.clone()
    g[0, 0, :4] = torch.tensor([-200.0, 200.0, 0.0, -90.0], dtype=dtype)  # saturated gates: 0 and o, never NaN
    got = mla_gate_triton(g, o, dtype)
    assert torch.isfinite(got).all() and got[0, 0, 0] == 0 and got[0, 0, 1] == o[0, 0, 1]


def _partials(B, S, H, R, seed=0, device="cpu"):
    """Split partials [B, S, H, R] and their lse [B, S, H] (base 2): row 0's split 1 empty (-inf), row 1 every
    split empty (a padding row: its output 0)."""
    g = torch.Generator().manual_seed(seed)
    part = torch.randn(B, S, H, R, generator=g).to(device)
    lse = (torch.randn(B, S, H, generator=g) * 4).to(device)
    if S > 1:
        lse[0, 1] = float("-inf")
        part[0, 1] = 0.0
    if B > 1:
        lse[1] = float("-inf")
        part[1] = 0.0
    return part, lse


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -6)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("S", [1, 3, 40])
def test_interpreted_combined_absorption_matches_the_definition(interpret, dtype, tol, S):
    # R not a multiple of the column block; one split: the partials are the output itself (no lse)
    part, lse = _partials(3, S, 4, 200)
    _, w_vc = _absorb_inputs(3, 4, 16, 40, 200, dtype)
    lse = None if S == 1 else lse
    got, want = mla_combine_absorb_v_triton(part, lse, w_vc, dtype), mla_combine_absorb_v(part, lse, w_vc, dtype)
    assert got.shape == (3, 4, 40) and got.dtype == dtype
    assert rel_err(got.float(), want.float()) <= tol
    if S > 1:
        assert not got[1].any()  # every split empty
        # not vacuous: the partials combined with equal weights are far
        assert rel_err(mla_combine_absorb_v_triton(part, torch.zeros_like(lse), w_vc, dtype).float(),
                       want.float()) > 1e-2
    assert combine_splits(part, lse).shape == (3, 4, 200)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -6)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("S", [1, 3])
def test_interpreted_gated_absorption_is_the_absorption_then_the_gate(interpret, dtype, tol, S):
    # op mla_combine_absorb_v_gate: the combine-absorption kernel's output rounded, then the gate kernel's product,
    # in one kernel: bit for bit the two kernels one after the other (the gate a row-strided slice), and the
    # reference within its tolerance
    part, lse = _partials(3, S, 4, 200)
    _, w_vc = _absorb_inputs(3, 4, 16, 40, 200, dtype)
    lse = None if S == 1 else lse
    gate, _ = _gate_inputs((3, 4 * 40), dtype)
    assert gate.stride(0) != gate.shape[1]
    got = mla_combine_absorb_v_gate_triton(part, lse, w_vc, gate, dtype)
    two = mla_gate_triton(gate, mla_combine_absorb_v_triton(part, lse, w_vc, dtype).reshape(3, -1), dtype)
    assert got.shape == (3, 4, 40) and got.dtype == dtype
    assert torch.equal(got.reshape(3, -1), two)
    want = mla_combine_absorb_v_gate(part, lse, w_vc, gate, dtype)
    assert rel_err(got.float(), want.float()) <= tol
    # not vacuous: the ungated output is far
    assert rel_err(mla_combine_absorb_v_triton(part, lse, w_vc, dtype).float(), want.float()) > 1e-2
    with pytest.raises(ValueError, match=r"gate must be a floating tensor \[B=3, H \* Dv=160\]"):
        mla_combine_absorb_v_gate_triton(part, lse, w_vc, gate[:, :100], dtype)


def test_combined_absorption_bad_inputs_are_named(interpret):
    part, lse = _partials(2, 3, 4, 32)
    _, w_vc = _absorb_inputs(2, 4, 16, 8, 32, torch.float32)
    with pytest.raises(ValueError, match="need their lse"):
        mla_combine_absorb_v_triton(part, None, w_vc, torch.float32)
    with pytest.raises(ValueError, match="lse must be"):
        mla_combine_absorb_v_triton(part, lse[:, :2], w_vc, torch.float32)
    with pytest.raises(ValueError, match="part must be"):
        mla_combine_absorb_v_triton(part[0], lse, w_vc, torch.float32)


def test_wrong_kernels_are_caught(interpret):
    # the comparisons are not vacuous: a gate without its sigmoid and an absorption with one head's weights swapped
    gate, o = _gate_inputs((4, 64), torch.float32)
    assert rel_err(o * gate, mla_gate(gate, o, torch.float32)) > 1e-2
    o_lat, w_vc = _absorb_inputs(2, 2, 8, 8, 32, torch.float32)
    assert rel_err(mla_absorb_v_triton(o_lat, w_vc.flip(0), torch.float32), mla_absorb_v(o_lat, w_vc, torch.float32)) \
        > 1e-2


def test_bad_inputs_are_named(interpret):
    o_lat, w_vc = _absorb_inputs(2, 2, 8, 8, 32, torch.float32)
    with pytest.raises(ValueError, match="o_lat must be an fp32 tensor"):
        mla_absorb_v_triton(o_lat.bfloat16(), w_vc, torch.bfloat16)
    with pytest.raises(ValueError, match=r"w_vc must be a floating tensor \[H=2, Dv, R=32\]"):
        mla_absorb_v_triton(o_lat, w_vc[:, :, :16], torch.float32)
    gate, o = _gate_inputs((4, 64), torch.float32)
    with pytest.raises(ValueError, match="gate and o must be floating tensors of one shape"):
        mla_gate_triton(gate, o[:, :32], torch.float32)
    with pytest.raises(RuntimeError, match="no backward"):
        mla_gate_triton(gate.clone().requires_grad_(), o, torch.float32)
    # with gradients the model's calls take the differentiable reference whatever the backends say
    from k3.ops.registry import Backends

    g = gate.clone().requires_grad_()
    mla_gate_any(g, o, torch.float32, Backends(per_op={"mla_gate": "triton"})).sum().backward()
    assert g.grad is not None


def test_the_engine_with_the_kernels_keeps_greedy_output(interpret, monkeypatch):
    # a served tiny model (fp32) with the paged decode kernel, the value absorption and the gate as kernels: the
    # greedy tokens of the reference ops, and the kernels were called
    from k3.config import K3Config
    from k3.model.model import K3ForCausalLM
    from k3.ops.registry import Backends
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.sampling import SamplingParams

    calls = count_fast_calls(monkeypatch, "mla_absorb_v", "mla_gate")
    cfg = K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0, vocab_size=256)
    m = K3ForCausalLM(cfg).init_weights(seed=2).eval()
    prompt = torch.randint(1, 256, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    outs = []
    for backends in (Backends(per_op={"mla_decode": "triton"}),
                     Backends(per_op={"mla_decode": "triton", "mla_absorb_v": "triton", "mla_gate": "triton"})):
        m.set_backends(backends)
        eng = LLMEngine(m, None, EngineConfig(cache_memory_mb=4.0, page_tokens=32, hash_block_tokens=16))
        eng.eos_id = None
        seq = eng.add_request(prompt, SamplingParams(max_tokens=6, temperature=0))
        while eng.has_work():
            eng.step()
        outs.append(seq.output_ids)
        if len(outs) == 1:
            assert not calls
    assert "mla_absorb_v" in calls and "mla_gate" in calls and outs[0] == outs[1]


@pytest.mark.parametrize("graphs", [False, "eager"], ids=["eager-runner", "static-buffers"])
def test_the_gate_inside_the_absorption_keeps_greedy_output(interpret, monkeypatch, graphs):
    # a served tiny model (fp32) speculating with its MTP layer, the gate applied inside the combine-absorption
    # kernel (op mla_combine_absorb_v_gate) by the pool's views (eager runner, static-buffer steps) and the draft's
    # chains: the greedy tokens of the two kernels one after the other, and the kernel was called
    from k3.config import K3Config
    from k3.model.model import K3ForCausalLM
    from k3.ops.registry import Backends
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.sampling import SamplingParams

    calls = count_fast_calls(monkeypatch, "mla_combine_absorb_v_gate")
    cfg = K3Config.from_preset("tiny").replace(vocab_size=256)
    m = K3ForCausalLM(cfg).init_weights(seed=2).eval()
    prompt = torch.randint(1, 256, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    base = {"mla_decode": "triton", "moe": "grouped", "mla_combine_absorb_v": "triton"}
    outs = []
    for extra in ({}, {"mla_combine_absorb_v_gate": "triton"}):
        m.set_backends(Backends(per_op={**base, **extra}))
        eng = LLMEngine(m, None, EngineConfig(cache_memory_mb=4.0, page_tokens=32, hash_block_tokens=16,
                                              speculative="mtp", num_draft_tokens=2, cuda_graphs=graphs))
        eng.eos_id = None
        seq = eng.add_request(prompt, SamplingParams(max_tokens=6, temperature=0))
        while eng.has_work():
            eng.step()
        outs.append(seq.output_ids)
        if not extra:
            assert not calls
    m.set_backends(None)
    assert calls and outs[0] == outs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B", [1, 16, 64])
@pytest.mark.parametrize("H,R", [(8, 256), (96, 512)], ids=["k3-mini", "release"])
def test_gpu_kernels_match_the_definitions(B, H, R):
    with torch.no_grad():
        for dtype, tol in ((torch.bfloat16, 2 ** -7), (torch.float32, 1e-5)):
            o_lat, w_vc = _absorb_inputs(B, H, 128, 128, R, dtype, device="cuda")
            assert rel_err(mla_absorb_v_triton(o_lat, w_vc, dtype).float(),
                           mla_absorb_v(o_lat, w_vc, dtype).float()) <= tol
            # the decode's split partials combined inside the absorption (op mla_combine_absorb_v), 1 and 16 splits
            for S in (1, 16):
                part, lse = _partials(B, S, H, R, device="cuda")
                lse = None if S == 1 else lse
                assert rel_err(mla_combine_absorb_v_triton(part, lse, w_vc, dtype).float(),
                               mla_combine_absorb_v(part, lse, w_vc, dtype).float()) <= tol
            gate, o = _gate_inputs((B, H * 128), dtype, device="cuda")
            assert rel_err(mla_gate_triton(gate, o, dtype).float(), mla_gate(gate, o, dtype).float()) <= max(tol, 1e-6)
            # the gate inside the combine-absorption kernel (op mla_combine_absorb_v_gate): the two kernels' values
            for S in (1, 16):
                part, lse = _partials(B, S, H, R, device="cuda")
                lse = None if S == 1 else lse
                got = mla_combine_absorb_v_gate_triton(part, lse, w_vc, gate, dtype)
                two = mla_gate_triton(gate, mla_combine_absorb_v_triton(part, lse, w_vc, dtype).reshape(B, -1), dtype)
                near = 2 ** -7 if dtype == torch.bfloat16 else 1e-6
                assert rel_err(got.reshape(B, -1).float(), two.float()) <= near
                assert rel_err(got.float(), mla_combine_absorb_v_gate(part, lse, w_vc, gate, dtype).float()) <= \
                    max(tol, 2 ** -6 if dtype == torch.bfloat16 else 1e-5)
