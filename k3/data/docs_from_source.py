"""`k3 data docs-from-source`: a documentation chat task made from Python sources' docstrings (the standard library by
default), the "docs" domain of `k3 distill`'s README example and of benchmarks/mopd_demo.py.

Every module, class and function docstring of at least `head_chars + reply_chars // 2` characters becomes one
conversation: the user gives its opening (cut at the last line break before `head_chars`, or at `head_chars` when
that break comes in the first third), the assistant continues it for `reply_chars` characters:

    {"messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Continue the documentation of <file>[:<name>]:\\n\\n" + <the opening>},
        {"role": "assistant", "content": <the next reply_chars characters>}],
     "source": "<file relative to its root>[:<class or function name>]"}

Held out by file, as `k3 data sft-from-source` holds out (the stable hash of the file's relative path), so the two
domains' held-out files are the same. `max_records` / `max_heldout` keep the first records in file order. The output
depends only on the files.
"""

from __future__ import annotations

import ast
import warnings
from dataclasses import dataclass

from k3.data.sft_from_source import DEFAULT_HELDOUT_FRACTION, definitions, source_texts

SYSTEM = "You write documentation."
DEFAULT_HEAD_CHARS = 160
DEFAULT_REPLY_CHARS = 320


@dataclass
class DocsStats:
    files: int = 0
    heldout_files: int = 0
    unparsable_files: int = 0
    docstrings: int = 0  # long enough to be cut into an opening and a reply
    train: int = 0
    heldout: int = 0


def file_records(text: str, name: str, head_chars: int, reply_chars: int, stats: DocsStats) -> list[dict]:
    """The conversations of one source file (`name`: its path relative to the root)."""
    try:
        with warnings.catch_warnings():  # a source's own warnings are not the user's
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, ValueError):
        stats.unparsable_files += 1
        return []
    out = []
    for node in [tree, *definitions(tree, (ast.FunctionDef, ast.ClassDef))]:
        doc = ast.get_docstring(node)
        if not doc or len(doc) < head_chars + reply_chars // 2:
            continue
        stats.docstrings += 1
        cut = doc.rfind("\n", 0, head_chars)
        cut = cut if cut > head_chars // 3 else head_chars
        what = name if node is tree else f"{name}:{node.name}"
        out.append({"messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": f"Continue the documentation of {what}:\n\n{doc[:cut]}"},
                                 {"role": "assistant", "content": doc[cut:cut + reply_chars]}],
                    "source": what})
    return out


def docs_from_source(paths: list[str], heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
                     head_chars: int = DEFAULT_HEAD_CHARS, reply_chars: int = DEFAULT_REPLY_CHARS,
                     max_records: int | None = None,
                     max_heldout: int | None = None) -> tuple[list[dict], list[dict], DocsStats]:
    """(training records, held-out records, counts) from the docstrings of the .py files under `paths` (the
    standard library without paths; see the module docstring)."""
    stats = DocsStats()
    train, held = [], []
    for name, text, h in source_texts(paths, heldout_fraction, stats):
        (held if h else train).extend(file_records(text, name, head_chars, reply_chars, stats))
    train, held = train[:max_records], held[:max_heldout]
    stats.train, stats.heldout = len(train), len(held)
    return train, held, stats
