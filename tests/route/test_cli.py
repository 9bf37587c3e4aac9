"""`k3 route`'s flags (k3.route.cli) and the layering: the router sits above k3.serve, talks to the instances over
HTTP only, and needs no torch."""

import ast
import pathlib
import subprocess
import sys

import pytest

from k3.cli import build_parser, main

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_flags():
    args = build_parser().parse_args(["route", "--backend", "http://127.0.0.1:8001/", "--backend",
                                      "https://gpu-2.internal:8443/v1", "--classes", "short:512:0.3", "long:inf:0.7",
                                      "--policy", "round-robin", "--fleet-tokens", "20000"])
    assert args.backends == ["http://127.0.0.1:8001", "https://gpu-2.internal:8443"]
    assert args.classes == ["short:512:0.3", "long:inf:0.7"] and args.policy == "round-robin"
    assert (args.host, args.port, args.session_header) == ("127.0.0.1", 8080, "X-Session-Id")


@pytest.mark.parametrize("argv,message", [
    (["--backend", "127.0.0.1:8001"], "expected a backend URL like http://127.0.0.1:8001"),
    (["--backend", "http://127.0.0.1"], "expected a backend URL"),
    (["--backend", "http://h:1", "--policy", "random"], "invalid choice: 'random'"),
    (["--backend", "http://h:1", "--queue-wait", "-1"], "expected a finite number >= 0"),
    (["--backend", "http://h:1", "--fleet-tokens", "0"], "expected a positive integer, got '0'"),
    ([], "the following arguments are required: --backend"),
])
def test_bad_flags_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["route", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_bad_classes_and_backends_are_refused_before_serving(capsys):
    assert main(["route", "--backend", "http://h:1", "--classes", "short:512:0.5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3 route: --classes: ") and "MAX_TOKENS 'inf'" in err
    assert main(["route", "--backend", "http://h:1", "--backend", "http://h:1/"]) == 2
    assert "a backend is given twice" in capsys.readouterr().err


def test_serve_does_not_import_route_and_route_needs_no_torch():
    for path in (ROOT / "k3" / "serve").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "k3.route" or n.startswith("k3.route.") for n in names), path
    code = "import sys, k3.route.app, k3.route.cli; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
