"""A fork server for candidates' processes: ``python -m k3.kernel_reward.forkserver`` is a fresh interpreter that
imports torch and the worker, then for each request line on stdin (a JSON object: spec, log, mem, device) forks a
child that runs the worker (a new session, the limits, its own log), answers the child's pid on stdout, and when
the child ends writes its status (negative: the signal) to ``exit`` in the child's run directory.

No candidate code ever runs in the server itself, so every child starts from the same clean state as a fresh
interpreter, without paying torch's import (seconds) each time. k3.kernel_reward.runner uses it with
``Limits(start="forkserver")``.
"""

from __future__ import annotations

import json
import os
import select
import sys

import torch  # noqa: F401  (the point of the server: imported once)

from k3.kernel_reward import worker


def _child(req: dict) -> None:
    from k3.kernel_reward.runner import _environment, _limit

    os.setsid()
    _limit(req["mem"])
    env = _environment(dict(os.environ), req["device"])
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(os.path.dirname(req["spec"]))
    code = 1
    try:
        code = worker.main([req["spec"]])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _write_exit(directory: str, status: int) -> None:
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    path = os.path.join(directory, "exit")
    with open(path + ".tmp", "w") as f:
        f.write(str(code))
    os.replace(path + ".tmp", path)


def serve() -> None:
    children: dict[int, str] = {}
    stdin = sys.stdin.fileno()
    buf = b""
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.02)
        if ready:
            data = os.read(stdin, 65536)
            if not data:  # the harness went away
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(req)
                children[pid] = os.path.dirname(req["spec"])
                sys.stdout.write(f"{pid}\n")
                sys.stdout.flush()
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in children:
                _write_exit(children.pop(pid), status)


if __name__ == "__main__":
    serve()
