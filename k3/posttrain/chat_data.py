"""Chat data for supervised fine-tuning (report §4.1.1): OpenAI-style conversations -> packed rows with a loss on the
assistant's tokens only.

A data file is JSON Lines, one conversation per line:

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}

Roles are those of the chat template (system, user, assistant, tool); content is a string or a list of
{"type": "text", "text": ...} parts; other top-level keys (ids, sources) are ignored. A conversation opens with a
non-assistant message and holds at least one assistant message. A bad record is an error naming the file, the line
and the field; with `skip_bad` it is skipped instead and counted, its message kept for the log.

Each conversation is rendered with the checkpoint's chat template by the server's own `render_chat`
(k3.serve.chat), so the text trained on is exactly the text `k3 serve` builds. The rendering is cut at every
assistant reply: the prompt before it ends with the template's generation prefix, the reply is the message content
followed by the end-of-message marker (what the model must write before the server's stop string matches). Each
piece is tokenized on its own, so a reply begins at a token boundary as it does when the model generates it after
the server's prompt; the labels are the reply tokens, -100 everywhere else. A conversation ends with eos
(untrained), like a pre-training document.

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
from k3.serve.chat import ROLES, ChatTemplate, message_text, render_chat

MESSAGE_KEYS = ("role", "content")


class ChatDataError(ValueError):
    """A chat data file has a bad record; the message names the file, the line and the field."""


@dataclass
class ChatRecord:
    line: int  # 1-based line of the file
    messages: list[dict]


def check_record(rec) -> list[dict]:
    """The record's messages, or ValueError naming the field that is wrong."""
    if not isinstance(rec, dict):
        raise ValueError(f"a record must be a JSON object with a 'messages' list, got a JSON {type(rec).__name__}")
    if "messages" not in rec:
        raise ValueError("field 'messages' is missing (a record is {\"messages\": [{\"role\": ..., \"content\": ...}, "
                         "...]})")
    msgs = rec["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"field 'messages' must be a non-empty list of messages, got {_short(msgs)}")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ValueError(f"field 'messages[{i}]' must be an object with 'role' and 'content', got {_short(m)}")
        extra = sorted(set(m) - set(MESSAGE_KEYS))
        if extra:
            raise ValueError(f"field 'messages[{i}].{extra[0]}' is not supported (a message has only "
                             f"{' and '.join(MESSAGE_KEYS)})")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"field 'messages[{i}].role' = {_short(role)} is invalid: must be one of {list(ROLES)}")
        if "content" not in m:
            raise ValueError(f"field 'messages[{i}].content' is missing")
        if not (m["content"] is None and role == "assistant"):
            message_text(m["content"], i)  # names messages[i].content[j] when a part is wrong
    if msgs[0]["role"] == "assistant":
        raise ValueError("field 'messages[0].role' = 'assistant': a conversation opens with a system, user or tool "
                         "message (the assistant replies to a prompt)")
    if not any(m["role"] == "assistant" for m in msgs):
        raise ValueError("field 'messages' has no assistant message: nothing to train on")
    return msgs


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
                msgs = check_record(rec)
            except (ValueError, UnicodeDecodeError) as e:
                msg = f"{path}:{n}: {e}"
                if not skip_bad:
                    raise ChatDataError(msg) from None
                bad.append(msg)
                continue
            records.append(ChatRecord(n, msgs))
    return records, bad


def conversation_pieces(messages: list[dict], template: ChatTemplate) -> list[tuple[str, bool]]:
    """The conversation's rendering (k3.serve.chat.render_chat, no generation prompt) cut into (text, trained)
    pieces: each assistant reply (content + end-of-message marker) trained, the markup and other messages not.
    The texts concatenate to the server's rendering exactly."""
    full = render_chat(messages, template, add_generation_prompt=False)
    pieces, done = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render_chat(messages[:i], template, add_generation_prompt=True)  # what the server sends
        content = "" if m["content"] is None else message_text(m["content"], i)
        reply = content + template.end_of_message
        if not (full.startswith(prompt) and full.startswith(reply, len(prompt))):
            raise ValueError("the chat template's generation prefix does not open the assistant's message block: "
                             "a reply cannot be cut out of the rendering")
        pieces.append((full[done:len(prompt)], False))
        pieces.append((reply, True))
        done = len(prompt) + len(reply)
    pieces.append((full[done:], False))
    return [(t, trained) for t, trained in pieces if t]


def tokenize_conversations(tok, conversations: list[list[dict]], template: ChatTemplate
                           ) -> list[tuple[np.ndarray, np.ndarray]]:
    """(token ids int32, trained bool) of each conversation, eos appended (untrained)."""
    cut = [conversation_pieces(msgs, template) for msgs in conversations]
    flat = [t for pieces in cut for t, _ in pieces]
    ids = []
    for s in range(0, len(flat), 1024):
        ids.extend(tok.encode_batch(flat[s:s + 1024]))
    out, k = [], 0
    for pieces in cut:
        toks, mask = [], []
        for _, trained in pieces:
            toks.extend(ids[k])
            mask.extend([trained] * len(ids[k]))
            k += 1
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
