"""Sandboxes for tool execution (report §5.3.2): the interface every environment codes against.

A sandbox is a workspace directory plus the processes that tool calls start in it. Its state is its filesystem
and its environment variables, nothing else: no process outlives the tool call that started it, so a sandbox at
rest is "paused" (AgentENV's pause costs it no CPU or memory; here it holds only its files), and `fork`,
`snapshot` and `restore` are exact copies of that state.

Inside the sandbox the workspace is at `WORKSPACE` ("/workspace"); paths given to the file methods are relative
to it (or absolute under it). A path that leaves the workspace (`..`, an absolute path elsewhere, a symlink
pointing out) raises `SandboxError`.

A call runs to its end with `exec`, or in the background with `start`, which returns a `RunningCall` (k3.env.call,
with the call's `Limits` and `ExecResult`) that can be paused (SIGSTOP to its whole process tree), resumed, waited
for and killed. The wall-clock limit counts running
time only: time spent paused does not count, so a call paused while the policy thinks keeps its full budget.

Kinds (`create_sandbox(kind=...)`):
- "bwrap": isolated with bubblewrap (k3.env.bwrap): new PID, network, mount, IPC and UTS namespaces, an
  unprivileged uid per sandbox, the system read-only, the workspace the one writable place, rlimits and a
  wall-clock limit per call.
- "none": no isolation at all (`UnisolatedSandbox`): commands run as the calling user on the host. Only for an
  explicit `--sandbox none`; creating one prints a warning on stderr every time.
"""

from __future__ import annotations

import abc
import os
import shutil
import stat
import sys
import tempfile
import weakref
from dataclasses import dataclass, field, replace

from k3.env.call import ExecResult, Launch, Limits, RunningCall, SandboxError

WORKSPACE = "/workspace"
SANDBOX_KINDS = ("bwrap", "none")


@dataclass(frozen=True)
class Snapshot:
    """An immutable saved state of a sandbox: its workspace tree (a directory the sandbox owns) and environment."""
    path: str
    env: dict = field(default_factory=dict)


class Sandbox(abc.ABC):
    """The operations environments use. Subclasses implement `_launch` (how one command starts on the host) and
    set `owner` when the sandbox's commands run as a uid of their own (files the host writes are given to it)."""

    kind: str = ""

    def __init__(self, workspace: str, env: dict | None = None, limits: Limits | None = None, owns_root: str | None = None):
        self.workspace = workspace        # host path of the writable workspace
        self.env = dict(env or {})
        self.limits = limits or Limits()
        self.limits.validate()
        self.owner: tuple[int, int] | None = None   # (uid, gid) of the sandbox's commands when not the caller's
        self._closed = False
        self._snapshots: list[str] = []
        self._calls: weakref.WeakSet[RunningCall] = weakref.WeakSet()
        # the directories go with close(), or with the object or the interpreter when close() was forgotten
        self._remove_dirs = weakref.finalize(self, _remove_dirs, [owns_root] if owns_root else [], self._snapshots)

    # -- commands ---------------------------------------------------------------------------------------------
    def exec(self, command: list[str] | str, *, stdin: str | None = None, timeout: float | None = None,
             cwd: str = WORKSPACE, env: dict | None = None) -> ExecResult:
        """Run `command` (argv list, or a string run by /bin/sh -c) inside the sandbox and wait for it. Never raises
        for what the command does (non-zero exit, timeout, a signal): that is in the result."""
        return self.start(command, stdin=stdin, timeout=timeout, cwd=cwd, env=env).wait()

    def start(self, command: list[str] | str, *, stdin: str | None = None, timeout: float | None = None,
              cwd: str = WORKSPACE, env: dict | None = None) -> RunningCall:
        """Start `command` as `exec` does and return at once; the call can be paused, resumed, waited for and
        killed. Its wall limit (`timeout`, at most `limits.wall_seconds`) counts running time only."""
        self._check_open()
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise SandboxError(f"a command is a non-empty list of strings or a string, got {command!r}")
        if not (cwd == WORKSPACE or cwd.startswith(WORKSPACE + "/")):
            raise SandboxError(f"cwd {cwd!r} is outside the workspace {WORKSPACE}")
        full_env = {**self.env, **(env or {})}
        bad = [k for k, v in full_env.items() if not isinstance(k, str) or not k or "=" in k or not isinstance(v, str)]
        if bad:
            raise SandboxError(f"environment variables are NAME=str pairs without '=' in NAME, got {bad!r}")
        wall = self.limits.wall_seconds if timeout is None else min(float(timeout), self.limits.wall_seconds)
        call = RunningCall(self._launch(argv, cwd=cwd, env=full_env), stdin=stdin, timeout=wall,
                           output_bytes=self.limits.output_bytes)
        self._calls.add(call)
        return call

    @abc.abstractmethod
    def _launch(self, argv: list[str], *, cwd: str, env: dict) -> Launch:
        ...

    # -- files (host-side access to the workspace, for tools and verifiers) ------------------------------------
    def host_path(self, path: str) -> str:
        """The host path of a workspace path, resolved as a command in the sandbox would resolve it (a symlink to
        "/workspace/..." stays in the workspace), refusing anything that leads outside it. (Checked when called: a
        call running in the background at the same time could still swap a directory for a symlink.)"""
        self._check_open()
        if not isinstance(path, str) or "\x00" in path:
            raise SandboxError(f"a path is a string without NUL bytes, got {path!r}")
        if os.path.isabs(path) and not (path == WORKSPACE or path.startswith(WORKSPACE + "/")):
            raise SandboxError(f"path {path!r} is outside the workspace {WORKSPACE}")
        root = os.path.realpath(self.workspace)
        todo = list(reversed(path[len(WORKSPACE):].split("/") if os.path.isabs(path) else path.split("/")))
        parts: list[str] = []
        links = 0
        while todo:
            name = todo.pop()
            if name in ("", "."):
                continue
            if name == "..":
                if not parts:
                    raise SandboxError(f"path {path!r} resolves outside the workspace")
                parts.pop()
                continue
            full = os.path.join(root, *parts, name)
            if not os.path.islink(full):
                parts.append(name)
                continue
            links += 1
            target = os.readlink(full)
            outside = target.startswith("/") and not (target == WORKSPACE or target.startswith(WORKSPACE + "/"))
            if links > 40 or outside:
                raise SandboxError(f"path {path!r} resolves outside the workspace (through {target!r})")
            if target.startswith("/"):
                parts, target = [], target[len(WORKSPACE):]
            todo.extend(reversed(target.split("/")))
        return os.path.join(root, *parts)

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
        created, d = [], os.path.dirname(p)
        while not os.path.exists(d):
            created.append(d)
            d = os.path.dirname(d)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        if self.owner is not None:      # the sandbox's own uid must be able to change what the host wrote
            for q in created + [p]:
                os.chown(q, *self.owner, follow_symlinks=False)

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
        """An independent sandbox with a copy of this one's current files and environment (for judging without
        side effects). Calls running in this sandbox are not part of the state: the fork has none."""
        self._check_open()
        root = temp_root("k3-sandbox-")
        ws = os.path.join(root, "workspace")
        try:
            copy_tree(self.workspace, ws)
            return self._clone(ws, root)
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise

    def snapshot(self) -> Snapshot:
        """Save the current state; `restore(snapshot)` brings it back exactly. Valid until `close()`."""
        self._check_open()
        d = temp_root("k3-snapshot-")
        self._snapshots.append(d)
        copy_tree(self.workspace, os.path.join(d, "workspace"))
        return Snapshot(path=d, env=dict(self.env))

    def restore(self, snapshot: Snapshot) -> None:
        self._check_open()
        src = os.path.join(snapshot.path, "workspace")
        if not os.path.isdir(src):
            raise SandboxError(f"snapshot {snapshot.path} no longer exists")
        tmp = self.workspace + ".restoring"
        shutil.rmtree(tmp, ignore_errors=True)
        copy_tree(src, tmp, owner=self.owner)
        old = self.workspace + ".old"
        os.replace(self.workspace, old)
        os.replace(tmp, self.workspace)
        shutil.rmtree(old, ignore_errors=True)
        self.env = dict(snapshot.env)

    def _clone(self, workspace: str, root: str) -> "Sandbox":
        return type(self)(workspace, env=self.env, limits=self.limits, owns_root=root)

    def close(self) -> None:
        """Kill the calls still running, then remove the workspace (when the sandbox owns it) and snapshots."""
        if self._closed:
            return
        self._closed = True
        for call in list(self._calls):
            call.kill()
        self._remove_dirs()

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("the sandbox is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# --- directories of sandboxes and snapshots ------------------------------------------------------------------------
# A sandbox removes its directories when closed, collected or at exit; a process killed outright (SIGKILL, the OOM
# killer, a lost machine) cannot, and an RL run leaves hundreds (a group of episodes each, and their forks). So each
# directory carries its creator's identity, and the first directory a process makes sweeps those whose creator has
# gone (this user's only; directories without the marker, which older versions made, are left alone).
OWNER_FILE = ".k3-owner"
_PREFIXES = ("k3-sandbox-", "k3-snapshot-")
_swept = False


def _identity(pid: int) -> str | None:
    """'pid start-time' of a live process (start time in clock ticks since boot, /proc on Linux; a reused pid has
    another), 'pid' where /proc cannot tell, None when no such process runs."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return f"{pid} {int(fields[19])}"  # field 22 of stat: starttime
    except FileNotFoundError:
        return None
    except (OSError, IndexError, ValueError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return str(pid)


def temp_root(prefix: str) -> str:
    """A new private directory for a sandbox or snapshot, marked with this process's identity; the first one a
    process makes also sweeps the directories of dead creators (`sweep_stale`)."""
    global _swept
    if not _swept:
        _swept = True
        try:
            sweep_stale()
        except OSError:
            pass  # a sweep that cannot read /tmp must not stop the sandbox
    root = tempfile.mkdtemp(prefix=prefix)
    with open(os.path.join(root, OWNER_FILE), "w") as f:
        f.write(_identity(os.getpid()) or str(os.getpid()))
    return root


def sweep_stale(tmp: str | None = None) -> list[str]:
    """Remove the sandbox and snapshot directories under `tmp` (default: the temp directory) that this user owns
    and whose creating process no longer runs. Returns the removed paths."""
    tmp = tmp or tempfile.gettempdir()
    removed = []
    for name in os.listdir(tmp):
        if not name.startswith(_PREFIXES):
            continue
        path = os.path.join(tmp, name)
        try:
            if os.lstat(path).st_uid != os.getuid() or not os.path.isdir(path) or os.path.islink(path):
                continue
            with open(os.path.join(path, OWNER_FILE)) as f:
                mark = f.read().strip()
        except (OSError, UnicodeDecodeError):
            continue  # no marker: not ours to judge
        try:
            pid = int(mark.split()[0])
        except (ValueError, IndexError):
            continue
        live = _identity(pid)
        if live is None or (" " in mark and " " in live and live != mark):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _remove_dirs(*lists: list[str]) -> None:
    for dirs in lists:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def copy_tree(src: str, dst: str, owner: tuple[int, int] | None = None) -> None:
    """Copy a workspace tree exactly: contents, modes, times, symlinks as symlinks, empty directories, FIFOs
    (sockets and devices are left out: they are not state a command can restore). With `owner`, every entry is
    given to that (uid, gid), keeping setuid/setgid bits that chown would clear."""
    shutil.copytree(src, dst, symlinks=True, copy_function=_copy_entry)
    if owner is not None:
        chown_tree(dst, owner)


# ioctl FICLONE (linux/fs.h): make `dst` share `src`'s blocks, copy-on-write (btrfs, XFS, bcachefs, ...).
_FICLONE = 0x40049409
# How the last regular file was copied: "reflink" (copy-on-write clone) or "copy" (the filesystem, e.g. ext4,
# cannot clone); the sandbox benchmark reports it, so a measured fork says which one it was.
last_copy_mode = "copy"


def _copy_entry(src: str, dst: str) -> None:
    mode = os.lstat(src).st_mode
    if stat.S_ISREG(mode):
        _clone_or_copy(src, dst)
        shutil.copystat(src, dst)
    elif stat.S_ISFIFO(mode):
        os.mkfifo(dst)
        shutil.copystat(src, dst)


def _clone_or_copy(src: str, dst: str) -> None:
    """A copy-on-write clone of a regular file where the filesystem can make one, else a full copy: the same bytes
    either way, so forks and snapshots are exact on every filesystem and cheap where it allows."""
    global last_copy_mode
    import fcntl

    with open(src, "rb") as fs, open(dst, "wb") as fd:
        try:
            fcntl.ioctl(fd.fileno(), _FICLONE, fs.fileno())
            last_copy_mode = "reflink"
            return
        except OSError:          # EOPNOTSUPP, EXDEV, EINVAL: this filesystem (or pair of them) cannot clone
            pass
        shutil.copyfileobj(fs, fd, 1 << 20)
        last_copy_mode = "copy"


def chown_tree(root: str, owner: tuple[int, int]) -> None:
    """Give `root` and everything under it (symlinks themselves, never their targets) to `owner`."""
    os.chown(root, *owner, follow_symlinks=False)
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            st = os.lstat(p)
            os.chown(p, *owner, follow_symlinks=False)
            if st.st_mode & (stat.S_ISUID | stat.S_ISGID) and not stat.S_ISLNK(st.st_mode):
                os.chmod(p, stat.S_IMODE(st.st_mode))


class UnisolatedSandbox(Sandbox):
    """Runs commands directly on the host, in the workspace directory, as the calling user. No isolation: only
    rlimits (not the process count) and the wall-clock limit apply. The path `/workspace` in commands is NOT
    remapped."""

    kind = "none"

    def _launch(self, argv, *, cwd, env):
        full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": self.workspace, "LANG": "C.UTF-8",
                    **env}
        return Launch(self.limits.prlimit_argv(None) + argv, env=full_env, cwd=self.host_path(cwd))


UNISOLATED_WARNING = ("k3: WARNING: --sandbox none: agent commands run UNISOLATED on this machine, as this user, "
                      "with its files and network. Use it only for code you trust.")
_warned_unisolated = False


def create_sandbox(kind: str = "bwrap", image: str | None = None, *, limits: Limits | None = None,
                   env: dict | None = None) -> Sandbox:
    """A new sandbox whose workspace starts as a copy of the directory `image` (empty when None)."""
    if kind not in SANDBOX_KINDS:
        raise ValueError(f"sandbox kind must be one of {list(SANDBOX_KINDS)}, got {kind!r}")
    if image is not None and not os.path.isdir(image):
        raise SandboxError(f"sandbox image {image!r} is not a directory")
    root = temp_root("k3-sandbox-")
    ws = os.path.join(root, "workspace")
    try:
        if image is not None:
            copy_tree(image, ws)
        else:
            os.makedirs(ws)
        if kind == "none":
            global _warned_unisolated
            if not _warned_unisolated:  # once per process: a batch of episodes makes hundreds of sandboxes
                print(UNISOLATED_WARNING, file=sys.stderr, flush=True)
                _warned_unisolated = True
            return UnisolatedSandbox(ws, env=env, limits=limits, owns_root=root)
        from k3.env.bwrap import BwrapSandbox
        return BwrapSandbox(ws, env=env, limits=limits, owns_root=root)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise


def with_limits(limits: Limits, **changes) -> Limits:
    return replace(limits, **changes)
