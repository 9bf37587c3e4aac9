"""k3.data.long_docs: package documents in import order, deterministic, held out as the default corpus holds out."""

import os
import re

import pytest

from k3.data.corpus import split_documents, Document
from k3.data.long_docs import import_order, long_documents, package_text


def _write(root, rel, text):
    path = os.path.join(root, *rel.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _order(text):
    return re.findall(r"^# file: (\S+)$", text, flags=re.M)


@pytest.fixture
def lib(tmp_path):
    root = str(tmp_path / "lib")
    # pkg: z imports nothing; a imports y (absolute) and z (relative); y imports z inside a function;
    # __init__ imports a's names; b and c import each other (a cycle); d imports a name of the package itself.
    _write(root, "pkg/__init__.py", "from .a import thing\n")
    _write(root, "pkg/a.py", "import pkg.y\nfrom . import z\nthing = 1\n")
    _write(root, "pkg/y.py", "def f():\n    from pkg.z import g\n    return g\n")
    _write(root, "pkg/z.py", "import os\ng = 2\n")
    _write(root, "pkg/b.py", "from .c import x\n")
    _write(root, "pkg/c.py", "from .b import x\nx = 3\n")
    _write(root, "pkg/d.py", "from pkg import thing\n")
    _write(root, "pkg/bad.py", "def (:\n")  # does not parse: no dependencies, still included
    with open(os.path.join(root, "pkg", "latin.py"), "wb") as f:
        f.write(b"s = '\xe9'\n")  # not UTF-8: skipped
    _write(root, "pkg/empty.py", "")  # empty: skipped
    _write(root, "pkg/sub/__init__.py", "from ..z import g\n")  # a subpackage: its own document
    _write(root, "pkg/sub/m.py", "from . import n\n")
    _write(root, "pkg/sub/n.py", "N = 1\n")
    _write(root, "notpkg/x.py", "x = 1\n")  # no __init__.py: not a package
    _write(root, "top.py", "import pkg\n")
    return root


def test_modules_come_after_the_in_package_modules_they_import(lib):
    docs = {d.name: d.text for d in long_documents(root=lib, heldout_fraction=0.0)}
    assert sorted(docs) == ["pkg", "pkg/sub"]
    order = [p.split("/")[-1][:-3] for p in _order(docs["pkg"])]
    assert sorted(order) == ["__init__", "a", "b", "bad", "c", "d", "y", "z"]  # latin (not UTF-8), empty skipped
    pos = {m: i for i, m in enumerate(order)}
    for mod, dep in [("a", "y"), ("a", "z"), ("y", "z"), ("__init__", "a"), ("d", "__init__")]:
        assert pos[dep] < pos[mod], (mod, dep, order)
    # ready modules by name (bad and z have no dependencies); the b <-> c cycle, left at the end, is broken by
    # name: b first
    assert order == ["bad", "z", "y", "a", "__init__", "d", "b", "c"]
    assert _order(docs["pkg/sub"]) == ["pkg/sub/__init__.py", "pkg/sub/n.py", "pkg/sub/m.py"]
    # each module's text follows its header whole
    assert "# file: pkg/a.py\nimport pkg.y\nfrom . import z\nthing = 1\n" in docs["pkg"]


def test_import_order_is_deterministic_and_breaks_cycles_by_name():
    deps = {"m3": {"m1"}, "m1": {"m2"}, "m2": {"m1"}, "m0": set(), "m4": {"m3", "zz_not_a_module"}}
    assert import_order(deps) == ["m0", "m1", "m2", "m3", "m4"]
    assert import_order(dict(reversed(list(deps.items())))) == import_order(deps)


def test_documents_are_deterministic_and_min_chars_filters(lib):
    a = long_documents(root=lib, heldout_fraction=0.0)
    b = long_documents(root=lib, heldout_fraction=0.0)
    assert [(d.name, d.text) for d in a] == [(d.name, d.text) for d in b]
    short = min(len(d.text) for d in a)
    kept = long_documents(root=lib, min_chars=short + 1, heldout_fraction=0.0)
    assert [d.name for d in kept] == [d.name for d in a if len(d.text) > short]
    with pytest.raises(ValueError, match="min_chars"):
        long_documents(root=lib, min_chars=-1)


def test_split_is_disjoint_and_follows_the_corpus_rule(lib):
    for i in range(6):  # enough packages that a fraction of one half holds some out
        _write(lib, f"p{i}/__init__.py", f"X = {i}\n")
        _write(lib, f"p{i}/m.py", "from . import X\n")
    train = long_documents(root=lib, heldout_fraction=0.5)
    held = long_documents(root=lib, heldout=True, heldout_fraction=0.5)
    names = sorted(d.name for d in train + held)
    assert not {d.name for d in train} & {d.name for d in held} and train and held
    expect = {d.name for d in split_documents([Document(n, "") for n in names], 0.5)[1]}
    assert {d.name for d in held} == expect
    # a training package leaves out the files the default corpus holds out by their own names
    all_files = sorted(os.path.relpath(os.path.join(dp, f), lib).replace(os.sep, "/")
                       for dp, _, fs in os.walk(lib) for f in fs if f.endswith(".py"))
    held_files = {d.name for d in split_documents([Document(n, "") for n in all_files], 0.5)[1]}
    for d in train:
        assert not set(_order(d.text)) & held_files
    assert any(set(_order(d.text)) & held_files for d in held) or not held_files


def test_package_text_skips_named_files(lib):
    files = [("pkg/a.py", os.path.join(lib, "pkg", "a.py")), ("pkg/z.py", os.path.join(lib, "pkg", "z.py"))]
    assert _order(package_text("pkg", files)) == ["pkg/z.py", "pkg/a.py"]
    assert _order(package_text("pkg", files, skip={"pkg/z.py"})) == ["pkg/a.py"]


@pytest.mark.slow  # reads and parses the whole standard library (~15 s on 2 shared cores)
def test_standard_library_packages():
    train = long_documents()
    held = long_documents(heldout=True)
    assert train and not {d.name for d in train} & {d.name for d in held}
    json_doc = next(d.text for d in train if d.name == "json")
    order = _order(json_doc)
    assert order.index("json/scanner.py") < order.index("json/decoder.py") < order.index("json/__init__.py")
