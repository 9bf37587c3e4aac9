"""The postprocess step: sampled tokens -> request outputs and metrics (nano-vllm's `postprocess`).

`Postprocessor.sample` draws every due request's next token in one batched call (one read-back per step) and
`emit` takes one token of a request: its logprobs, the timing metrics (time to first token, time per output token),
the stop rules (EOS, stop token ids, stop strings, max_tokens) and the text (detokenized, holding back an incomplete
UTF-8 character or a possible start of a stop string). Prompt logprobs scored by the runner become entries here too.
Nothing here touches the cache: the engine releases the requests that finished.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from k3.serve.detok import byte_level, decode_growing
from k3.serve.metrics import EngineMetrics
from k3.serve.runner import PromptScore
from k3.serve.sampling import advance, sample_step
from k3.serve.sequence import Sequence, Status


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    logprobs: list[dict] = field(default_factory=list)
    # On a request's first output, when its params ask for prompt_logprobs: Sequence.prompt_logprobs.
    prompt_logprobs: list[dict | None] | None = None


class Postprocessor:
    def __init__(self, tokenizer, eos_id: int | None, metrics: EngineMetrics):
        self.tokenizer, self.eos_id, self.metrics = tokenizer, eos_id, metrics
        self.incremental = byte_level(tokenizer)

    def decode(self, seq: Sequence) -> str:
        """tokenizer.decode(seq.output_ids), from the tokens after `seq.decoded` only where the decoder allows
        (k3.serve.detok: a byte-level decoder; else the whole output)."""
        full, seq.decoded = decode_growing(self.tokenizer, self.incremental, seq.output_ids, seq.decoded)
        return full

    def sample(self, due: list[Sequence], logits: dict[str, tuple[torch.Tensor, int]]) -> list[RequestOutput]:
        """The outputs of the requests whose prompt or decode step the step's forwards completed (`logits`:
        {request id: (a forward's logits [B, V], the request's row)}): a request with max_tokens=0 (prompt logprobs
        only) ends; every other one's next token is drawn, all in one batched sampling call."""
        outputs = [self.finish_scored(s) for s in due if s.params.max_tokens == 0]
        due = [s for s in due if s.params.max_tokens > 0]
        if due:
            rows = _rows_of(logits, due)
            want = [i for i, s in enumerate(due) if s.params.logprobs is not None]
            toks, entries = read_step(rows, self.draw(due, rows), want, [due[i].params.logprobs for i in want])
            advance([s.params for s in due], toks)
            lps = dict(zip(want, entries))
            for i, (s, t) in enumerate(zip(due, toks)):
                first = s.first_token_at is None
                out = self.emit(s, t, lps.get(i))
                if first and s.params.prompt_logprobs is not None:
                    out.prompt_logprobs = s.prompt_logprobs
                outputs.append(out)
        return outputs

    def draw(self, due: list[Sequence], rows: torch.Tensor) -> torch.Tensor:
        """The next token of each due request from its row of logits rows [N, V], on the device [N]
        (k3.serve.sampling.sample_step; `sample` reads them back with the step's logprobs)."""
        return sample_step(rows, [s.params for s in due], [s.generator for s in due])

    def emit(self, seq: Sequence, tok: int, lp: dict | None = None) -> RequestOutput:
        """Take the token `tok` for seq: its logprob entry `lp` (`logprob_entries`: given when the request asks for
        logprobs), timing metrics, stop rules, text."""
        return self._take(seq, [tok], None if lp is None else [lp])[0]

    def emit_many(self, seq: Sequence, toks: list[int], lps: list[dict] | None = None) -> tuple[RequestOutput, int]:
        """Take the tokens `toks` for seq in order (a speculative step's accepted tokens; lps[j] the logprob entry of
        toks[j] where the request asks for logprobs), up to the one that ends the request: (their outputs merged as
        `merge` merges `emit`'s, the number taken). The same as `emit` token by token, with the text decoded once
        for all of them where the request has no stop strings (the other stop rules read ids and counts alone, and
        the text after the last token is the one `emit` leaves); with stop strings, token by token (one may end
        inside any of them)."""
        if not seq.params.stop:
            return self._take(seq, toks, lps)
        got = []
        for j, t in enumerate(toks):
            got.append(self.emit(seq, t, lps[j] if lps else None))
            if got[-1].finished:
                break
        return merge(got), len(got)

    def _take(self, seq: Sequence, toks: list[int], lps: list[dict] | None) -> tuple[RequestOutput, int]:
        """`toks` taken in order up to the one that ends the request by its id (EOS, stop token ids) or by
        max_tokens, then the text once, where a stop string ends the request too (its callers give one token at a
        time to a request with stop strings): (the output of those tokens, how many were taken)."""
        p = seq.params
        if p.logprobs is not None and (lps is None or len(lps) < len(toks) or not all(lps[:len(toks)])):
            raise ValueError(f"request {seq.request_id} asks for logprobs: emit needs every token's logprob entry")
        new_ids, entries, reason, n = [], [], None, 0
        for j, tok in enumerate(toks):
            n += 1
            self._taken(seq)
            lp = lps[j] if p.logprobs is not None else None
            if lp:
                entries.append(lp)
            if (self.eos_id is not None and tok == self.eos_id) or tok in p.stop_token_ids:
                reason = "stop"
                break
            seq.output_ids.append(tok)
            if lp:
                seq.logprobs.append(lp)
            new_ids.append(tok)
            if len(seq.output_ids) >= p.max_tokens:
                break
        prev_text = seq.text
        if self.tokenizer is not None:
            full = self.decode(seq)
            stop_at = min((full.find(s) for s in p.stop if s and s in full), default=-1)
            if stop_at >= 0:
                full, reason = full[:stop_at], "stop"
            if reason is None:
                full = full[: len(full) - _held_back(full, p.stop)]
            seq.text = full if len(full) >= len(prev_text) or reason else prev_text
        if reason is None and len(seq.output_ids) >= p.max_tokens:
            reason = "length"
        if reason is not None:
            self.end(seq, reason)  # releases any held-back tail of the text
        delta = seq.text[len(prev_text):] if self.tokenizer is not None else ""
        return RequestOutput(seq.request_id, new_ids, delta, reason is not None, reason, entries), n

    def _taken(self, seq: Sequence) -> None:
        """A token of seq taken now: its time to first token or time per output token, and the count."""
        now = time.monotonic()
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.metrics.ttft.append(now - seq.arrival)
        elif seq.output_ids:
            self.metrics.tpot.append(now - getattr(seq, "_last_token_at", now))
        seq._last_token_at = now  # type: ignore[attr-defined]
        self.metrics.generation_tokens += 1

    def end(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason, seq.finished_at = Status.FINISHED, reason, time.monotonic()
        if self.tokenizer is not None and reason != "stop":
            seq.text = self.tokenizer.decode(seq.output_ids)
        self.metrics.requests_finished += 1

    def finish_scored(self, seq: Sequence) -> RequestOutput:
        """A request with max_tokens=0 (prompt logprobs only) ends once its prompt is computed: nothing sampled."""
        self.end(seq, "length")
        return RequestOutput(seq.request_id, [], "", True, "length", prompt_logprobs=seq.prompt_logprobs)

    def scored(self, seq: Sequence, score: PromptScore, scored) -> None:
        """The runner's (logprobs, top-k values, top-k ids) of `score`'s targets become seq's next prompt logprob
        entries, read back at once."""
        lp, top_v, top_i = (t.tolist() for t in scored)
        seq.prompt_logprobs.extend({"token": t, "logprob": v, "top": list(zip(ids, vals))}
                                   for t, v, vals, ids in zip(score.targets, lp, top_v, top_i))

    def computed(self, seq: Sequence, start: int, end: int) -> None:
        """seq's tokens start .. end - 1 were computed this step: count its prompt tokens among them."""
        self.metrics.prompt_tokens_computed += max(0, min(end, len(seq.prompt_ids)) - start)

    def admitted(self, seq: Sequence, hit_tokens: int) -> None:
        """The scheduler admitted seq with `hit_tokens` from the prefix cache (the first admission counts)."""
        if seq.admitted_at is None:
            seq.admitted_at = time.monotonic()
            seq.cached_tokens = hit_tokens
            self.metrics.queue_time.append(seq.admitted_at - seq.arrival)
            self.metrics.prompt_tokens_cached += hit_tokens

    @staticmethod
    def refused(seq: Sequence) -> RequestOutput:
        """The output of a request the scheduler refused (it cannot fit even in an empty pool)."""
        return RequestOutput(seq.request_id, [], "", True, seq.finish_reason)


def logprob_entries(logits: torch.Tensor, toks: list[int], ks: list[int]) -> list[dict]:
    """The logprob entries of tokens toks[i] drawn from rows i of logits [N, V], each with its ks[i] most likely
    alternatives: {"token", "logprob", "top": [(id, logprob), ...]}, log-softmax in fp32. Every row at once, read
    back to the host once (a step's requests, not one read-back per value)."""
    if not toks:
        return []
    if len(toks) != logits.shape[0] or len(ks) != len(toks):
        raise ValueError(f"{len(toks)} tokens and {len(ks)} counts for {logits.shape[0]} rows of logits")
    table, K = _entry_table(logits, torch.tensor(toks, device=logits.device), ks)
    return _entries(toks, ks, table.tolist(), K)


def read_step(rows: torch.Tensor, toks: torch.Tensor, want: list[int], ks: list[int]
              ) -> tuple[list[int], list[dict]]:
    """A step's tokens toks [N] (on the device, drawn from rows [N, V]) and the logprob entries of rows `want` (each
    with ks[j] alternatives, as `logprob_entries` makes them), read back together: (the tokens, the entries of
    `want` in order). One read-back for the whole step."""
    if len(want) != len(ks):
        raise ValueError(f"{len(ks)} counts for {len(want)} rows asking for logprobs")
    if not want:
        return toks.tolist(), []
    N = rows.shape[0]
    every = len(want) == N
    sub = rows if every else rows[torch.tensor(want, device=rows.device)]
    table, K = _entry_table(sub, toks if every else toks[torch.tensor(want, device=toks.device)], ks)
    # the tokens (int64, exact as fp64) ahead of the entries' table: one tensor, one read-back
    host = torch.cat([toks.double(), table.flatten()]).tolist()
    got = [int(t) for t in host[:N]]
    width = 1 + 2 * K
    return got, _entries([got[i] for i in want], ks, [host[N + j * width:N + (j + 1) * width]
                                                      for j in range(len(want))], K)


def _entry_table(logits: torch.Tensor, toks: torch.Tensor, ks: list[int]) -> tuple[torch.Tensor, int]:
    """[n, 1 + 2K] fp64 on the device: each row's token logprob, its K largest logprobs and their ids (fp32 values and
    int64 ids as fp64, exact for both), K = the largest count (at least 1); and K."""
    logp = torch.log_softmax(logits.float(), -1)
    K = max(max(ks), 1)
    top = torch.topk(logp, K, dim=-1)
    picked = logp.gather(-1, toks[:, None])
    return torch.cat([picked.double(), top.values.double(), top.indices.double()], dim=1), K


def _entries(toks: list[int], ks: list[int], host: list[list[float]], K: int) -> list[dict]:
    return [{"token": t, "logprob": row[0], "top": [(int(row[1 + K + j]), row[1 + j]) for j in range(k)]}
            for t, k, row in zip(toks, ks, host)]


def merge(outs: list[RequestOutput]) -> RequestOutput:
    """One request's outputs of one step (several tokens of a speculative step) as one output."""
    last = outs[-1]
    return RequestOutput(last.request_id, [t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs),
                         last.finished, last.finish_reason, [lp for o in outs for lp in o.logprobs])


def _held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of `text` to hold back: an incomplete UTF-8 character (decoded as U+FFFD), and a prefix
    of a stop string before it (the incomplete character may be the stop string's next one: "q" then the first
    byte of "җ" must not stream the "q" when the stop string is "qҗ")."""
    tail = 1 if text.endswith("\ufffd") else 0
    body = text[:len(text) - tail]
    n = tail
    for s in stops:
        for k in range(min(len(s) - 1, len(body)), 0, -1):
            if body.endswith(s[:k]):
                n = max(n, k + tail)
                break
    return n


def _rows_of(logits: dict[str, tuple[torch.Tensor, int]], due: list) -> torch.Tensor:
    """The due requests' logits as one [N, V] tensor: a view of the forward's output when they are its rows
    in order (a batch of decode steps), else the rows stacked."""
    picked = [logits[s.request_id] for s in due]
    out, first = picked[0]
    if all(t is out and i == first + k for k, (t, i) in enumerate(picked)):
        return out[first:first + len(picked)]
    return torch.stack([t[i] for t, i in picked])
