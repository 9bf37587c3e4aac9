"""The AttnRes stream with fused sites (k3.model.attn_res: each site and its norm as op ``attn_res_norm``, the
sublayer outputs' adds pending until the next site) against the stream as composed ops, in the model and the engine.

The fused kernel runs in Triton's interpreter here (TRITON_INTERPRET=1, per_op {"attn_res_norm": "triton"}).
Tolerances: fp32 1e-5 of the largest entry (the op's own, compounded over a few layers of tiny); bf16 hidden states
3e-2 (the interpreter truncates each bf16 rounding, and the differences pass through every later layer).
"""

import pytest
import torch

from helpers import count_fast_calls, rel_err
from k3.config import K3Config
from k3.model.model import K3ForCausalLM
from k3.ops.registry import Backends

FUSED = Backends(per_op={"attn_res_norm": "triton"})


@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def calls(monkeypatch):
    """The calls of the fused kernel (the registered implementation wrapped)."""
    return count_fast_calls(monkeypatch, "attn_res_norm")


def _model(dtype=torch.float32, mtp=0, vocab=None):
    cfg = K3Config.from_preset("tiny").replace(num_nextn_predict_layers=mtp)
    if vocab:
        cfg = cfg.replace(vocab_size=vocab)
    torch.manual_seed(0)
    from helpers import randomize_

    # non-zero AttnRes queries, so the depth softmax is not uniform
    return randomize_(K3ForCausalLM(cfg).init_weights(seed=0)).set_dtype(dtype).eval()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_fused_sites_equal_the_composed_stream(interpret, calls, dtype, tol):
    m = _model(dtype)
    ids = torch.randint(0, m.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, _, feats_ref = m.model(ids, features=(1, 2, 3))
        assert not calls  # CPU, auto: the reference composition
        m.set_backends(FUSED)
        got, _, feats = m.model(ids, features=(1, 2, 3))
    L = len(m.model.layers)
    assert len(calls) == 2 * L  # every site but layer 0's mixer site (it has no completed block to mix)
    assert rel_err(got.float(), ref.float()) <= tol
    # the block outputs (the last block's read while a sublayer output is still pending) are the same sums
    for f, r in zip(feats, feats_ref):
        assert rel_err(f.float(), r.float()) <= tol


def test_training_forwards_never_fuse(interpret, calls):
    # with gradients the stream keeps the composed ops (the fused kernel has no backward), whatever the backends say
    m = _model().train().set_backends(FUSED)
    ids = torch.randint(0, m.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(2))
    m(ids, labels=ids).loss.backward()
    assert not calls


def test_fused_sites_in_the_engine_keep_greedy_output(interpret, calls):
    # the serving engine's prefill and decode forwards (and the MTP draft's, speculating) with the fused sites give
    # the tokens of the composed stream
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.sampling import SamplingParams

    m = _model(mtp=1, vocab=256)
    prompt = torch.randint(1, 256, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    outs = []
    for backends in (None, FUSED):
        m.set_backends(backends)
        for spec in ("off", "mtp"):
            eng = LLMEngine(m, None, EngineConfig(cache_memory_mb=4.0, page_tokens=32, hash_block_tokens=16,
                                                  speculative=spec, num_draft_tokens=2))
            eng.eos_id = None
            seq = eng.add_request(prompt, SamplingParams(max_tokens=6, temperature=0))
            while eng.has_work():
                eng.step()
            outs.append(seq.output_ids)
        if backends is None:
            assert not calls
    assert calls and outs[1:] == outs[:1] * 3


def test_a_stream_that_fuses_adds_on_read(interpret):
    # the pending add is done by whoever reads the partial sum: two adds in a row, then a read, give the plain sum
    from k3.model.attn_res import AttnResStream

    g = torch.Generator().manual_seed(0)
    e, a, b = (torch.randn(2, 3, 16, generator=g) for _ in range(3))
    s = AttnResStream(e, 4, 1e-5, backends=FUSED, fuse=True)
    assert s.fused
    s.add(a)
    s.add(b)
    assert torch.equal(s.partial, e + a + b)
    assert not AttnResStream(e, 4, 1e-5, fuse=True).fused  # CPU, auto: the reference, no pending adds
    assert not AttnResStream(e, 4, 1e-5, backends=FUSED, fuse=True, two_phase=True).fused
