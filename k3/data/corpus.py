"""Text corpora: the default corpora (this Python's own files) and user files.

The default corpus needs no download and is real text written by others. On CPU it is every ``*.py`` file
under ``sysconfig.get_paths()["stdlib"]`` (site-packages, ``__pycache__`` and files over 1 MB excluded); on a
GPU (`default_units(full=True)`) it grows to every Python source and documentation file of the installation,
standard library plus site-packages (k3.data.sources.installation_files), so a GPU run does not repeat it.
Held-out documents are chosen by a stable hash of each document's name (its path relative to the standard
library root, with ``/`` separators), so the split does not depend on the machine, the file-system order, or
how much of the corpus is read; the standard library's held-out files are the same in both corpora. User
files (`--data`) are held out by a hash of their content instead (k3.data.sources.assign).
"""

from __future__ import annotations

import hashlib
import os
from typing import Iterable, Sequence

from k3.data.sources import (  # noqa: F401  (re-exported: the corpus API predates the streaming sources)
    ACCEPTED,
    DATA_EXTENSIONS,
    DEFAULT_HELDOUT_FRACTION,
    HELDOUT,
    TEXT_EXTENSIONS,
    TRAIN,
    Document,
    Unit,
    _SKIPPED_DIRS,
    _relpath,
    installation_files,
    python_files,
    read_unit,
    resolve_paths,
    file_units,
    stdlib_root,
)
from k3.data.sources import MAX_SOURCE_FILE_BYTES as MAX_STDLIB_FILE_BYTES


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


def stdlib_files() -> list[str]:
    """Absolute paths of the standard library's ``*.py`` files, sorted by path relative to its root.

    Excludes site-packages (and dist-packages), ``__pycache__`` and files larger than 1 MB.
    Symbolic links to directories are not followed.
    """
    return [p for _, p in python_files(stdlib_root(), (".py",), _SKIPPED_DIRS)]


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


# ----------------------------------------------------------------------------- the default corpora as units


def default_units(full: bool = False, max_bytes: int | None = None) -> list[Unit]:
    """The default corpus as units for the token shards (k3.data.shards): held-out files first (sorted by
    name), then the train files in the order of `default_corpus` (by the SHA-1 of the name). `full`: the whole
    installation (`installation_files`), else the standard library's ``*.py`` files, `default_corpus`'s files.
    `max_bytes` caps the train files by their sizes on disk, the last one read only up to the cap."""
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    if full:
        files = installation_files()
    else:
        root = stdlib_root()
        files = [(_relpath(p, root), p) for p in stdlib_files()]
    held_names = {d.name for d in split_documents([Document(n, "") for n, _ in files])[1]}
    held = [(n, p) for n, p in files if n in held_names]
    train = sorted(((n, p) for n, p in files if n not in held_names),
                   key=lambda np_: (hashlib.sha1(np_[0].encode("utf-8")).digest(), np_[0]))
    units = []
    for role, part in ((HELDOUT, held), (TRAIN, train)):
        budget = max_bytes if role == TRAIN else None
        for name, path in part:
            if budget is not None and budget <= 0:
                break
            st = os.stat(path)
            cap = None
            if budget is not None:
                cap = budget if st.st_size > budget else None
                budget -= st.st_size
            units.append(Unit("text", path, st.st_size, st.st_mtime_ns, stop=cap, role=role, name=name,
                              nbytes=st.st_size if cap is None else cap))
    return units


# -------------------------------------------------------------------------------------- user files


def load_documents(paths: Iterable[str | os.PathLike]) -> list[Document]:
    """Documents from files, directories and glob patterns, in the order given (directories: sorted,
    recursive; k3.data.sources.resolve_paths), all in memory (training streams them instead: k3.data.shards).

    Text files (.txt .md .py .rst) are one document each, named by their path; .jsonl files give one
    document per non-blank line (``{"text": ...}``), named ``path:line``; .parquet files one per
    non-null row of their ``text`` column, named ``path:row`` (needs pyarrow). Nothing is unpickled.
    Raises ValueError for a missing path, an unsupported extension, a bad .jsonl line (naming
    ``file:line``), non-UTF-8 text, or a directory with no accepted files.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    docs: list[Document] = []
    for path in resolve_paths(paths):
        for u in file_units(path, unit_bytes=1 << 62):
            docs.extend(read_unit(u))
    return docs
