"""Token shards: documents tokenized once, by parallel worker processes, into flat token files read by offset.

A token set is one directory, written under a temporary name and swapped into place whole
(k3.files.replace_dir), so a crash never leaves a half-written set that looks finished:

  index.json          format, tokenizer and source fingerprints, dtype, and per split ("train", "heldout")
                      the shard files with their token and document counts; documents dropped as duplicates
                      or empty
  train-00000.bin     raw tokens (uint16 when the vocabulary fits in 16 bits, else int32): each document's
                      ids followed by the end-of-text id, documents whole (a shard ends at a document end)
  train.docs.npy      int64 [documents + 1]: each document's first token in the split's stream, then its length
  heldout-00000.bin   held-out documents, one file (the evaluation reads it as one memory-mapped array)

The directory's name is a digest of the tokenizer and the sources (each unit's path, size, modification time,
byte or row-group range and role) and the held-out fraction, so a set is reused exactly when none of them
changed, and one cache directory can hold the sets of several tokenizers.

Building runs in two phases. Workers (multiprocessing, spawned: a fresh interpreter that never inherits
locks or threads of the trainer's process) tokenize tasks of about 16 MB of text each into part files and
return, per document, its token count and content hash. The parent then decides each document's fate in
source order (k3.data.sources.assign: duplicates dropped, user data held out by content hash) and copies the
parts' tokens into the shards. Parts are consumed in task order, so the result does not depend on the number
of workers or on which one finished first.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import multiprocessing
import os
import shutil
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from k3.data.sources import DEFAULT_HELDOUT_FRACTION, HELDOUT, TRAIN, UNIT_BYTES, Unit, assign, content_hash, read_unit
from k3.files import fsync_dir, replace_dir

FORMAT = 1
SHARD_TOKENS = 1 << 28  # 256M tokens (512 MB of uint16) per train shard
_ENCODE_CHUNK = 256  # documents per encode_batch call: bounds memory, keeps the Rust batch encoder busy


def default_workers() -> int:
    """One tokenizing process per CPU this process may run on, at most 32."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(n, 32))


def tokenizer_fingerprint(tok) -> str:
    return hashlib.sha256(f"{tok.to_str()}\0eos={tok.eos_id}".encode("utf-8")).hexdigest()


def source_fingerprint(units: Sequence[Unit], heldout_fraction: float) -> str:
    h = hashlib.sha256(f"k3-token-shards-v{FORMAT}\0heldout={heldout_fraction!r}\0n={len(units)}\0".encode())
    for u in units:
        h.update(u.key().encode("utf-8", "surrogatepass") + b"\n")
    return h.hexdigest()


def _dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "int32"


# ------------------------------------------------------------------------------------------ reading


class TokenShards:
    """One split's token stream over its shard files. `read(lo, hi)` reads only the tokens [lo, hi) (a range
    may span shards) at their offsets with pread, so memory stays bounded by what is read: not through a
    memory map, where the kernel's fault-around maps ~64 KB of the page cache into the process around every
    row touched, and a long run's resident size grows towards the whole shard. `shard(i)` is a shard's
    read-only np.memmap, for reading a split whole (`as_array`: the held-out stream)."""

    def __init__(self, directory: str, split: dict, dtype: str):
        self.directory, self.dtype = directory, np.dtype(dtype)
        self.files = [os.path.join(directory, s["file"]) for s in split["shards"]]
        self.sizes = [int(s["tokens"]) for s in split["shards"]]
        self.starts = [0]
        for n in self.sizes:
            self.starts.append(self.starts[-1] + n)
        self.num_tokens = self.starts[-1]
        self.num_documents = int(split["documents"])
        self._docs_file = os.path.join(directory, split["docs"])
        self._maps: list[np.memmap | None] = [None] * len(self.files)
        self._fds: list[int | None] = [None] * len(self.files)

    def __len__(self) -> int:
        return self.num_tokens

    def shard(self, i: int) -> np.memmap:
        if self._maps[i] is None:
            self._maps[i] = np.memmap(self.files[i], dtype=self.dtype, mode="r", shape=(self.sizes[i],))
        return self._maps[i]

    def _pread(self, i: int, off: int, n: int) -> np.ndarray:
        if self._fds[i] is None:
            self._fds[i] = os.open(self.files[i], os.O_RDONLY)
        size = self.dtype.itemsize
        data = os.pread(self._fds[i], n * size, off * size)
        if len(data) != n * size:
            raise OSError(f"{self.files[i]}: short read at token {off} (the shard was truncated?)")
        return np.frombuffer(data, dtype=self.dtype)

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Tokens [lo, hi) of the stream (a read-only array)."""
        if not 0 <= lo <= hi <= self.num_tokens:
            raise IndexError(f"tokens [{lo}, {hi}) outside the stream of {self.num_tokens}")
        parts = []
        i = bisect.bisect_right(self.starts, lo) - 1
        while lo < hi:
            take = min(hi, self.starts[i + 1]) - lo
            if take > 0:
                parts.append(self._pread(i, lo - self.starts[i], take))
                lo += take
            i += 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, self.dtype)

    def close(self) -> None:
        for i, fd in enumerate(self._fds):
            if fd is not None:
                os.close(fd)
                self._fds[i] = None

    def document_offsets(self) -> np.ndarray:
        """int64 [documents + 1], memory-mapped: document i is tokens [o[i], o[i + 1]) (its ids, then eos)."""
        return np.load(self._docs_file, mmap_mode="r", allow_pickle=False)

    def as_array(self) -> np.ndarray:
        """The whole stream as one array: the memory map itself for one shard (the held-out split)."""
        if len(self.files) == 1:
            return self.shard(0)
        return self.read(0, self.num_tokens)


@dataclass
class TokenSet:
    directory: str
    index: dict
    train: TokenShards
    heldout: TokenShards
    reused: bool = False

    @property
    def fingerprint(self) -> str:
        """Names this set's train stream in the loader's state, so a resume onto other data is refused."""
        return os.path.basename(self.directory)


def open_token_set(directory: str) -> TokenSet | None:
    """The finished set in `directory`, or None when it is missing, from another format or incomplete."""
    try:
        with open(os.path.join(directory, "index.json"), "rb") as f:
            index = json.loads(f.read().decode("utf-8"))
        if index.get("format") != FORMAT:
            return None
        itemsize = np.dtype(index["dtype"]).itemsize
        for split in ("train", "heldout"):
            for s in index[split]["shards"]:
                if os.path.getsize(os.path.join(directory, s["file"])) != int(s["tokens"]) * itemsize:
                    return None
            if not os.path.isfile(os.path.join(directory, index[split]["docs"])):
                return None
        return TokenSet(directory, index, TokenShards(directory, index["train"], index["dtype"]),
                        TokenShards(directory, index["heldout"], index["dtype"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ------------------------------------------------------------------------------------------ workers


_WORKER_TOK = None


def _init_worker(tok_json: str, eos_token: str) -> None:
    # One encoding thread per worker: the processes are the parallelism (and the Rust pool must not spin up a
    # thread per core in each of them).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    global _WORKER_TOK
    from tokenizers import Tokenizer

    from k3.data.tokenizer import K3Tokenizer

    _WORKER_TOK = K3Tokenizer(Tokenizer.from_str(tok_json), eos_token=eos_token)


def _run_in_worker(args):
    return tokenize_task(_WORKER_TOK, *args)


@dataclass
class TaskResult:
    part: str
    lengths: np.ndarray  # int64 per document: its ids (the eos after them not counted)
    hashes: np.ndarray  # uint64 per document
    roles: np.ndarray  # uint8 per document
    empty: int
    nbytes: int


def tokenize_task(tok, units: Sequence[Unit], part: str, dtype: str) -> TaskResult:
    """Tokenize the documents of `units` into the file `part` (each document's ids, then eos); empty
    documents are skipped (counted)."""
    lengths, hashes, roles, empty = [], [], [], 0
    eos = tok.eos_id
    with open(part, "wb") as f:
        def flush(texts: list[str]) -> None:
            for ids in tok.encode_batch(texts):
                lengths.append(len(ids))
                f.write(np.asarray(ids + [eos], dtype=dtype).tobytes())
            texts.clear()

        texts: list[str] = []
        for u in units:
            for d in read_unit(u):
                if not d.text:
                    empty += 1
                    continue
                hashes.append(content_hash(d.text.encode("utf-8", "surrogatepass")))
                roles.append(u.role)
                texts.append(d.text)
                if len(texts) >= _ENCODE_CHUNK:
                    flush(texts)
        if texts:
            flush(texts)
    return TaskResult(part, np.asarray(lengths, dtype=np.int64), np.asarray(hashes, dtype=np.uint64),
                      np.asarray(roles, dtype=np.uint8), empty, sum(u.nbytes for u in units))


def group_tasks(units: Sequence[Unit], task_bytes: int = UNIT_BYTES) -> list[list[Unit]]:
    """Consecutive units gathered into tasks of about `task_bytes` (a unit larger than that is a task alone)."""
    tasks, cur, size = [], [], 0
    for u in units:
        cur.append(u)
        size += u.nbytes
        if size >= task_bytes:
            tasks.append(cur)
            cur, size = [], 0
    if cur:
        tasks.append(cur)
    return tasks


# ------------------------------------------------------------------------------------------ writing


class _ShardWriter:
    """Appends whole documents to `{name}-NNNNN.bin` files of at most `limit` tokens (a longer document gets a
    shard of its own); `finish` writes the document offsets and returns the split's index entry."""

    def __init__(self, directory: str, name: str, dtype: str, limit: int | None):
        self.directory, self.name, self.dtype, self.limit = directory, name, np.dtype(dtype), limit
        self.shards: list[dict] = []
        self.lengths: list[np.ndarray] = []
        self.f = None
        self.in_shard = 0

    def _open(self) -> None:
        fn = f"{self.name}-{len(self.shards):05d}.bin"
        self.shards.append({"file": fn, "tokens": 0, "documents": 0})
        self.f = open(os.path.join(self.directory, fn), "wb")
        self.in_shard = 0

    def _close(self) -> None:
        if self.f is not None:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            self.f = None

    def add(self, tokens: np.ndarray, doc_tokens: np.ndarray) -> None:
        """`tokens`: the documents' tokens back to back; `doc_tokens`: each one's count (eos included)."""
        while doc_tokens.shape[0]:
            if self.f is None:
                self._open()
            room = np.inf if self.limit is None else self.limit - self.in_shard
            ends = np.cumsum(doc_tokens)
            k = int(np.searchsorted(ends, room, side="right"))
            if k == 0 and self.in_shard == 0:
                k = 1
            if k == 0:
                self._close()
                continue
            n = int(ends[k - 1])
            self.f.write(np.ascontiguousarray(tokens[:n], dtype=self.dtype).tobytes())
            self.shards[-1]["tokens"] += n
            self.shards[-1]["documents"] += k
            self.in_shard += n
            self.lengths.append(doc_tokens[:k])
            tokens, doc_tokens = tokens[n:], doc_tokens[k:]
            if doc_tokens.shape[0]:
                self._close()

    def finish(self) -> dict:
        self._close()
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, dtype=np.int64)
        offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        docs = f"{self.name}.docs.npy"
        with open(os.path.join(self.directory, docs), "wb") as f:
            np.save(f, offsets, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        return {"shards": self.shards, "documents": int(lengths.shape[0]), "tokens": int(offsets[-1]), "docs": docs}


def build_token_set(tok, units: Sequence[Unit], cache_dir: str, *, workers: int | None = None,
                    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION, shard_tokens: int = SHARD_TOKENS,
                    task_bytes: int = UNIT_BYTES, progress: bool = False) -> TokenSet:
    """The token set of `units` under `tok` in `cache_dir/<digest>/`: reused when it is there and complete,
    else built (see the module docstring). `workers`: tokenizing processes (default `default_workers()`; one,
    or a single task, tokenizes in this process with the batch encoder's own threads)."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    tok_fp, src_fp = tokenizer_fingerprint(tok), source_fingerprint(units, heldout_fraction)
    key = hashlib.sha256(f"{tok_fp}\0{src_fp}".encode()).hexdigest()[:20]
    final = os.path.join(cache_dir, key)
    found = open_token_set(final)
    if found is not None:
        found.reused = True
        return found

    t0 = time.perf_counter()
    tmp = final + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a build that was killed
    try:
        _build(tok, units, tmp, heldout_fraction, shard_tokens, task_bytes, workers, progress,
               {"tokenizer": tok_fp, "sources": src_fp}, t0)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a bad record or Ctrl-C: nothing half-built stays behind
        raise
    os.makedirs(cache_dir, exist_ok=True)
    replace_dir(tmp, final)
    fsync_dir(cache_dir)
    built = open_token_set(final)
    assert built is not None, final
    return built


def _build(tok, units: Sequence[Unit], tmp: str, heldout_fraction: float, shard_tokens: int, task_bytes: int,
           workers: int | None, progress: bool, fingerprints: dict, t0: float) -> None:
    """Tokenize `units` into parts (in parallel), then assemble the shards and the index in `tmp`."""
    parts_dir = os.path.join(tmp, "parts")
    os.makedirs(parts_dir)
    dtype = _dtype(tok.vocab_size)
    tasks = group_tasks(units, task_bytes)
    args = [(t, os.path.join(parts_dir, f"part-{i:06d}.bin"), dtype) for i, t in enumerate(tasks)]
    nproc = min(workers or default_workers(), len(tasks))
    from tqdm import tqdm

    bar = tqdm(total=sum(u.nbytes for u in units), unit="B", unit_scale=True, desc="tokenizing",
               disable=not progress, dynamic_ncols=True)
    results: list[TaskResult] = []
    try:
        if nproc > 1:
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(nproc, initializer=_init_worker, initargs=(tok.to_str(), tok.eos_token)) as pool:
                for r in pool.imap(_run_in_worker, args):  # in task order, whichever worker finishes first
                    results.append(r)
                    bar.update(r.nbytes)
        else:
            for a in args:
                results.append(tokenize_task(tok, *a))
                bar.update(results[-1].nbytes)
    finally:
        bar.close()

    dest = assign(np.concatenate([r.hashes for r in results]) if results else np.zeros(0, np.uint64),
                  np.concatenate([r.roles for r in results]) if results else np.zeros(0, np.uint8),
                  heldout_fraction)
    writers = {TRAIN: _ShardWriter(tmp, "train", dtype, shard_tokens),
               HELDOUT: _ShardWriter(tmp, "heldout", dtype, None)}
    at = 0
    for r in results:
        n = r.lengths.shape[0]
        d, per_doc = dest[at: at + n], r.lengths + 1
        at += n
        tokens = np.fromfile(r.part, dtype=dtype)
        where = np.repeat(d, per_doc)
        for role, w in writers.items():
            w.add(tokens[where == role], per_doc[d == role])
        os.unlink(r.part)
    os.rmdir(parts_dir)
    index = {"format": FORMAT, "dtype": dtype, **fingerprints,
             "heldout_fraction": heldout_fraction, "units": len(units),
             "bytes": int(sum(u.nbytes for u in units)),
             "train": writers[TRAIN].finish(), "heldout": writers[HELDOUT].finish(),
             "duplicates": int((dest == 0).sum()), "empty": int(sum(r.empty for r in results)),
             "workers": nproc, "seconds": round(time.perf_counter() - t0, 3)}
    with open(os.path.join(tmp, "index.json"), "wb") as f:
        f.write(json.dumps(index, indent=1).encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
