"""Where training text comes from, streamed: `--data` files, directories and glob patterns, and the default
corpora (this Python's own sources).

Sources are cut into `Unit`s, pieces small enough for one tokenizing worker (a text file, a byte range of a
.jsonl file, a row group of a .parquet file), and `read_unit` yields a unit's documents one at a time, so a
many-GB input never sits in memory whole. Every document has a content hash (`content_hash`, 64 bits of the
SHA-1 of its UTF-8 text): duplicates are recognised by it and user data is held out by it (`assign`), so the
held-out set is stable under adding, removing, renaming or reordering other files, and two copies of one text
can never land on both sides of the split.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import site
import sys
import sysconfig
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np

TEXT_EXTENSIONS = (".txt", ".md", ".py", ".rst")
DATA_EXTENSIONS = (".jsonl", ".parquet")
ACCEPTED = TEXT_EXTENSIONS + DATA_EXTENSIONS
UNIT_BYTES = 16 << 20  # a .jsonl byte range / a batch of text files per tokenizing task
MAX_SOURCE_FILE_BYTES = 1_000_000  # the default corpora keep code and prose, not giant generated tables
DEFAULT_HELDOUT_FRACTION = 0.02

# Document roles: "split" documents are held out by their content hash; the default corpora split by name
# beforehand (k3.data.corpus), so their units carry a fixed role.
SPLIT, TRAIN, HELDOUT = 0, 1, 2
_ROLES = {"split": SPLIT, "train": TRAIN, "heldout": HELDOUT}
_GLOB_CHARS = set("*?[")
_SKIPPED_DIRS = {"__pycache__", "site-packages", "dist-packages"}  # in the standard library's tree


@dataclass
class Document:
    name: str
    text: str


@dataclass(frozen=True)
class Unit:
    """One piece of a source: `kind` "text" (one document; `stop`: read only its first `stop` bytes), "jsonl"
    (the lines starting in bytes [start, stop)) or "parquet" (row groups [start, stop)). `size` (bytes) and
    `mtime_ns` identify the file's version for the token cache; `nbytes` is the unit's share of it (progress,
    task sizes); `name` names a text document (default: its path)."""

    kind: str
    path: str
    size: int
    mtime_ns: int
    start: int = 0
    stop: int | None = None
    role: int = SPLIT
    name: str | None = None
    nbytes: int = 0

    def key(self) -> str:
        fields = (self.kind, os.path.abspath(self.path), self.size, self.mtime_ns, self.start, self.stop, self.role)
        return "\0".join(map(str, fields))


def content_hash(data: bytes) -> int:
    """64 bits of the SHA-1 of a document's UTF-8 text: the duplicate key and, over 2^64, the held-out score.
    Two different documents share it with probability ~n^2 / 2^65 (about 3e-4 at 10^8 documents)."""
    return int.from_bytes(hashlib.sha1(data).digest()[:8], "big")


# ------------------------------------------------------------------------------------------ --data


def accepted_message() -> str:
    return ("accepted: files ending in " + ", ".join(ACCEPTED)
            + " (.jsonl: one JSON object per line with a string 'text' field; .parquet: a 'text' column),"
            " directories containing them, or glob patterns (quoted, e.g. 'data/**/*.jsonl')")


def _relpath(path: str, root: str) -> str:
    return os.path.relpath(path, root).replace(os.sep, "/")


def directory_files(root: str) -> list[str]:
    """Files with an accepted extension under `root`, recursively, sorted by relative path.
    Hidden files and directories (names starting with '.') and __pycache__ are skipped."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        for fn in filenames:
            if fn.startswith(".") or os.path.splitext(fn)[1].lower() not in ACCEPTED:
                continue
            path = os.path.join(dirpath, fn)
            if os.path.isfile(path):
                found.append((_relpath(path, root), path))
    found.sort()
    return [p for _, p in found]


def resolve_paths(specs: Iterable[str | os.PathLike]) -> list[str]:
    """The files named by `specs`, in order: a file as given (any extension: an unsupported one is an error
    when read), a directory's accepted files (`directory_files`), a glob pattern's matches sorted (`**`
    recurses; matched directories expand, matched files with other extensions are skipped). A file reached
    twice is kept once, at its first place. ValueError names a spec that is missing or matches nothing."""
    out, seen = [], set()

    def add(path: str) -> None:
        real = os.path.realpath(path)
        if real not in seen:
            seen.add(real)
            out.append(path)

    for spec in specs:
        spec = os.fspath(spec)
        if os.path.isdir(spec):
            files = directory_files(spec)
            if not files:
                raise ValueError(f"{spec}: directory has no files to read; {accepted_message()}")
            for f in files:
                add(f)
        elif os.path.isfile(spec):
            add(spec)
        elif _GLOB_CHARS & set(spec):
            files = []
            for m in sorted(glob.glob(spec, recursive=True)):
                if os.path.isdir(m):
                    files += directory_files(m)
                elif os.path.isfile(m) and os.path.splitext(m)[1].lower() in ACCEPTED:
                    files.append(m)
            if not files:
                raise ValueError(f"{spec}: the pattern matches no files to read; {accepted_message()}")
            for f in files:
                add(f)
        else:
            raise ValueError(f"{spec}: no such file or directory; {accepted_message()}")
    return out


def _parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("reading .parquet needs pyarrow: pip install pyarrow") from None
    return pq


def file_units(path: str, role: int = SPLIT, unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """The units of one file: a text file is one; a .jsonl file one per `unit_bytes` byte range; a .parquet
    file one per row group (its 'text' column checked here, so a wrong file fails before any work)."""
    st = os.stat(path)
    ext = os.path.splitext(path)[1].lower()
    base = dict(path=path, size=st.st_size, mtime_ns=st.st_mtime_ns, role=role)
    if ext in TEXT_EXTENSIONS:
        return [Unit("text", nbytes=st.st_size, **base)]
    if ext == ".jsonl":
        starts = range(0, max(st.st_size, 1), unit_bytes)
        return [Unit("jsonl", start=s, stop=min(s + unit_bytes, st.st_size), nbytes=min(unit_bytes, st.st_size - s),
                     **base) for s in starts]
    if ext == ".parquet":
        pf = _parquet().ParquetFile(path)
        names = pf.schema_arrow.names
        if "text" not in names:
            raise ValueError(f"{path}: no 'text' column (columns: {', '.join(names)})")
        return [Unit("parquet", start=g, stop=g + 1, nbytes=pf.metadata.row_group(g).total_byte_size, **base)
                for g in range(pf.num_row_groups)]
    raise ValueError(f"{path}: unsupported file type {ext or '(no extension)'!r}; {accepted_message()}")


def data_units(specs: Sequence[str | os.PathLike], unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """The units of `--data` (held out by content hash), in the order of `resolve_paths`."""
    return [u for p in resolve_paths(specs) for u in file_units(p, SPLIT, unit_bytes)]


# ------------------------------------------------------------------------------------- reading


def _line_number(path: str, offset: int) -> int:
    """The 1-based number of the line starting at byte `offset` (counted only when a line is reported)."""
    n, left = 1, offset
    with open(path, "rb") as f:
        while left > 0:
            chunk = f.read(min(left, 1 << 24))
            if not chunk:
                break
            n += chunk.count(b"\n")
            left -= len(chunk)
    return n


def _read_text(u: Unit, strict: bool) -> Iterator[Document]:
    try:
        with open(u.path, "rb") as f:
            data = f.read()
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        if not strict:
            return  # the default corpora skip files that cannot be read or are not UTF-8
        if isinstance(e, OSError):
            raise ValueError(f"{u.path}: cannot read ({e.strerror or e})") from None
        raise ValueError(f"{u.path}: not UTF-8 text (byte {e.start})") from None
    if u.stop is not None and len(data) > u.stop:
        text = data[: u.stop].decode("utf-8", errors="ignore")  # a cap cut inside a character drops it
    yield Document(u.name or u.path, text)


def _bad_line(u: Unit, lineno: int | None, at: int, what: str) -> ValueError:
    n = lineno if lineno is not None else _line_number(u.path, at)
    return ValueError(f"{u.path}:{n}: {what}")


def _read_jsonl(u: Unit) -> Iterator[Document]:
    with open(u.path, "rb") as f:
        pos = u.start
        if pos > 0:  # the line under way at `start` belongs to the unit before
            f.seek(pos - 1)
            pos += len(f.readline()) - 1
        stop = u.size if u.stop is None else u.stop
        lineno = 1 if u.start == 0 else None  # a later range learns its line numbers only to report one
        while pos < stop:
            raw = f.readline()
            if not raw:
                break
            at, pos = pos, pos + len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise _bad_line(u, lineno, at, "line is not UTF-8") from None
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise _bad_line(u, lineno, at, f"invalid JSON ({e.msg})") from None
                if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                    raise _bad_line(u, lineno, at, "expected a JSON object with a string 'text' field")
                yield Document(f"{u.path}:{lineno}" if lineno is not None else f"{u.path}@{at}", obj["text"])
            if lineno is not None:
                lineno += 1


def _read_parquet(u: Unit) -> Iterator[Document]:
    pf = _parquet().ParquetFile(u.path)
    row = sum(pf.metadata.row_group(g).num_rows for g in range(u.start))
    for batch in pf.iter_batches(row_groups=list(range(u.start, u.stop)), columns=["text"], batch_size=1024):
        for value in batch.column(0).to_pylist():
            if value is not None:
                if isinstance(value, bytes):
                    try:
                        value = value.decode("utf-8")
                    except UnicodeDecodeError:
                        raise ValueError(f"{u.path}: row {row}: 'text' is not UTF-8") from None
                if not isinstance(value, str):
                    raise ValueError(f"{u.path}: row {row}: 'text' is {type(value).__name__}, not a string")
                yield Document(f"{u.path}:{row}", value)
            row += 1


def read_unit(u: Unit) -> Iterator[Document]:
    """The unit's documents, one at a time. User files are strict (ValueError naming the file and the line or
    row of a bad record); the default corpora's files (fixed roles) that are not UTF-8 are skipped."""
    if u.kind == "text":
        return _read_text(u, strict=u.role == SPLIT)
    if u.kind == "jsonl":
        return _read_jsonl(u)
    return _read_parquet(u)


def iter_documents(units: Iterable[Unit]) -> Iterator[tuple[Document, int]]:
    for u in units:
        for d in read_unit(u):
            yield d, u.role


# ------------------------------------------------------------------------------------- the split


def assign(hashes: np.ndarray, roles: np.ndarray, heldout_fraction: float = DEFAULT_HELDOUT_FRACTION
           ) -> np.ndarray:
    """Where each document goes, in order: 0 dropped (a duplicate: its content hash was seen earlier, whatever
    the role), TRAIN or HELDOUT. A "split" document is held out when hash / 2^64 < `heldout_fraction`. As in
    k3.data.corpus.split_documents, with two or more documents both sides are non-empty: if none is held out the
    split document with the smallest hash is, and if all are the one with the largest goes to train."""
    hashes = np.asarray(hashes, dtype=np.uint64)
    roles = np.asarray(roles, dtype=np.uint8)
    dest = np.zeros(hashes.shape[0], dtype=np.uint8)
    if hashes.shape[0] == 0:
        return dest
    _, first = np.unique(hashes, return_index=True)
    keep = np.zeros(hashes.shape[0], dtype=bool)
    keep[first] = True
    cut = np.uint64(min(int(heldout_fraction * 2.0**64), 2**64 - 1))
    split = keep & (roles == SPLIT)
    dest[keep] = roles[keep]
    dest[split] = np.where(hashes[split] < cut, HELDOUT, TRAIN)
    if keep.sum() >= 2 and heldout_fraction > 0 and split.any():
        idx = np.flatnonzero(split)
        if not (dest == HELDOUT).any():
            dest[idx[np.argmin(hashes[idx])]] = HELDOUT
        elif not (dest == TRAIN).any():
            dest[idx[np.argmax(hashes[idx])]] = TRAIN
    return dest


# ------------------------------------------------------------------------------------ default corpora


def stdlib_root() -> str:
    return os.path.realpath(sysconfig.get_paths()["stdlib"])


def site_roots() -> list[str]:
    """This Python's site-packages directories, real paths, deduplicated, in import order: the site-packages and
    dist-packages directories on sys.path first (a venv's own, then the system's it was made to see, the user's),
    then purelib, platlib and site's list."""
    paths = sysconfig.get_paths()
    cands = [p for p in sys.path if os.path.basename(os.path.normpath(p)) in ("site-packages", "dist-packages")]
    cands += [paths.get("purelib"), paths.get("platlib")]
    try:
        cands += site.getsitepackages()
    except AttributeError:  # some virtualenvs' site module lacks it
        pass
    out = []
    for p in cands:
        if p and os.path.isdir(p):
            r = os.path.realpath(p)
            if r not in out:
                out.append(r)
    return out


def python_files(root: str, extensions: tuple[str, ...], skip_dirs: set[str]) -> list[tuple[str, str]]:
    """(path relative to `root` with '/', absolute path) of the files under `root` ending in `extensions`,
    sorted; directories named in `skip_dirs`, hidden ones and package metadata (*.dist-info, *.egg-info) are
    skipped, and so are files over 1 MB. Symbolic links to directories are not followed."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")
                       and not d.endswith((".dist-info", ".egg-info"))]
        for fn in filenames:
            if not fn.endswith(extensions):
                continue
            path = os.path.join(dirpath, fn)
            try:
                if not os.path.isfile(path) or os.path.getsize(path) > MAX_SOURCE_FILE_BYTES:
                    continue
            except OSError:
                continue
            found.append((_relpath(path, root), path))
    found.sort()
    return found


def installation_files() -> list[tuple[str, str]]:
    """(name, path) of every Python source and documentation file (.py .pyi .md .rst .txt, at most 1 MB) of
    this installation: the standard library (names relative to its root, as in the CPU corpus) and each
    site-packages directory (names prefixed with the directory's name). A file reached twice (a symbolic link,
    purelib == platlib) is kept once, and so is a name found under two site-packages directories (a package
    installed both in a venv and in the system site-packages it sees, two dist-packages on Debian): the copy of
    the first directory in import order, the one Python imports."""
    exts = (".py", ".pyi", ".md", ".rst", ".txt")
    out, seen, names = [], set(), set()
    roots = [(stdlib_root(), "", _SKIPPED_DIRS)]
    roots += [(r, os.path.basename(r) + "/", {"__pycache__"}) for r in site_roots()]
    for root, prefix, skip in roots:
        for rel, path in python_files(root, exts, skip):
            real, name = os.path.realpath(path), prefix + rel
            if real not in seen and name not in names:
                seen.add(real)
                names.add(name)
                out.append((name, path))
    return out
