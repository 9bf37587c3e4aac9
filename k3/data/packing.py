"""Packing documents into fixed-length training rows.

Documents are tokenized, each followed by the end-of-text id, and concatenated into one token stream: for
training, memory-mapped token shards (k3.data.shards); for small in-memory document lists, one int32 array
(`tokenize_documents`, cached as .npy). Training rows are non-overlapping `seq_len` windows of that stream; a row may
hold several documents, told apart by `segment_ids` (a new segment starts at position 0 and after every
eos), and the label of a segment's first token is masked so no loss crosses a document boundary.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Iterator, Sequence

import numpy as np
import torch

from k3.data.corpus import Document
from k3.files import atomic_write

IGNORE_INDEX = -100
_CACHE_FORMAT = 1
_ENCODE_CHUNK = 256  # documents per encode_batch call: bounds memory, keeps the Rust batch encoder busy


# -------------------------------------------------------------------------------------- tokenizing


def _fingerprint(tok, docs: Sequence[Document]) -> str:
    h = hashlib.sha256()
    h.update(f"k3-stream-v{_CACHE_FORMAT}\0".encode())
    h.update(tok.to_str().encode("utf-8"))
    h.update(f"\0eos={tok.eos_id}\0n={len(docs)}\0".encode())
    for d in docs:
        name = d.name.encode("utf-8", "surrogatepass")
        text = d.text.encode("utf-8", "surrogatepass")
        h.update(len(name).to_bytes(8, "little") + name + len(text).to_bytes(8, "little"))
        h.update(text)
    return h.hexdigest()


def _sidecar(cache_path: str) -> str:
    return cache_path + ".json"


def _load_cache(cache_path: str, fingerprint: str) -> np.ndarray | None:
    try:
        with open(_sidecar(cache_path), encoding="utf-8") as f:
            meta = json.load(f)
        if meta.get("fingerprint") != fingerprint or meta.get("format") != _CACHE_FORMAT:
            return None
        arr = np.load(cache_path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    if arr.dtype != np.int32 or arr.ndim != 1 or arr.shape[0] != meta.get("tokens"):
        return None
    return arr


def _save_cache(cache_path: str, stream: np.ndarray, fingerprint: str, num_docs: int) -> None:
    # The sidecar goes first and comes back last, so a crash in between leaves no sidecar (a miss), never
    # a sidecar vouching for the wrong array.
    try:
        os.unlink(_sidecar(cache_path))
    except FileNotFoundError:
        pass
    atomic_write(cache_path, lambda f: np.save(f, stream, allow_pickle=False))
    meta = {"format": _CACHE_FORMAT, "fingerprint": fingerprint, "tokens": int(stream.shape[0]),
            "documents": num_docs}
    atomic_write(_sidecar(cache_path), lambda f: f.write(json.dumps(meta, indent=1).encode("utf-8")))


def tokenize_documents(tok, docs: Sequence[Document], cache_path: str | os.PathLike | None = None) -> np.ndarray:
    """One int32 token stream: each document's ids followed by `tok.eos_id`, in order.

    With `cache_path` (a .npy file), a stream saved there is reused when its JSON sidecar
    (`cache_path + ".json"`) holds the same fingerprint (SHA-256 of the tokenizer's JSON and every
    document's name and text); otherwise the stream is computed and saved atomically.
    """
    docs = list(docs)
    fp = None
    if cache_path is not None:
        cache_path = os.fspath(cache_path)
        fp = _fingerprint(tok, docs)
        cached = _load_cache(cache_path, fp)
        if cached is not None:
            return cached
    eos = np.array([tok.eos_id], dtype=np.int32)
    parts: list[np.ndarray] = []
    for start in range(0, len(docs), _ENCODE_CHUNK):
        chunk = docs[start:start + _ENCODE_CHUNK]
        for ids in tok.encode_batch([d.text for d in chunk]):
            parts.append(np.asarray(ids, dtype=np.int32))
            parts.append(eos)
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    if cache_path is not None:
        _save_cache(cache_path, stream, fp, len(docs))
    return stream


# ------------------------------------------------------------------------------------------- rows


def segment_ids_for(window: np.ndarray, eos_id: int) -> np.ndarray:
    """[T] int64: segment 0 starts at position 0 and a new segment starts right after every eos
    (the eos belongs to the document it ends)."""
    window = np.asarray(window)
    seg = np.zeros(window.shape[0], dtype=np.int64)
    if window.shape[0] > 1:
        np.cumsum(window[:-1] == eos_id, out=seg[1:])
    return seg


def _row_tensors(rows: np.ndarray, eos_id: int, valid: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """rows [B, T] -> input_ids, labels (segment starts after position 0 masked), segment_ids."""
    rows = np.asarray(rows, dtype=np.int64)
    seg = np.zeros_like(rows)
    if rows.shape[1] > 1:
        np.cumsum(rows[:, :-1] == eos_id, axis=1, out=seg[:, 1:])
    labels = rows.copy()
    labels[:, 1:][seg[:, 1:] != seg[:, :-1]] = IGNORE_INDEX
    if valid is not None:
        labels[~valid] = IGNORE_INDEX
    return {"input_ids": torch.from_numpy(rows), "labels": torch.from_numpy(labels),
            "segment_ids": torch.from_numpy(seg)}


class ArrayTokens:
    """A token stream held as one 1-D array (in memory or a np.memmap), read like k3.data.shards.TokenShards."""

    def __init__(self, stream: np.ndarray):
        stream = np.asarray(stream)  # a np.memmap stays one (a view, nothing read)
        if stream.ndim != 1:
            raise ValueError(f"stream must be 1-D, got shape {stream.shape}")
        self.stream = stream
        self.num_tokens = int(stream.shape[0])

    def __len__(self) -> int:
        return self.num_tokens

    def read(self, lo: int, hi: int) -> np.ndarray:
        return np.array(self.stream[lo:hi])


class PackedLoader:
    """Shuffled fixed-length rows of a token stream, resumable from (epoch, position, seed).

    `stream` is a 1-D array or a k3.data.shards.TokenShards (memory-mapped shards). Rows are the
    non-overlapping `seq_len` windows of the stream (a tail shorter than `seq_len` is dropped), read by their
    offsets, so only the rows of a batch are ever copied out of a memory-mapped stream and a row may span two
    shards. Each epoch visits every row once, in the order of a permutation seeded by (seed, epoch); a batch
    that runs past the end of an epoch continues with the next one. Batches are a function of
    (seed, epoch, position) alone, so `load_state_dict` resumes exactly. `data` (e.g. the token set's
    fingerprint) is kept in the state, and a state saved over other data is refused.
    """

    def __init__(self, stream, seq_len: int, batch_size: int, eos_id: int, seed: int = 0, data: str | None = None):
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
        # Anything else is a token store with `len()` and `read(lo, hi)` (k3.data.shards.TokenShards).
        self.tokens = ArrayTokens(stream) if isinstance(stream, (np.ndarray, list, tuple)) else stream
        self.num_rows = len(self.tokens) // seq_len
        if self.num_rows == 0:
            raise ValueError(f"stream of {len(self.tokens)} tokens is shorter than seq_len={seq_len}")
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.eos_id = int(eos_id)
        self.seed = int(seed)
        self.data = data
        self.epoch = 0
        self.position = 0  # rows of the current epoch already served
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    @property
    def tokens_per_epoch(self) -> int:
        return self.num_rows * self.seq_len

    def _order(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
            self._perm_epoch = epoch
        return self._perm

    def row(self, i: int) -> np.ndarray:
        """Row `i` of the stream: tokens [i * seq_len, (i + 1) * seq_len)."""
        return self.tokens.read(int(i) * self.seq_len, (int(i) + 1) * self.seq_len)

    def next_batch(self) -> dict[str, torch.Tensor]:
        """{"input_ids", "labels", "segment_ids"}: [batch_size, seq_len] int64 tensors."""
        picked = []
        need = self.batch_size
        while need:
            order = self._order(self.epoch)
            take = order[self.position: self.position + need]
            picked.append(take)
            need -= take.shape[0]
            self.position += take.shape[0]
            if self.position >= self.num_rows:
                self.epoch += 1
                self.position = 0
        return self._batch(np.concatenate(picked))

    def _batch(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        """The batch of rows `idx` (a packed loader of other rows overrides this)."""
        return _row_tensors(np.stack([self.row(i) for i in idx]), self.eos_id)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        st = {"epoch": int(self.epoch), "position": int(self.position), "seed": int(self.seed)}
        if self.data is not None:
            st["data"] = self.data
        return st

    def load_state_dict(self, d: dict) -> None:
        epoch, position, seed = int(d["epoch"]), int(d["position"]), int(d["seed"])
        if self.data is not None and d.get("data") not in (None, self.data):
            raise ValueError(f"the loader state was saved over the token set {d['data']}, this run reads "
                             f"{self.data}: the data, the tokenizer or the held-out fraction changed since")
        if epoch < 0 or not 0 <= position < self.num_rows:
            raise ValueError(f"loader state {d} does not fit {self.num_rows} rows "
                             "(was the stream, seq_len or data changed?)")
        self.epoch, self.position, self.seed = epoch, position, seed
        self._perm_epoch = -1


def eval_batches(stream: np.ndarray, seq_len: int, batch_size: int, eos_id: int,
                 max_batches: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive `seq_len` windows of `stream` in order, `batch_size` rows at a time (the last batch
    may be smaller), for held-out loss. The tail shorter than `seq_len` becomes a last row padded with
    eos, whose padding has label -100, so the whole stream is covered. Stops after `max_batches`."""
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
    stream = np.asarray(stream)
    n = stream.shape[0]
    num_rows = -(-n // seq_len)
    produced = 0
    for start in range(0, num_rows, batch_size):
        if max_batches is not None and produced >= max_batches:
            return
        stop = min(start + batch_size, num_rows)
        lo, hi = start * seq_len, min(stop * seq_len, n)
        flat = np.full((stop - start) * seq_len, eos_id, dtype=np.int64)
        flat[: hi - lo] = stream[lo:hi]
        valid = None
        if hi - lo < flat.shape[0]:
            valid = np.zeros(flat.shape[0], dtype=bool)
            valid[: hi - lo] = True
            valid = valid.reshape(-1, seq_len)
        yield _row_tensors(flat.reshape(-1, seq_len), eos_id, valid)
        produced += 1
