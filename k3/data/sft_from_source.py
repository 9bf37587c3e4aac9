"""`k3 data sft-from-source`: a docstring-to-code chat task made from Python sources (the standard library by default).

Every function (module level, method or nested; `def` or `async def`) whose body opens with a docstring and has
more after it becomes one conversation:

    {"messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": PROMPT + "\\n\\n" + <the function's decorators, signature and docstring>},
        {"role": "assistant", "content": <the whole function: decorators, signature, docstring, body>}],
     "source": "<file relative to its root>:<line>"}

The code is the source text itself (comments and layout kept), dedented; it compiles on its own. A function is
left out when its dedented text does not compile alone (e.g. a multi-line string at column 0) or is longer than
`max_chars`, and a file that does not parse is skipped; both are counted.

Held out by file: a file is held out when the stable hash of its path relative to its root (k3.data.corpus's,
with `/` separators) is below `heldout_fraction`, so no function of a held-out file is trained on, and a
held-out function whose code also occurs in the training part is dropped. `max_records` / `max_heldout` keep the
records with the smallest stable hashes of their `source`, in file order. The output depends only on the files.
"""

from __future__ import annotations

import ast
import collections
import hashlib
import json
import os
import textwrap
import warnings
from dataclasses import dataclass

from k3.data.corpus import _relpath, is_heldout, stdlib_files, stdlib_root

SYSTEM = "You are an expert Python programmer."
PROMPT = "Write the Python function with this signature and docstring. Reply with the complete function only."
DEFAULT_HELDOUT_FRACTION = 0.05
DEFAULT_MAX_CHARS = 1500


@dataclass
class SourceStats:
    files: int = 0
    heldout_files: int = 0
    unparsable_files: int = 0
    functions: int = 0  # with a docstring and a body after it
    too_long: int = 0
    not_standalone: int = 0  # its dedented text does not compile on its own
    leaked: int = 0  # held-out functions also in the training part, dropped
    train: int = 0
    heldout: int = 0


_BLOCKS = (ast.stmt, ast.excepthandler, ast.match_case)  # what holds statements; an expression never does


def definitions(tree: ast.AST, kinds: tuple[type, ...]):
    """Every node of `kinds` (statement types: functions, classes) in `tree`, in ast.walk's order (breadth first),
    but walking statements only: a definition is a statement, and expressions (most of a tree's nodes) cannot hold
    one, so the nodes skipped are never on the path to one and the order of those found is ast.walk's."""
    todo = collections.deque([tree])
    while todo:
        node = todo.popleft()
        if isinstance(node, kinds):
            yield node
        for _, value in ast.iter_fields(node):
            if isinstance(value, list):
                todo.extend(v for v in value if isinstance(v, _BLOCKS))


def _functions(tree: ast.AST):
    return definitions(tree, (ast.FunctionDef, ast.AsyncFunctionDef))


def _has_docstring(node) -> bool:
    b = node.body
    return (len(b) >= 2 and isinstance(b[0], ast.Expr) and isinstance(b[0].value, ast.Constant)
            and isinstance(b[0].value.value, str) and b[0].lineno > node.lineno)


def conversation(prompt_code: str, code: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{PROMPT}\n\n{prompt_code}"},
            {"role": "assistant", "content": code}]


def file_records(text: str, name: str, max_chars: int, stats: SourceStats) -> list[dict]:
    """The conversations of one source file (`name`: its path relative to the root)."""
    try:
        with warnings.catch_warnings():  # a source's own warnings (an invalid escape, ...) are not the user's, and
            warnings.simplefilter("ignore")  # a filter turning them into errors must not change the data
            tree = ast.parse(text)
    except (SyntaxError, ValueError):
        stats.unparsable_files += 1
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in sorted(_functions(tree), key=lambda n: (n.lineno, n.col_offset)):
        if not _has_docstring(node):
            continue
        stats.functions += 1
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        code = textwrap.dedent("".join(lines[first - 1:node.end_lineno])).rstrip() + "\n"
        if len(code) > max_chars:
            stats.too_long += 1
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                compile(code, name, "exec", dont_inherit=True)
        except (SyntaxError, ValueError):
            stats.not_standalone += 1
            continue
        head = node.body[0].end_lineno - first + 1  # decorators, signature and docstring
        prompt_code = "".join(code.splitlines(keepends=True)[:head]).rstrip() + "\n"
        out.append({"messages": conversation(prompt_code, code), "source": f"{name}:{node.lineno}"})
    return out


def _source_files(paths: list[str]) -> list[tuple[str, str]]:
    """(name relative to its root, path) of every .py file: the standard library's without paths."""
    if not paths:
        root = stdlib_root()
        return [(_relpath(p, root), p) for p in stdlib_files()]
    found = []
    for p in paths:
        if os.path.isdir(p):
            for dirpath, dirnames, filenames in os.walk(p):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
                found += [(_relpath(os.path.join(dirpath, f), p), os.path.join(dirpath, f))
                          for f in filenames if f.endswith(".py")]
        elif os.path.isfile(p):
            found.append((os.path.basename(p), p))
        else:
            raise ValueError(f"{p}: no such file or directory (give .py files or directories of them)")
    return sorted(found)


def _stable_key(rec: dict) -> str:
    return hashlib.sha256(rec["source"].encode("utf-8", "surrogatepass")).hexdigest()


def _cap(records: list[dict], n: int | None) -> list[dict]:
    if n is None or len(records) <= n:
        return records
    keep = {id(r) for r in sorted(records, key=_stable_key)[:n]}
    return [r for r in records if id(r) in keep]


def source_texts(paths: list[str], heldout_fraction: float, stats):
    """(name, text, held out) of each readable UTF-8 .py file under `paths` (the standard library without paths),
    held out by a hash of its name (k3.data.corpus.is_heldout); counts `files`, `unparsable_files` and
    `heldout_files` on `stats`. What `sft_from_source` and k3.data.docs_from_source both read."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    for name, path in _source_files(paths):
        try:
            with open(path, "rb") as f:
                text = f.read().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            stats.unparsable_files += 1
            continue
        stats.files += 1
        h = is_heldout(name, heldout_fraction)
        stats.heldout_files += h
        yield name, text, h


def sft_from_source(paths: list[str], heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
                    max_chars: int = DEFAULT_MAX_CHARS, max_records: int | None = None,
                    max_heldout: int | None = None) -> tuple[list[dict], list[dict], SourceStats]:
    """(training records, held-out records, counts) from the .py files under `paths` (see the module docstring)."""
    stats = SourceStats()
    train, held = [], []
    for name, text, h in source_texts(paths, heldout_fraction, stats):
        (held if h else train).extend(file_records(text, name, max_chars, stats))
    seen = {r["messages"][-1]["content"] for r in train}
    kept = [r for r in held if r["messages"][-1]["content"] not in seen]
    stats.leaked = len(held) - len(kept)
    train, held = _cap(train, max_records), _cap(kept, max_heldout)
    stats.train, stats.heldout = len(train), len(held)
    return train, held, stats


def write_jsonl(records: list[dict], path: str) -> None:
    from k3.files import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
