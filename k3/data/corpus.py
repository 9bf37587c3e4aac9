"""Text corpora: the default corpus (this Python's standard library sources) and user files.

The default corpus needs no download and is real text written by others: every ``*.py`` file under
``sysconfig.get_paths()["stdlib"]`` (site-packages, ``__pycache__`` and files over 1 MB excluded).
Held-out documents are chosen by a stable hash of each document's name (its path relative to the
standard library root, with ``/`` separators), so the split does not depend on the machine, the
file-system order, or how much of the corpus is read.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from typing import Iterable, Sequence

TEXT_EXTENSIONS = (".txt", ".md", ".py", ".rst")
DATA_EXTENSIONS = (".jsonl", ".parquet")
ACCEPTED = TEXT_EXTENSIONS + DATA_EXTENSIONS
MAX_STDLIB_FILE_BYTES = 1_000_000  # keep the corpus code, not giant generated tables or fixtures
DEFAULT_HELDOUT_FRACTION = 0.02
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class Document:
    name: str
    text: str


# --------------------------------------------------------------------------------------------- split


def _unit_hash(name: str) -> float:
    """A number in [0, 1) from the SHA-1 of `name`: stable across machines, processes and versions."""
    digest = hashlib.sha1(name.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_heldout(name: str, heldout_fraction: float = DEFAULT_HELDOUT_FRACTION) -> bool:
    return _unit_hash(name) < heldout_fraction


def split_documents(docs: Sequence[Document], heldout_fraction: float = DEFAULT_HELDOUT_FRACTION
                    ) -> tuple[list[Document], list[Document]]:
    """(train, heldout) by a stable hash of each document's name; order within each part is kept.

    With two or more documents both parts are non-empty: if the hash holds out none, the document
    with the smallest hash is held out; if it holds out all, the one with the largest goes to train.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    docs = list(docs)
    scores = [_unit_hash(d.name) for d in docs]
    held = [s < heldout_fraction for s in scores]
    if len(docs) >= 2 and heldout_fraction > 0:
        if not any(held):
            held[min(range(len(docs)), key=lambda i: (scores[i], i))] = True
        elif all(held):
            held[max(range(len(docs)), key=lambda i: (scores[i], -i))] = False
    train = [d for d, h in zip(docs, held) if not h]
    heldout = [d for d, h in zip(docs, held) if h]
    return train, heldout


# ------------------------------------------------------------------------------------ default corpus


def stdlib_root() -> str:
    return os.path.realpath(sysconfig.get_paths()["stdlib"])


def _relpath(path: str, root: str) -> str:
    return os.path.relpath(path, root).replace(os.sep, "/")


def stdlib_files() -> list[str]:
    """Absolute paths of the standard library's ``*.py`` files, sorted by path relative to its root.

    Excludes site-packages (and dist-packages), ``__pycache__`` and files larger than 1 MB.
    Symbolic links to directories are not followed.
    """
    root = stdlib_root()
    found: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            path = os.path.join(dirpath, fn)
            try:
                if not os.path.isfile(path) or os.path.getsize(path) > MAX_STDLIB_FILE_BYTES:
                    continue
            except OSError:
                continue
            found.append((_relpath(path, root), path))
    found.sort()
    return [p for _, p in found]


def _read_utf8(path: str) -> str | None:
    """The file's text, or None when it cannot be read or is not UTF-8."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def default_corpus(max_bytes: int | None = None) -> tuple[list[Document], list[Document]]:
    """(train, heldout) documents from the standard library sources; names are relative paths.

    About 2% of the files (SHA-1 of the relative path, see `split_documents`) are held out; the
    held-out set is the same whatever `max_bytes` is. Files that cannot be read, are not UTF-8, or
    are empty are skipped.

    Train documents come in a fixed pseudo-random order (sorted by the SHA-1 of the name), so any
    prefix is a spread-out sample of the library. `max_bytes` caps the total UTF-8 size of the train
    text: whole files are taken in that order and the last one is cut to fit, so the train text of a
    smaller cap is a prefix of that of a larger one. Held-out documents are sorted by name.
    """
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    root = stdlib_root()
    files = [(_relpath(p, root), p) for p in stdlib_files()]
    names = [n for n, _ in files]
    held_names = {d.name for d in split_documents([Document(n, "") for n in names])[1]}

    heldout: list[Document] = []
    train_files: list[tuple[str, str]] = []
    for name, path in files:
        if name in held_names:
            text = _read_utf8(path)
            if text:
                heldout.append(Document(name, text))
        else:
            train_files.append((name, path))

    train_files.sort(key=lambda np_: (hashlib.sha1(np_[0].encode("utf-8")).digest(), np_[0]))
    train: list[Document] = []
    budget = max_bytes
    for name, path in train_files:
        if budget is not None and budget <= 0:
            break
        text = _read_utf8(path)
        if not text:
            continue
        if budget is not None:
            data = text.encode("utf-8")
            if len(data) > budget:
                text = data[:budget].decode("utf-8", errors="ignore")  # drop a split character
                if not text:
                    break
                budget = 0
            else:
                budget -= len(data)
        train.append(Document(name, text))
    return train, heldout


# -------------------------------------------------------------------------------------- user files


def _accepted_message() -> str:
    return ("accepted: files ending in " + ", ".join(ACCEPTED)
            + " (.jsonl: one JSON object per line with a string 'text' field; .parquet: a 'text' column),"
            " or directories containing them")


def _read_text_file(path: str) -> list[Document]:
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
    return [Document(path, text)]


def _read_jsonl(path: str) -> list[Document]:
    docs = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{path}:{lineno}: line is not UTF-8") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ValueError(f"{path}:{lineno}: expected a JSON object with a string 'text' field")
            docs.append(Document(f"{path}:{lineno}", obj["text"]))
    return docs


def _read_parquet(path: str) -> list[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("reading .parquet needs pyarrow: pip install pyarrow") from None
    pf = pq.ParquetFile(path)
    if "text" not in pf.schema_arrow.names:
        raise ValueError(f"{path}: no 'text' column (columns: {', '.join(pf.schema_arrow.names)})")
    docs = []
    row = 0
    for batch in pf.iter_batches(columns=["text"], batch_size=4096):
        for value in batch.column(0).to_pylist():
            if value is not None:
                if isinstance(value, bytes):
                    try:
                        value = value.decode("utf-8")
                    except UnicodeDecodeError:
                        raise ValueError(f"{path}: row {row}: 'text' is not UTF-8") from None
                if not isinstance(value, str):
                    raise ValueError(f"{path}: row {row}: 'text' is {type(value).__name__}, not a string")
                docs.append(Document(f"{path}:{row}", value))
            row += 1
    return docs


def _read_file(path: str) -> list[Document]:
    ext = os.path.splitext(path)[1].lower()
    if ext in TEXT_EXTENSIONS:
        return _read_text_file(path)
    if ext == ".jsonl":
        return _read_jsonl(path)
    if ext == ".parquet":
        return _read_parquet(path)
    raise ValueError(f"{path}: unsupported file type {ext or '(no extension)'!r}; {_accepted_message()}")


def _directory_files(root: str) -> list[str]:
    """Files with an accepted extension under `root`, recursively, sorted by relative path.
    Hidden files and directories (names starting with '.') are skipped."""
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


def load_documents(paths: Iterable[str | os.PathLike]) -> list[Document]:
    """Documents from files and directories, in the order given (directories: sorted, recursive).

    Text files (.txt .md .py .rst) are one document each, named by their path; .jsonl files give one
    document per non-blank line (``{"text": ...}``), named ``path:line``; .parquet files one per
    non-null row of their ``text`` column, named ``path:row`` (needs pyarrow). Nothing is unpickled.
    Raises ValueError for a missing path, an unsupported extension, a bad .jsonl line (naming
    ``file:line``), non-UTF-8 text, or a directory with no accepted files.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    docs: list[Document] = []
    for p in paths:
        path = os.fspath(p)
        if os.path.isdir(path):
            files = _directory_files(path)
            if not files:
                raise ValueError(f"{path}: directory has no files to read; {_accepted_message()}")
            for f in files:
                docs.extend(_read_file(f))
        elif os.path.isfile(path):
            docs.extend(_read_file(path))
        else:
            raise ValueError(f"{path}: no such file or directory; {_accepted_message()}")
    return docs
