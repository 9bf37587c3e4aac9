"""Sandboxes for tool execution (report §5.3.2): the interface every environment codes against.

A sandbox is a workspace directory plus the processes that tool calls start in it. Its state is its filesystem
and its environment variables, nothing else: no process outlives the tool call that started it (so "paused" is
the resting state between calls), which makes `fork`, `snapshot` and `restore` exact.

Inside the sandbox the workspace is at `WORKSPACE` ("/workspace"); paths given to the file methods are relative
to it (or absolute under it). A path that leaves the workspace (`..`, an absolute path elsewhere, a symlink
pointing out) raises `SandboxError`.

Kinds (`create_sandbox(kind=...)`):
- "bwrap": isolated with bubblewrap (k3.env.bwrap): new user, PID, network and mount namespaces, the system
  read-only, the workspace the one writable place, rlimits and a wall-clock limit per call.
- "none": no isolation at all (`UnisolatedSandbox`): commands run as the calling user on the host. Only for an
  explicit `--sandbox none`; creating one prints a warning on stderr every time.
"""

from __future__ import annotations

import abc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace

WORKSPACE = "/workspace"
SANDBOX_KINDS = ("bwrap", "none")


class SandboxError(Exception):
    """A sandbox operation was refused or failed (bad path, closed sandbox, missing bubblewrap, ...)."""


@dataclass(frozen=True)
class Limits:
    """Per-call resource limits. `wall_seconds` is enforced by killing the call's whole process tree."""
    cpu_seconds: int = 30
    memory_bytes: int = 1 << 30          # address space per process
    processes: int = 64
    file_size_bytes: int = 64 << 20
    wall_seconds: float = 60.0
    output_bytes: int = 64 << 10         # stdout and stderr are each cut to this many bytes

    def validate(self) -> None:
        for name in ("cpu_seconds", "memory_bytes", "processes", "file_size_bytes", "wall_seconds", "output_bytes"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"sandbox limit '{name}' must be a positive number, got {v!r}")


@dataclass
class ExecResult:
    """What one tool call's command did. `exit_code` is None when it was killed (timed out or by a signal)."""
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    timed_out: bool = False
    signal: str | None = None            # e.g. "SIGKILL" when a signal ended it
    truncated: bool = False              # stdout or stderr was cut to Limits.output_bytes

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class Snapshot:
    """An immutable saved state of a sandbox: its workspace tree (a directory the sandbox owns) and environment."""
    path: str
    env: dict = field(default_factory=dict)


class Sandbox(abc.ABC):
    """The operations environments use. Subclasses implement `_run` (one command in the sandbox) and may replace
    the default copy-based fork/snapshot/restore."""

    kind: str = ""

    def __init__(self, workspace: str, env: dict | None = None, limits: Limits | None = None, owns_root: str | None = None):
        self.workspace = workspace        # host path of the writable workspace
        self.env = dict(env or {})
        self.limits = limits or Limits()
        self.limits.validate()
        self._root = owns_root            # a host directory removed by close()
        self._closed = False
        self._snapshots: list[str] = []

    # -- commands ---------------------------------------------------------------------------------------------
    def exec(self, command: list[str] | str, *, stdin: str | None = None, timeout: float | None = None,
             cwd: str = WORKSPACE, env: dict | None = None) -> ExecResult:
        """Run `command` (argv list, or a string run by /bin/sh -c) inside the sandbox and wait for it. Never raises
        for what the command does (non-zero exit, timeout, a signal): that is in the result."""
        self._check_open()
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise SandboxError(f"a command is a non-empty list of strings or a string, got {command!r}")
        wall = self.limits.wall_seconds if timeout is None else min(float(timeout), self.limits.wall_seconds)
        return self._run(argv, stdin=stdin, timeout=wall, cwd=cwd, env={**self.env, **(env or {})})

    @abc.abstractmethod
    def _run(self, argv: list[str], *, stdin: str | None, timeout: float, cwd: str, env: dict) -> ExecResult:
        ...

    # -- files (host-side access to the workspace, for tools and verifiers) ------------------------------------
    def host_path(self, path: str) -> str:
        """The host path of a workspace path, refusing anything that resolves outside the workspace."""
        self._check_open()
        if not isinstance(path, str) or "\x00" in path:
            raise SandboxError(f"a path is a string without NUL bytes, got {path!r}")
        rel = path
        if os.path.isabs(path):
            if not (path == WORKSPACE or path.startswith(WORKSPACE + "/")):
                raise SandboxError(f"path {path!r} is outside the workspace {WORKSPACE}")
            rel = path[len(WORKSPACE):].lstrip("/")
        root = os.path.realpath(self.workspace)
        full = os.path.realpath(os.path.join(root, rel))
        if full != root and not full.startswith(root + os.sep):
            raise SandboxError(f"path {path!r} resolves outside the workspace")
        return full

    def read_file(self, path: str) -> bytes:
        p = self.host_path(path)
        if not os.path.isfile(p):
            raise SandboxError(f"no file {path!r} in the workspace")
        with open(p, "rb") as f:
            return f.read()

    def write_file(self, path: str, data: bytes | str) -> None:
        p = self.host_path(path)
        if os.path.isdir(p):
            raise SandboxError(f"{path!r} is a directory")
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)

    def list_files(self, path: str = ".") -> list[str]:
        """Every file under `path`, as workspace-relative paths, sorted."""
        base = self.host_path(path)
        root = os.path.realpath(self.workspace)
        out = []
        for d, dirs, files in os.walk(base):
            dirs.sort()
            for name in files:
                out.append(os.path.relpath(os.path.join(d, name), root))
        return sorted(out)

    # -- life cycle ---------------------------------------------------------------------------------------------
    def fork(self) -> "Sandbox":
        """An independent sandbox with a copy of this one's current state (for judging without side effects)."""
        self._check_open()
        root = tempfile.mkdtemp(prefix="k3-sandbox-")
        ws = os.path.join(root, "workspace")
        _copy_tree(self.workspace, ws)
        return self._clone(ws, root)

    def snapshot(self) -> Snapshot:
        """Save the current state; `restore(snapshot)` brings it back exactly. Valid until `close()`."""
        self._check_open()
        d = tempfile.mkdtemp(prefix="k3-snapshot-")
        _copy_tree(self.workspace, os.path.join(d, "workspace"))
        self._snapshots.append(d)
        return Snapshot(path=d, env=dict(self.env))

    def restore(self, snapshot: Snapshot) -> None:
        self._check_open()
        src = os.path.join(snapshot.path, "workspace")
        if not os.path.isdir(src):
            raise SandboxError(f"snapshot {snapshot.path} no longer exists")
        tmp = self.workspace + ".restoring"
        _copy_tree(src, tmp)
        old = self.workspace + ".old"
        os.replace(self.workspace, old)
        os.replace(tmp, self.workspace)
        shutil.rmtree(old, ignore_errors=True)
        self.env = dict(snapshot.env)

    def _clone(self, workspace: str, root: str) -> "Sandbox":
        return type(self)(workspace, env=self.env, limits=self.limits, owns_root=root)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for d in self._snapshots:
            shutil.rmtree(d, ignore_errors=True)
        if self._root:
            shutil.rmtree(self._root, ignore_errors=True)

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("the sandbox is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _copy_tree(src: str, dst: str) -> None:
    """Copy a workspace tree exactly (modes, times, symlinks as symlinks)."""
    shutil.copytree(src, dst, symlinks=True)


class UnisolatedSandbox(Sandbox):
    """Runs commands directly on the host, in the workspace directory, as the calling user. No isolation: only
    rlimits and the wall-clock limit apply. The path `/workspace` in commands is NOT remapped."""

    kind = "none"

    def _run(self, argv, *, stdin, timeout, cwd, env):
        if cwd == WORKSPACE or cwd.startswith(WORKSPACE + "/"):
            cwd = self.host_path(cwd)
        limits = self.limits

        def preexec():
            import resource
            resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds))
            resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
            resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size_bytes, limits.file_size_bytes))

        full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": self.workspace, "LANG": "C.UTF-8",
                    **env}
        return run_process(argv, stdin=stdin, timeout=timeout, cwd=cwd, env=full_env, preexec_fn=preexec,
                           output_bytes=limits.output_bytes)


def run_process(argv, *, stdin, timeout, cwd, env, preexec_fn, output_bytes) -> ExecResult:
    """Run a process in its own session, kill its whole process group at `timeout`, and cut its output."""
    t0 = time.perf_counter()
    try:
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                             env=env, preexec_fn=preexec_fn, start_new_session=True)
    except OSError as e:
        return ExecResult(exit_code=127, stdout="", stderr=f"cannot start {argv[0]!r}: {e}",
                          wall_s=time.perf_counter() - t0)
    timed_out = False
    try:
        out, err = p.communicate(stdin.encode() if stdin is not None else None, timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(p.pid)
        out, err = p.communicate()
    _kill_group(p.pid)  # anything the command left running in the background
    truncated = len(out) > output_bytes or len(err) > output_bytes
    sig = None
    if p.returncode is not None and p.returncode < 0:
        try:
            sig = signal.Signals(-p.returncode).name
        except ValueError:
            sig = f"signal {-p.returncode}"
    return ExecResult(exit_code=None if (timed_out or p.returncode < 0) else p.returncode,
                      stdout=out[:output_bytes].decode("utf-8", "replace"),
                      stderr=err[:output_bytes].decode("utf-8", "replace"),
                      wall_s=time.perf_counter() - t0, timed_out=timed_out, signal=sig, truncated=truncated)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


UNISOLATED_WARNING = ("k3: WARNING: --sandbox none: agent commands run UNISOLATED on this machine, as this user, "
                      "with its files and network. Use it only for code you trust.")


def create_sandbox(kind: str = "bwrap", image: str | None = None, *, limits: Limits | None = None,
                   env: dict | None = None) -> Sandbox:
    """A new sandbox whose workspace starts as a copy of the directory `image` (empty when None)."""
    if kind not in SANDBOX_KINDS:
        raise ValueError(f"sandbox kind must be one of {list(SANDBOX_KINDS)}, got {kind!r}")
    if image is not None and not os.path.isdir(image):
        raise SandboxError(f"sandbox image {image!r} is not a directory")
    root = tempfile.mkdtemp(prefix="k3-sandbox-")
    ws = os.path.join(root, "workspace")
    if image is not None:
        _copy_tree(image, ws)
    else:
        os.makedirs(ws)
    if kind == "none":
        print(UNISOLATED_WARNING, file=sys.stderr, flush=True)
        return UnisolatedSandbox(ws, env=env, limits=limits, owns_root=root)
    from k3.env.bwrap import BwrapSandbox
    return BwrapSandbox(ws, env=env, limits=limits, owns_root=root)


def with_limits(limits: Limits, **changes) -> Limits:
    return replace(limits, **changes)
