"""Chat data for supervised fine-tuning (report §4.1.1): OpenAI-style conversations -> packed rows with a loss on
what the assistant writes.

A data file is JSON Lines, one conversation per line:

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "...", "reasoning_content": "...", "tool_calls": [...]},
                  {"role": "tool", "tool_call_id": "...", "content": "..."}, ...],
     "tools": [...], "reasoning_effort": "high", "thinking": true}

Messages are those of the chat template (k3.serve.chat): system, user, assistant (content, reasoning_content,
tool_calls), tool (tool_call_id) and input option messages ({"role": "option", "type": "tool-declare", "tools":
[...]}); content is a string or a list of {"type": "text", "text": ...} parts. "tools", "reasoning_effort" (the
global option messages) and "thinking" (thinking mode: every reply opens with its think channel; default false,
instruct mode) are optional; other top-level keys (ids, sources) are ignored. A conversation opens with a
non-assistant message and holds at least one assistant message. A bad record is an error naming the file, the line
and the field; with `skip_bad` it is skipped instead and counted, its message kept for the log.

Each conversation is rendered with the checkpoint's chat template by the server's own renderer
(`render_chat_segments`), so the tokens trained on are exactly those `k3 serve` builds. The rendering is cut at
every assistant message: the prompt before it ends with the generation prefix, the reply is what the model writes
after it (its channels and the end-of-message marker), trained, except a tool call's pure-JSON fallback block
(inputs only: its loss is masked). Option messages, the markup the template writes around the reply and the other
messages are not trained. Pieces are cut at markers, which are special tokens (or, in an older tokenizer, texts
encoded on their own), so a reply begins at a token boundary as it does when the model generates it after the
server's prompt; the labels are the reply tokens, -100 everywhere else. A conversation ends with eos (untrained),
like a pre-training document.

Packing: conversations go into `seq_len` rows in file order, a new row when the next one does not fit; each is its
own segment (document mask: no attention or loss across conversations); the rest of a row is padding (its own
segment, no loss). A conversation longer than a row is cut to `seq_len` tokens; one left with no reply token is
dropped; both are counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import torch

from k3.data.packing import IGNORE_INDEX, PackedLoader
from k3.serve.chat import (OPTION_ROLE, ROLES, ChatTemplate, markup_ids, message_text, render_chat_segments,
                           segment_units)

# The keys each role's message may have (anything else is a mistake in the data, not an extension to ignore).
MESSAGE_KEYS = {"system": ("role", "content", "name"), "user": ("role", "content", "name"),
                "assistant": ("role", "content", "reasoning_content", "reasoning", "tool_calls", "name"),
                "tool": ("role", "content", "tool_call_id", "name"), OPTION_ROLE: ("role", "type", "tools", "effort")}
RECORD_OPTIONS = ("tools", "reasoning_effort", "thinking")


class ChatDataError(ValueError):
    """A chat data file has a bad record; the message names the file, the line and the field."""


@dataclass
class ChatRecord:
    line: int  # 1-based line of the file
    messages: list[dict]
    options: dict = field(default_factory=dict)  # render options: tools, reasoning_effort, thinking


def check_record(rec) -> list[dict]:
    """The record's messages, or ValueError naming the field that is wrong."""
    return _check(rec)[0]


def _check(rec) -> tuple[list[dict], dict]:
    if not isinstance(rec, dict):
        raise ValueError(f"a record must be a JSON object with a 'messages' list, got a JSON {type(rec).__name__}")
    if "messages" not in rec:
        raise ValueError("field 'messages' is missing (a record is {\"messages\": [{\"role\": ..., \"content\": ...}, "
                         "...]})")
    msgs = rec["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"field 'messages' must be a non-empty list of messages, got {_short(msgs)}")
    roles = list(ROLES) + [OPTION_ROLE]
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ValueError(f"field 'messages[{i}]' must be an object with 'role' and 'content', got {_short(m)}")
        role = m.get("role")
        if role not in roles:
            raise ValueError(f"field 'messages[{i}].role' = {_short(role)} is invalid: must be one of {roles}")
        extra = sorted(set(m) - set(MESSAGE_KEYS[role]))
        if extra:
            raise ValueError(f"field 'messages[{i}].{extra[0]}' is not supported (a {role} message has only "
                             f"{', '.join(MESSAGE_KEYS[role])})")
        if role != OPTION_ROLE and "content" not in m and not (role == "assistant" and m.get("tool_calls")):
            raise ValueError(f"field 'messages[{i}].content' is missing")
        if role != OPTION_ROLE and not (m.get("content") is None and role == "assistant"):
            message_text(m["content"], i)  # names messages[i].content[j] when a part is wrong
    if msgs[0]["role"] == "assistant":
        raise ValueError("field 'messages[0].role' = 'assistant': a conversation opens with a system, user or tool "
                         "message (the assistant replies to a prompt)")
    if not any(m["role"] == "assistant" for m in msgs):
        raise ValueError("field 'messages' has no assistant message: nothing to train on")
    options = {k: rec[k] for k in RECORD_OPTIONS if rec.get(k) is not None}
    if not isinstance(options.get("thinking", False), bool):
        raise ValueError(f"field 'thinking' must be true or false, got {_short(options['thinking'])}")
    render_chat_segments(msgs, add_generation_prompt=False, **options)  # the rest (calls, results, options)
    return msgs, options


def _short(v, limit: int = 60) -> str:
    r = json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def read_chat_jsonl(path: str, skip_bad: bool = False) -> tuple[list[ChatRecord], list[str]]:
    """(the conversations of a .jsonl file, the messages of the bad records skipped). Blank lines are not records.
    Without `skip_bad` the first bad record raises ChatDataError."""
    records, bad = [], []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
                if not text.strip():
                    continue
                try:
                    rec = json.loads(text)
                except json.JSONDecodeError as e:
                    raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
                msgs, options = _check(rec)
            except (ValueError, UnicodeDecodeError) as e:
                msg = f"{path}:{n}: {e}"
                if not skip_bad:
                    raise ChatDataError(msg) from None
                bad.append(msg)
                continue
            records.append(ChatRecord(n, msgs, options))
    return records, bad


def conversation_segments(messages: list[dict], template: ChatTemplate, **options) -> list[tuple[list, bool]]:
    """The conversation's rendering (k3.serve.chat.render_chat_segments, no generation prompt) cut into
    (segments, trained) pieces: what the model writes of each assistant message trained (fallback blocks
    excepted), everything else not. The pieces concatenate to the server's rendering exactly."""
    pieces: list[tuple[list, bool]] = []
    for s in render_chat_segments(messages, template, add_generation_prompt=False, **options):
        if pieces and pieces[-1][1] == s.train:
            pieces[-1][0].append(s)
        else:
            pieces.append(([s], s.train))
    return pieces


def conversation_pieces(messages: list[dict], template: ChatTemplate, **options) -> list[tuple[str, bool]]:
    """`conversation_segments` as (text, trained) pieces."""
    return [("".join(s.text for s in segs), trained) for segs, trained in conversation_segments(messages, template,
                                                                                                 **options)]


def tokenize_conversations(tok, conversations: list[list[dict]], template: ChatTemplate,
                           options: list[dict] | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """(token ids int32, trained bool) of each conversation (with its render `options`, if given), eos appended
    (untrained). Markers become the tokenizer's special ids where it has them; text runs are batch-encoded."""
    ids_of = markup_ids(tok, template)
    cut = [[(segment_units(segs, ids_of), trained) for segs, trained in
            conversation_segments(msgs, template, **((options or [{}] * len(conversations))[k]))]
           for k, msgs in enumerate(conversations)]
    texts = [u for pieces in cut for units, _ in pieces for u in units if isinstance(u, str)]
    enc = []
    for s in range(0, len(texts), 1024):
        enc.extend(tok.encode_batch(texts[s:s + 1024]))
    out, k = [], 0
    for pieces in cut:
        toks, mask = [], []
        for units, trained in pieces:
            for u in units:
                if isinstance(u, str):
                    u, k = enc[k], k + 1
                else:
                    u = [u]
                toks.extend(u)
                mask.extend([trained] * len(u))
        toks.append(tok.eos_id)
        mask.append(False)
        out.append((np.asarray(toks, dtype=np.int32), np.asarray(mask, dtype=bool)))
    return out


@dataclass
class PackedChat:
    """Packed SFT rows: input ids, labels (-100 off the replies) and segment ids, each [rows, seq_len]; `stats`
    counts what went in (conversations, truncated, dropped, tokens, trained tokens, rows)."""

    input_ids: np.ndarray
    labels: np.ndarray
    segment_ids: np.ndarray
    stats: dict = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def batch(self, idx) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.from_numpy(self.input_ids[idx].astype(np.int64)),
                "labels": torch.from_numpy(self.labels[idx].astype(np.int64)),
                "segment_ids": torch.from_numpy(self.segment_ids[idx].astype(np.int64))}

    def eval_batches(self, rows: int) -> list[dict[str, torch.Tensor]]:
        """Every row once, in order, `rows` at a time (a held-out set)."""
        return [self.batch(np.arange(s, min(s + rows, self.num_rows))) for s in range(0, self.num_rows, rows)]


def pack_conversations(examples: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int) -> PackedChat:
    """Pack (ids, trained) conversations into rows of `seq_len` (the module docstring has the rules)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    stats = {"conversations": len(examples), "truncated": 0, "dropped_no_reply": 0, "tokens": 0,
             "trained_tokens": 0}
    rows_ids, rows_lab, rows_seg = [], [], []
    cur: list[tuple[np.ndarray, np.ndarray]] = []
    used = 0

    def flush():
        nonlocal cur, used
        if not cur:
            return
        ids = np.full(seq_len, pad_id, dtype=np.int32)
        lab = np.full(seq_len, IGNORE_INDEX, dtype=np.int32)
        seg = np.full(seq_len, len(cur), dtype=np.int32)  # padding: a segment of its own
        off = 0
        for s, (t, m) in enumerate(cur):
            n = t.shape[0]
            ids[off:off + n] = t
            lab[off:off + n] = np.where(m, t, IGNORE_INDEX)
            lab[off] = IGNORE_INDEX  # a segment's first token is never a target (the model shifts labels by one)
            seg[off:off + n] = s
            off += n
        rows_ids.append(ids)
        rows_lab.append(lab)
        rows_seg.append(seg)
        cur, used = [], 0

    for t, m in examples:
        if t.shape[0] > seq_len:
            t, m = t[:seq_len], m[:seq_len]
            stats["truncated"] += 1
        if not m[1:].any():
            stats["dropped_no_reply"] += 1
            continue
        if used + t.shape[0] > seq_len:
            flush()
        cur.append((t, m))
        used += t.shape[0]
        stats["tokens"] += int(t.shape[0])
        stats["trained_tokens"] += int(m[1:].sum())
    flush()
    stats["rows"] = len(rows_ids)
    if not rows_ids:
        return PackedChat(np.zeros((0, seq_len), np.int32), np.zeros((0, seq_len), np.int32),
                          np.zeros((0, seq_len), np.int32), stats)
    return PackedChat(np.stack(rows_ids), np.stack(rows_lab), np.stack(rows_seg), stats)


class ChatLoader(PackedLoader):
    """Shuffled batches of packed SFT rows, resumable exactly: PackedLoader's epochs, permutations and state
    (seed, epoch, position) over the rows of a `PackedChat`."""

    def __init__(self, packed: PackedChat, batch_size: int, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if packed.num_rows == 0:
            raise ValueError("no packed rows: the data holds no conversation with a reply")
        self.packed = packed
        self.num_rows, self.seq_len = packed.num_rows, packed.input_ids.shape[1]
        self.batch_size, self.seed = batch_size, int(seed)
        self.eos_id = -1  # unused: segments come with the rows
        self.epoch, self.position = 0, 0
        self._perm_epoch, self._perm = -1, None
        self.data = None  # PackedLoader's token-set fingerprint: the rows are the packed conversations

    def _batch(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        return self.packed.batch(idx)
