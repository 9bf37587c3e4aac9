"""The prompt's own boundary checkpoint: the same prompt sent again starts from the last hash-aligned position before
its last token, and a continuation whose earlier reply changed (reasoning dropped from the history) starts at the
prompt's boundary even after decoding moved the request's newest checkpoint on. Both hits equal a cold engine's
greedy tokens (the restored states are the ones a plain prefill computes)."""

import torch

from k3.config import K3Config
from k3.model.model import K3ForCausalLM
from k3.serve.cache.prefix import prompt_boundary
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams

HB = 16


def _engine(model):
    eng = LLMEngine(model, None, EngineConfig(cache_memory_mb=16.0, page_tokens=32, hash_block_tokens=HB))
    eng.eos_id = None
    return eng


def _run(eng, prompt, max_tokens):
    s = eng.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    while eng.has_work():
        eng.step()
    return s


def test_prompt_boundary():
    assert [prompt_boundary(n, 16) for n in (0, 1, 16, 17, 32, 430, 800)] == [0, 0, 0, 16, 16, 416, 784]


def test_the_same_prompt_again_and_a_changed_reply_start_at_the_prompts_boundary():
    cfg = K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0, vocab_size=256)
    model = K3ForCausalLM(cfg).init_weights(seed=3).eval()
    g = torch.Generator().manual_seed(0)
    base = torch.randint(1, 256, (1000,), generator=g).tolist()
    eng = _engine(model)
    assert _run(eng, base[:432], 2).cached_tokens == 0
    assert _run(eng, base[:800], 2).cached_tokens == 432  # a prompt ending on a block boundary, extended from a hit
    again = _run(eng, base[:800], 2)
    assert again.cached_tokens == 784  # was 432: the checkpoint at 800 cannot serve a lookup of 800 tokens
    # decoding crosses a block boundary (430 + 3 -> 432): the request's newest checkpoint moves to 432, whose hash
    # covers its sampled tokens; the prompt's boundary at 416 stays for a continuation with another reply
    other = torch.randint(1, 256, (440,), generator=g).tolist()
    _run(eng, other[:430], 3)
    cont = _run(eng, other[:430] + [7, 7, 7, 7], 2)
    assert cont.cached_tokens == 416  # was 0
    cold = _engine(model)
    assert _run(cold, base[:800], 2).output_ids == again.output_ids
    assert _run(cold, other[:430] + [7, 7, 7, 7], 2).output_ids == cont.output_ids
