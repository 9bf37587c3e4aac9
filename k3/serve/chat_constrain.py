"""Constrained decoding of a forced tool call (tool_choice "required" or a named function), report appendix F:
every structural boundary of XTML is one special token, so a small state machine over the reply's grammar can
mask the logits of each step.

The reply is forced into `[close]<prefix channel>[sep][open]tools[sep][open]call tool="NAME" index="0"[sep]ARGS
[close]call[sep][close]tools[sep][end_of_msg]`: NAME one of the allowed tools, ARGS arguments named among the
tool's declared `properties`, each at most once. A parameter declared "integer", "number", "boolean" or "null" is
a typed argument (`[open]arg name="KEY" type="json"[sep]VALUE[close]arg[sep]`) whose VALUE is spelled one
character token at a time and is always valid JSON of that type; any other parameter is a string argument whose
value is free text (so an object or array parameter comes back as a string). In thinking mode the think channel is
free until the model closes it. Free text is any token but the markers and EOS. The budget is kept: a token is
allowed only when the reply can still finish within max_tokens after it, so the call always ends in time.
"""

from __future__ import annotations

import re

import torch

from k3.serve.chat_encode import encode_segments, markup_ids, split_markup
from k3.serve.chat_template import ChatTemplate

# typed argument values: (prefix pattern, complete pattern) of JSON numbers, or the literals of the type
_NUMBERS = {"integer": (r"-?(?:0|[1-9]\d*)?", r"-?(?:0|[1-9]\d*)"),
            "number": (r"-?(?:(?:0|[1-9]\d*)(?:\.\d*)?)?", r"-?(?:0|[1-9]\d*)(?:\.\d+)?")}
_LITERALS = {"boolean": ("true", "false"), "null": ("null",)}
SCALAR_TYPES = tuple(_NUMBERS) + tuple(_LITERALS)
_ALPHABET = "0123456789-.truefalsn"


def _needs(kind: str, s: str) -> int | None:
    """The fewest characters that make `s` a whole value of `kind` (None: `s` starts none)."""
    if kind in _NUMBERS:
        prefix, whole = _NUMBERS[kind]
        if re.fullmatch(whole, s):
            return 0
        return 1 if re.fullmatch(prefix, s) else None
    rest = [len(v) - len(s) for v in _LITERALS[kind] if v.startswith(s)]
    return min(rest) if rest else None


class _Trie:
    """Token sequences of names: the tokens that may follow a prefix, and the fewest tokens that complete it."""

    def __init__(self, seqs: dict[str, list[int]]):
        self.seqs = seqs

    def live(self, prefix: tuple, used=()) -> dict[str, list[int]]:
        return {n: s for n, s in self.seqs.items() if n not in used and tuple(s[:len(prefix)]) == prefix}

    def next(self, prefix: tuple, used=()) -> set[int]:
        return {s[len(prefix)] for s in self.live(prefix, used).values() if len(s) > len(prefix)}

    def complete(self, prefix: tuple, used=()) -> str | None:
        return next((n for n, s in self.live(prefix, used).items() if len(s) == len(prefix)), None)


class ToolCallConstraint:
    """The state of one request's forced call. `tools`: {name: {parameter: JSON type or None}} of the tools the
    call may name. `mask(logits)` returns the logits with every token the grammar (and the budget) does not allow
    at -inf; `advance(token)` takes the sampled token. A token outside the grammar (it cannot come from masked
    logits) turns the constraint off rather than raising."""

    def __init__(self, tokenizer, template: ChatTemplate, tools: dict[str, dict[str, str | None]], thinking: bool,
                 max_tokens: int, eos_id: int | None = None):
        ids = markup_ids(tokenizer, template)
        if ids is None:
            raise ValueError("constrained tool calls need a tokenizer with the chat markup as special tokens")

        def enc(markup: str) -> list[int]:
            return encode_segments(tokenizer, split_markup(markup, template), template)

        t = template
        self.open, self.close = ids[t.open], ids[t.close]
        self.banned = sorted(set(ids.values()) | ({eos_id} if eos_id is not None else set()))
        self.char = {}  # typed values are spelled one character token at a time
        for ch in _ALPHABET + '"':
            (self.char[ch],) = enc(ch)
        self.quote = self.char['"']
        self.lead = enc(f'{t.close}{"think" if thinking else "response"}{t.sep}{t.open}tools{t.sep}{t.open}call tool=')
        self.after_name = enc(f' index="0"{t.sep}')
        self.arg_open = enc("arg name=")
        self.after_key = {"string": enc(t.sep), "json": enc(f' type="json"{t.sep}')}
        self.arg_close = enc(f"arg{t.sep}")
        self.call_end = enc(f"call{t.sep}{t.close}tools{t.sep}{t.end_of_message}")
        self.names = _Trie({n: enc(n) for n in tools})
        self.keys = {n: _Trie({k: enc(k) for k in params}) for n, params in tools.items()}
        self.kinds = {n: {k: (v if v in SCALAR_TYPES else "string") for k, v in params.items()}
                      for n, params in tools.items()}
        self.max_tokens, self.generated = max_tokens, 0
        self.phase = "think" if thinking else "lead"
        self.queue: list[int] = [] if thinking else list(self.lead)
        self.after_queue = "lead_quote"
        self.prefix: tuple = ()
        self.tool: str | None = None
        self.key: str | None = None
        self.value = ""  # a typed value so far
        self.used: set[str] = set()
        self.active = True

    # ------------------------------------------------------------------------------------------------- budget
    def _finish_arg(self) -> int:
        return 1 + len(self.arg_close) + self._finish_call()  # [close]arg[sep], then the call's end

    def _finish_call(self) -> int:
        return 1 + len(self.call_end)  # [close]call[sep][close]tools[sep][end_of_msg]

    def _key_tail(self, key: str) -> int:
        """The fewest tokens after a key's closing quote to the end of the reply."""
        kind = self.kinds[self.tool][key]
        if kind == "string":
            return len(self.after_key["string"]) + self._finish_arg()
        return len(self.after_key["json"]) + _needs(kind, "") + self._finish_arg()

    def _name_tail(self, name: str) -> int:
        return len(self.after_name) + self._finish_call()

    def _shortest(self, trie: _Trie, prefix: tuple, tail, used=()) -> int:
        return min(len(s) - len(prefix) + 1 + tail(n) for n, s in trie.live(prefix, used).items())

    def min_tokens(self) -> int:
        """The fewest tokens that finish the reply from here."""
        if self.queue:
            return len(self.queue) + self._after(self.after_queue)
        if self.phase == "name":
            return self._shortest(self.names, self.prefix, self._name_tail)
        if self.phase == "key":
            return self._shortest(self.keys[self.tool], self.prefix, self._key_tail, self.used)
        if self.phase == "typed":
            return _needs(self.kinds[self.tool][self.key], self.value) + self._finish_arg()
        return self._after(self.phase)

    def _after(self, phase: str) -> int:
        """The fewest tokens that finish the reply from the start of `phase`."""
        if phase == "think":
            return len(self.lead) + self._after("lead_quote")
        if phase == "lead_quote":
            return 1 + self._shortest(self.names, (), self._name_tail)
        if phase == "args":
            return self._finish_call()
        if phase == "key_quote":
            return 1 + self._shortest(self.keys[self.tool], (), self._key_tail, self.used)
        if phase == "string":
            return self._finish_arg()
        if phase == "typed":
            return _needs(self.kinds[self.tool][self.key], "") + self._finish_arg()
        return 0

    # -------------------------------------------------------------------------------------------------- steps
    def allowed(self) -> tuple[set[int], bool]:
        """(the tokens allowed next, whether any free-text token is allowed too)."""
        if self.queue:
            return {self.queue[0]}, False
        left = self.max_tokens - self.generated
        if self.phase in ("think", "string"):  # a text token keeps the shortest finish as long as it is
            return {self.close}, self.min_tokens() < left
        if self.phase in ("lead_quote", "key_quote"):
            return {self.quote}, False
        if self.phase == "name":
            return self._pick(self.names, self._name_tail, left), False
        if self.phase == "key":
            return self._pick(self.keys[self.tool], self._key_tail, left, self.used), False
        if self.phase == "typed":
            kind = self.kinds[self.tool][self.key]
            ok = {self.char[c] for c in _ALPHABET if (n := _needs(kind, self.value + c)) is not None
                  and 1 + n + self._finish_arg() <= left}
            if _needs(kind, self.value) == 0:
                ok.add(self.close)
            if not ok:  # out of budget: the shortest way (the reply will be cut, and say so)
                best = min((c for c in _ALPHABET if _needs(kind, self.value + c) is not None),
                           key=lambda c: _needs(kind, self.value + c))
                ok = {self.char[best]}
            return ok, False
        if self.phase == "args":
            trie = self.keys[self.tool]
            more = bool(trie.live((), self.used)) and 1 + len(self.arg_open) + self._after("key_quote") <= left
            return ({self.open} if more else set()) | {self.close}, False
        return set(), True  # done: the end-of-message token was the last one

    def _pick(self, trie: _Trie, tail, left: int, used=()) -> set[int]:
        """The next tokens of a name (or the closing quote of a whole one) after which the reply can still
        finish within `left` tokens; when none can, the first token of the shortest way (the reply will be cut,
        and say so)."""
        p = self.prefix
        ok = {t for t in trie.next(p, used) if self._shortest(trie, p + (t,), tail, used) <= left - 1}
        done = trie.complete(p, used)
        if done is not None and tail(done) <= left - 1:
            ok.add(self.quote)
        if not ok:
            name, seq = min(trie.live(p, used).items(), key=lambda kv: len(kv[1]) + tail(kv[0]))
            ok = {seq[len(p)] if len(seq) > len(p) else self.quote}
        return ok

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] -> a masked copy."""
        if not self.active:
            return logits
        ids, text = self.allowed()
        if text:
            out = logits.clone()
            out[self.banned] = float("-inf")
        else:
            out = torch.full_like(logits, float("-inf"))
        idx = torch.tensor(sorted(ids), dtype=torch.long, device=logits.device)
        out[idx] = logits[idx]
        return out

    def advance(self, token: int) -> None:
        if not self.active:
            return
        ids, text = self.allowed()
        self.generated += 1
        if token not in ids and not (text and token not in self.banned):
            self.active = False
            return
        if self.queue:
            self.queue.pop(0)
            if not self.queue:
                self.phase = self.after_queue
            return
        if self.phase == "think" and token == self.close:
            self._force(self.lead[1:], "lead_quote")
        elif self.phase in ("lead_quote", "key_quote"):
            self.phase, self.prefix = "name" if self.phase == "lead_quote" else "key", ()
        elif self.phase == "name":
            if token == self.quote:
                self.tool = self.names.complete(self.prefix)
                self._force(self.after_name, "args")
            else:
                self.prefix += (token,)
        elif self.phase == "args":
            if token == self.open:
                self._force(self.arg_open, "key_quote")
            else:
                self._force(self.call_end, "done")
        elif self.phase == "key":
            if token == self.quote:
                self.key = self.keys[self.tool].complete(self.prefix, self.used)
                self.used.add(self.key)
                kind = self.kinds[self.tool][self.key]
                self.value = ""
                self._force(self.after_key["string" if kind == "string" else "json"],
                            "string" if kind == "string" else "typed")
            else:
                self.prefix += (token,)
        elif self.phase == "typed" and token != self.close:
            self.value += next(c for c in _ALPHABET if self.char[c] == token)
        elif self.phase in ("string", "typed") and token == self.close:
            self._force(self.arg_close, "args")

    def _force(self, tokens: list[int], then: str) -> None:
        self.queue, self.after_queue = list(tokens), then
        if not self.queue:
            self.phase = then
