"""Long documents for context extension (report §3.4): each package of this Python's standard library as one text,
its modules concatenated in import order.

A package is a directory holding ``__init__.py`` under the standard library root that the default corpus reads
(k3.data.corpus: the same ``*.py`` files, site-packages, ``__pycache__``, hidden directories and files over 1 MB left
out). Its document is its own modules (the ``.py`` files directly in it; a subpackage is a document of its own),
each preceded by one header line naming its path relative to the root (``# file: email/utils.py``), in import
order: a module comes after the modules of the same package that it imports (``import p.m``, ``from p import m``,
``from . import m``, ``from .m import x``, anywhere in the module, found with `ast`; importing a name of the package
itself, ``from p import x``, depends on ``__init__.py``). Modules whose dependencies are all placed are taken by
name; a cycle is broken by placing the remaining module with the smallest name. So the text reads as the package
is built: definitions before their uses, the long-range dependencies that a long context is for.

Held out as the default corpus holds out: by the stable hash of the package's name (its directory relative to the
root, ``email/mime``) with the default corpus's fraction and rule (k3.data.corpus.split_documents), so a held-out
package is never a training document here. A training package's document leaves out the files that the default
corpus holds out (by their own names), so no held-out file of the default corpus is trained on through a long
document. (A held-out package's other files are training files of the default corpus, one file at a time: what is
new in its document is the whole package in one context.) Files that cannot be read, are not UTF-8 or are empty
are skipped, as the corpus skips them; a file that does not parse has no dependencies.
"""

from __future__ import annotations

import ast
import heapq
import os
import warnings

from k3.data.corpus import Document, _relpath, split_documents, stdlib_root
from k3.data.sources import _SKIPPED_DIRS, DEFAULT_HELDOUT_FRACTION, python_files

HEADER = "# file: {path}\n"


def _read_utf8(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _imported(tree: ast.AST, package: str, module: str, modules: set[str]) -> set[str]:
    """The modules of `package` (dotted, e.g. "email.mime") among `modules` (their names: "utils", "__init__")
    that the module `module` imports anywhere in `tree`."""
    parts = package.split(".") if package else []
    deps: set[str] = set()

    def resolve(full: str, names: list[str]) -> None:
        """`from full import names` (names empty: `import full`)."""
        if full == package:
            if not names:
                deps.add("__init__")
            for n in names:
                deps.add(n if n in modules else "__init__")
        elif package and full.startswith(package + "."):
            first = full[len(package) + 1:].split(".")[0]
            if first in modules:
                deps.add(first)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                resolve(a.name, [])
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: level 1 is this package, 2 its parent, ...
                if node.level - 1 > len(parts):
                    continue
                base = parts[: len(parts) - (node.level - 1)]
                full = ".".join(base + ([node.module] if node.module else []))
            else:
                full = node.module or ""
            resolve(full, [a.name for a in node.names if a.name != "*"] if full == package else [])
    deps.discard(module)
    return deps


def import_order(deps: dict[str, set[str]]) -> list[str]:
    """The names of `deps` (module -> the modules it imports, among the keys) with every module after its
    dependencies: of the modules whose dependencies are all placed, the smallest name first; when none is (a
    cycle), the smallest remaining name is placed next, which breaks the cycle deterministically."""
    deps = {m: {d for d in ds if d in deps and d != m} for m, ds in deps.items()}
    users: dict[str, list[str]] = {m: [] for m in deps}
    for m, ds in deps.items():
        for d in ds:
            users[d].append(m)
    waiting = {m: len(ds) for m, ds in deps.items()}
    ready = [m for m, n in waiting.items() if n == 0]
    heapq.heapify(ready)
    left = set(deps)
    order: list[str] = []
    while left:
        if ready:
            m = heapq.heappop(ready)
            if m not in left:
                continue  # already placed to break a cycle
        else:
            m = min(left)
        left.discard(m)
        order.append(m)
        for u in users[m]:
            waiting[u] -= 1
            if waiting[u] == 0 and u in left:
                heapq.heappush(ready, u)
    return order


def _packages(root: str) -> dict[str, list[tuple[str, str]]]:
    """Package directory (relative to `root`, '/' separators) -> its modules' (relative name, path), for every
    directory holding __init__.py among the default corpus's files."""
    by_dir: dict[str, list[tuple[str, str]]] = {}
    for rel, path in python_files(root, (".py",), _SKIPPED_DIRS):
        d = rel.rsplit("/", 1)[0] if "/" in rel else ""
        by_dir.setdefault(d, []).append((rel, path))
    return {d: files for d, files in by_dir.items()
            if d and os.path.isfile(os.path.join(root, *d.split("/"), "__init__.py"))}


def package_text(package_dir: str, files: list[tuple[str, str]], skip: set[str] = frozenset()) -> str:
    """The document of one package: its modules (`files`: (name relative to the root, path)) but those named in
    `skip`, unreadable, non-UTF-8 or empty ones, in `import_order`, each after its header line."""
    package = package_dir.replace("/", ".")
    texts: dict[str, tuple[str, str]] = {}
    for rel, path in files:
        if rel in skip:
            continue
        text = _read_utf8(path)
        if text:
            texts[os.path.basename(rel)[:-3]] = (rel, text)
    modules = set(texts)
    deps = {}
    for m, (rel, text) in texts.items():
        try:
            with warnings.catch_warnings():  # a source's own warnings (invalid escapes, ...) are not ours
                warnings.simplefilter("ignore")
                tree = ast.parse(text)
        except (SyntaxError, ValueError):
            deps[m] = set()
            continue
        deps[m] = _imported(tree, package, m, modules)
    out = []
    for m in import_order(deps):
        rel, text = texts[m]
        out.append(HEADER.format(path=rel) + (text if text.endswith("\n") else text + "\n"))
    return "".join(out)


def long_documents(heldout: bool = False, min_chars: int = 0, root: str | None = None,
                   heldout_fraction: float = DEFAULT_HELDOUT_FRACTION) -> list[Document]:
    """The package documents of the standard library (or of `root`), named by their package directory, sorted by
    name: the training packages, or with `heldout` the held-out ones (see the module docstring); only those of at
    least `min_chars` characters."""
    if min_chars < 0:
        raise ValueError(f"min_chars must be >= 0, got {min_chars}")
    root = os.path.realpath(root) if root is not None else stdlib_root()
    packages = _packages(root)
    names = sorted(packages)
    held_packages = {d.name for d in split_documents([Document(n, "") for n in names], heldout_fraction)[1]}
    skip: set[str] = set()
    if not heldout:  # the default corpus's held-out files (split_documents over all of its names, as it splits)
        all_names = [_relpath(p, root) for _, p in python_files(root, (".py",), _SKIPPED_DIRS)]
        skip = {d.name for d in split_documents([Document(n, "") for n in all_names], heldout_fraction)[1]}
    docs = []
    for name in names:
        if (name in held_packages) != heldout:
            continue
        text = package_text(name, packages[name], skip)
        if text and len(text) >= min_chars:
            docs.append(Document(name, text))
    return docs


def package_documents(heldout: bool = False, min_chars: int = 0) -> list[str]:
    """The texts of `long_documents(heldout, min_chars)`: one per standard-library package, its modules in import
    order."""
    return [d.text for d in long_documents(heldout, min_chars)]


__all__ = ["HEADER", "import_order", "long_documents", "package_documents", "package_text"]
