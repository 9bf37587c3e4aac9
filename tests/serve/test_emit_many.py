"""Postprocessor.emit_many (a speculative step's accepted tokens at once) against `emit` token by token merged: the
same outputs, text, finish and logprobs, over byte-level streams with characters split across tokens, stray bytes,
the end-of-text id, stop token ids, max_tokens inside a chunk, and stop strings (taken token by token)."""

import random

import pytest

from k3.data.tokenizer import K3Tokenizer
from k3.serve.metrics import EngineMetrics
from k3.serve.postprocess import Postprocessor, merge
from k3.serve.sampling import SamplingParams
from k3.serve.sequence import Sequence

TOK = K3Tokenizer.byte_level()


def _stream(rng: random.Random, eos: int | None) -> list[int]:
    pieces = ["a", "q", " ", "\u0497", "\u20ac", "\U0001f600", "z\u0497", "\n"]
    ids = TOK.encode("".join(rng.choice(pieces) for _ in range(60)))
    for _ in range(4):  # stray bytes: a continuation byte alone, a lead byte before ASCII
        i = rng.randrange(len(ids))
        ids[i:i] = TOK.encode(rng.choice(["\u0497", "\u20ac"]))[:1 + rng.randrange(1)]
    if eos is not None:
        ids.insert(rng.randrange(len(ids)), eos)
    return ids


def _entry(t: int) -> dict:
    return {"token": t, "logprob": -0.5, "top": [(t, -0.5)]}


def _run(ids, params, chunks, eos, many: bool):
    post = Postprocessor(TOK, eos, EngineMetrics())
    seq = Sequence([1], params)
    post.emit(seq, ids[0], _entry(ids[0]) if params.logprobs is not None else None)  # the prefill's token
    outs, i, text0 = [], 1, seq.text
    for n in chunks:
        toks = ids[i:i + n]
        if not toks or seq.status.name == "FINISHED":
            break
        lps = [_entry(t) for t in toks] if params.logprobs is not None else None
        if many:
            out, took = post.emit_many(seq, toks, lps)
        else:
            got = []
            for j, t in enumerate(toks):
                got.append(post.emit(seq, t, lps[j] if lps else None))
                if got[-1].finished:
                    break
            out, took = merge(got), len(got)
        outs.append((out.new_token_ids, out.new_text, out.finished, out.finish_reason, out.logprobs, took))
        i += took
    return outs, seq.text, seq.output_ids, seq.logprobs, seq.finish_reason, post.metrics.generation_tokens, \
        len(post.metrics.tpot), text0


@pytest.mark.parametrize("seed", range(8))
def test_emit_many_equals_emit_token_by_token(seed):
    rng = random.Random(seed)
    eos = TOK.eos_id if seed % 2 else None
    ids = _stream(rng, eos)
    stop_ids = [ids[rng.randrange(1, len(ids))]] if seed % 4 == 2 else []
    stops = [["q\u0497"], ["\u20acz", "zz"]][seed % 2] if seed >= 6 else []
    params = SamplingParams(max_tokens=rng.randrange(10, len(ids) + 5), stop=stops, stop_token_ids=stop_ids,
                            logprobs=1 if seed % 3 == 0 else None)
    chunks = [rng.randrange(1, 6) for _ in range(len(ids))]
    want = _run(ids, params, chunks, eos, many=False)
    got = _run(ids, params, chunks, eos, many=True)
    assert got == want
    outs = got[0]
    assert any(len(o[0]) > 1 for o in outs)  # chunks of several tokens were taken at once
    # the streamed deltas are the text after the first token's, up to the end's (a finish may replace the text whole)
    streamed = got[7] + "".join(o[1] for o in outs)
    assert streamed == got[1] or (got[4] is not None and got[1].startswith(streamed))


def test_emit_many_needs_every_logprob_entry_where_asked():
    post = Postprocessor(TOK, None, EngineMetrics())
    seq = Sequence([1], SamplingParams(max_tokens=8, logprobs=1))
    with pytest.raises(ValueError, match="every token's logprob entry"):
        post.emit_many(seq, [97, 98], [_entry(97)])
    assert seq.output_ids == [] and post.metrics.generation_tokens == 0  # nothing taken
