"""The EAGLE-3 draft in the engine: loaded from its directory (EngineConfig.speculative='eagle3'), fed the target's
block features of committed positions, greedy output equal to decoding without speculation; at W_E3 = [0 0 I] it
proposes exactly what the MTP draft proposes."""

import copy
import functools

import pytest
import torch

from helpers import randomize_
from k3.config import K3Config
from k3.draft_checkpoint import DraftError, save_draft
from k3.model.eagle3 import Eagle3Layer
from k3.model.model import K3ForCausalLM
from k3.ops.registry import Backends
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import SchedulerConfig
from k3.serve.sequence import Status
from k3.serve.speculative.draft import Eagle3Draft

VOCAB = 512


@functools.lru_cache(maxsize=1)
def _model():
    cfg = K3Config.from_preset("tiny").replace(vocab_size=VOCAB, eos_token_id=0)  # one MTP layer, 3 AttnRes blocks
    m = randomize_(K3ForCausalLM(cfg), seed=3).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(40)  # wide logit gaps: greedy choices do not hinge on last-bit rounding
    return m


def _engine(spec="off", draft_dir=None, k=3, graphs=False):
    # static buffers need the ops a captured step runs (on CPU the paged MLA decode runs its reference)
    model = copy.deepcopy(_model()).set_backends(Backends(per_op={"mla_decode": "triton", "moe": "grouped"})) \
        if graphs else _model()
    eng = LLMEngine(model, None, EngineConfig(
        cache_memory_mb=4.0, page_tokens=48, hash_block_tokens=16, speculative=spec,
        draft=None if draft_dir is None else str(draft_dir), num_draft_tokens=k,
        cuda_graphs="eager" if graphs else False,
        scheduler=SchedulerConfig(max_step_tokens=96, prefill_chunk=40, max_num_seqs=8)))
    eng.eos_id = None
    return eng


def _eagle_engine(draft_dir, k=3, graphs=False):
    return _engine("eagle3", draft_dir, k, graphs)


def _prompts(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(1, VOCAB, (120,), generator=g).tolist()
    return [base[: 20 + 13 * i] + torch.randint(1, VOCAB, (i % 3,), generator=g).tolist() for i in range(n)]


def _run(eng, prompts, params):
    # named requests: the default ids come from a process-wide counter, which the other spec tests' schedules
    # would otherwise see shifted
    seqs = [eng.add_request(list(p), params, request_id=f"eagle3-{i}") for i, p in enumerate(prompts)]
    for _ in range(3000):
        if not eng.has_work():
            break
        eng.step()
    assert all(s.status == Status.FINISHED for s in seqs)
    return [s.output_ids for s in seqs]


def _run_recorded(eng, prompts, params):
    """`_run`, recording the draft's proposals: (outputs, (proposals, drafts accepted, verifications))."""
    proposed = []
    inner = eng.draft.propose

    def record(seqs, ks, **kw):
        out = inner(seqs, ks, **kw)
        proposed.extend(out)  # drafts left on the device get their tokens at the verification's read-back
        return out

    eng.draft.propose = record
    out = _run(eng, prompts, params)
    return out, ([tuple(p.tokens) for p in proposed], eng.metrics.draft_tokens_accepted, eng.metrics.spec_verifications)


def test_eagle3_draft_from_its_directory_matches_plain_decoding(tmp_path):
    draft = Eagle3Layer.from_target(_model())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the fused features matter: W_E3 away from [0 0 I]
        draft.fc.weight.add_(torch.randn(draft.fc.weight.shape, generator=g) * 0.05)
    save_draft(draft, str(tmp_path / "d"), "test-target")
    eng = _eagle_engine(tmp_path / "d")
    assert isinstance(eng.draft, Eagle3Draft) and eng.draft.features == (1, 2)
    prompts = _prompts(1, 3)
    params = SamplingParams(max_tokens=12, temperature=0)
    assert _run(eng, prompts, params) == _run(_engine(), prompts, params)  # one batch of three requests each
    assert eng.metrics.spec_verifications > 0
    with pytest.raises(ValueError, match="needs the draft's directory"):
        LLMEngine(_model(), None, EngineConfig(speculative="eagle3"))
    with pytest.raises(DraftError, match="does not exist"):
        _eagle_engine(tmp_path / "none")


def test_eagle3_at_init_proposes_what_the_mtp_draft_proposes(tmp_path):
    save_draft(Eagle3Layer.from_target(_model()), str(tmp_path / "d"), "test-target")
    prompts = _prompts(2, 3)
    params = SamplingParams(max_tokens=16, temperature=0)
    want = _run(_engine(), prompts, params)
    runs = {}
    for name, eng in [("mtp", _engine("mtp")), ("eagle3", _eagle_engine(tmp_path / "d"))]:
        out, runs[name] = _run_recorded(eng, prompts, params)
        assert out == want
    assert runs["mtp"] == runs["eagle3"] and runs["mtp"][2] > 0


def test_eagle3_on_static_buffers_drafts_on_its_chains_as_it_drafts_eagerly(tmp_path):
    # an engine on static buffers ("eager": the CUDA-graph code uncaptured) drafts its greedy EAGLE-3 proposals on
    # the draft's chains (the whole proposal on one chain in the steady state, the fused block features in its first
    # step): the same proposals, acceptances and tokens as the engine drafting eagerly, and plain decoding's tokens
    draft = Eagle3Layer.from_target(_model())
    with torch.no_grad():
        draft.fc.weight.add_(torch.randn(draft.fc.weight.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    save_draft(draft, str(tmp_path / "d"), "test-target")
    prompts = _prompts(3, 3)
    params = SamplingParams(max_tokens=14, temperature=0)
    want = _run(_engine(), prompts, params)
    runs = {}
    for graphs in (False, True):
        eng = _eagle_engine(tmp_path / "d", graphs=graphs)
        assert (eng.draft.chains is not None) == graphs
        out, runs[graphs] = _run_recorded(eng, prompts, params)
        assert out == want
        if graphs:  # both chains ran: after an eager first step, and whole proposals
            assert {first > 0 for *_, first in eng.draft.chains.made} == {False, True}
    assert runs[True] == runs[False] and runs[True][2] > 0
