"""What the task families share: the train/test split by a stable hash, the scripted actions a correct agent
takes, and running a host-side check inside a fork of the final sandbox.

Scripted actions (`scripted_solution(task)` of every family) are plain dicts, `{"tool": NAME, "args": {...}}`,
in the tools' own vocabulary: "shell" {"command"}, "python" {"code"}, "write_file" {"path", "content"},
"submit" {"answer"}. They are what a correct agent does, for tests and for cold-start trajectories.
"""

from __future__ import annotations

import hashlib
import json
import secrets

from k3.env.sandbox import ExecResult, Sandbox
from k3.env.task import check_split

PYTHON = "python3"          # the interpreter a sandbox provides on its PATH
CHECK_DIR = ".k3_check"     # where a verifier writes its material in the fork (never in the agent's sandbox)


def unit_hash(key: str) -> float:
    """A stable number in [0, 1) for `key` (the same on every machine and Python run)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0 ** 64


def split_of(key: str, test_fraction: float) -> str:
    """"test" for the held-out fraction of keys, else "train": a key never changes sides."""
    return "test" if unit_hash(key) < test_fraction else "train"


def check_n(split: str, n: int) -> None:
    check_split(split)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")


def action(tool: str, **args) -> dict:
    return {"tool": tool, "args": args}


def run_check(sandbox: Sandbox, files: dict[str, str], script: str, *,
              timeout: float) -> tuple[dict | list | None, ExecResult]:
    """Write `files` (paths under CHECK_DIR) into `sandbox` (a fork: the agent never sees them), run the Python
    file `script` in isolated mode with a fresh nonce on stdin, and return (the JSON object the script printed
    after the nonce, or None, the ExecResult). The nonce tells the checker's line from whatever the code under
    test prints; a forged line gains nothing, since the host judges the values in it against expectations that
    never enter the sandbox."""
    for rel, content in files.items():
        sandbox.write_file(f"{CHECK_DIR}/{rel}", content)
    nonce = secrets.token_hex(16)
    res = sandbox.exec([PYTHON, "-I", "-S", f"{CHECK_DIR}/{script}"], stdin=nonce + "\n", timeout=timeout)
    for line in res.stdout.splitlines():
        if line.startswith(nonce):
            try:
                return json.loads(line[len(nonce):]), res
            except ValueError:
                return None, res
    return None, res


def describe_failure(res: ExecResult) -> str:
    """Why a check's process gave no result, in a line."""
    if res.timed_out:
        return f"timed out after {res.wall_s:.1f} s"
    tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
    how = f"exit code {res.exit_code}" + (f" ({res.signal})" if res.signal else "")
    return how + (": " + " | ".join(tail) if tail else "")
