"""Sandboxes for tool execution (report §5.3.2): the interface every environment codes against.

A sandbox is a workspace directory plus the processes that tool calls start in it. Its state is its filesystem
and its environment variables, nothing else: no process outlives the tool call that started it, so a sandbox at
rest is "paused" (AgentENV's pause costs it no CPU or memory; here it holds only its files), and `fork`,
`snapshot` and `restore` are exact copies of that state.

Inside the sandbox the workspace is at `WORKSPACE` ("/workspace"); paths given to the file methods are relative
to it (or absolute under it). A path that leaves the workspace (`..`, an absolute path elsewhere, a symlink
pointing out) raises `SandboxError`.

A call runs to its end with `exec`, or in the background with `start`, which returns a `RunningCall` that can be
paused (SIGSTOP to its whole process tree), resumed, waited for and killed. The wall-clock limit counts running
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
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field, replace

WORKSPACE = "/workspace"
SANDBOX_KINDS = ("bwrap", "none")
_DRAIN_S = 2.0     # after the process tree is gone, how long to wait for the last output before closing the pipes


class SandboxError(Exception):
    """A sandbox operation was refused or failed (bad path, closed sandbox, missing bubblewrap, ...)."""


@dataclass(frozen=True)
class Limits:
    """Per-call resource limits. `wall_seconds` (running time, pauses excluded) is enforced by killing the call's
    whole process tree; the others are rlimits of every process of the call."""
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

    def prlimit_argv(self, processes: int | None) -> list[str]:
        """`prlimit` options that set these rlimits on the process it then executes (no limit on processes when
        `processes` is None). A wrapper process rather than `preexec_fn`, which is unsafe with threads."""
        prlimit = shutil.which("prlimit")
        if prlimit is None:
            raise SandboxError("util-linux's `prlimit` is not on PATH: apt-get install util-linux")
        argv = [prlimit, f"--cpu={int(self.cpu_seconds)}", f"--as={int(self.memory_bytes)}",
                f"--fsize={int(self.file_size_bytes)}", "--core=0"]
        return argv + ([f"--nproc={processes}"] if processes is not None else []) + ["--"]


@dataclass
class ExecResult:
    """What one tool call's command did. `exit_code` is None when it was killed (timed out or by a signal).
    `wall_s` is its running time; `paused_s` the time it spent paused (not counted against the wall limit)."""
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    timed_out: bool = False
    signal: str | None = None            # e.g. "SIGKILL" when a signal ended it
    truncated: bool = False              # stdout or stderr was cut to Limits.output_bytes
    paused_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class Snapshot:
    """An immutable saved state of a sandbox: its workspace tree (a directory the sandbox owns) and environment."""
    path: str
    env: dict = field(default_factory=dict)


@dataclass
class Launch:
    """How to start one call on the host: the full argv, its environment and directory, and file descriptors the
    child inherits (closed in the parent once it has started)."""
    argv: list[str]
    env: dict
    cwd: str | None = None
    pass_fds: tuple = ()
    exit_signals: bool = False     # the launcher reports its command's death by signal n as exit 128 + n (bwrap)


class RunningCall:
    """One command started in a sandbox (`Sandbox.start`). A thread pumps its stdin and output and enforces the
    wall-clock limit over running time: `pause()` stops the clock and the process tree, `resume()` restarts both.

    `wait(timeout)` returns the ExecResult, or None if the call has not ended within `timeout` seconds (the call
    goes on); `kill()` ends it and returns its result."""

    def __init__(self, launch: Launch, *, stdin: str | None, timeout: float, output_bytes: int):
        self._timeout, self._cap, self._exit_signals = timeout, output_bytes, launch.exit_signals
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._paused_at: float | None = None
        self._paused_total = 0.0
        self._kill_requested = False
        self._result: ExecResult | None = None
        self._done = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        try:
            self._p = subprocess.Popen(launch.argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=launch.cwd, env=launch.env,
                                       pass_fds=launch.pass_fds, start_new_session=True)
        except OSError as e:
            self._finish(ExecResult(exit_code=127, stdout="", stderr=f"cannot start {launch.argv[0]!r}: {e}",
                                    wall_s=0.0))
            return
        finally:
            for fd in launch.pass_fds:
                os.close(fd)
        threading.Thread(target=self._run, args=(stdin.encode() if stdin is not None else b"",),
                         name="k3-sandbox-call", daemon=True).start()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def paused(self) -> bool:
        return self._paused_at is not None

    def pause(self) -> None:
        """Stop every process of the call (SIGSTOP) and its wall clock. Pausing a paused or ended call does nothing."""
        with self._lock:
            if self.done or self._paused_at is not None:
                return
            self._paused_at = time.monotonic()
            _signal_tree(self._p.pid, signal.SIGSTOP)
            self._wake()

    def resume(self) -> None:
        """Continue every process of a paused call (SIGCONT) and its wall clock."""
        with self._lock:
            if self.done or self._paused_at is None:
                return
            _signal_tree(self._p.pid, signal.SIGCONT)
            self._paused_total += time.monotonic() - self._paused_at
            self._paused_at = None
            self._wake()

    def wait(self, timeout: float | None = None) -> ExecResult | None:
        if timeout is None and self.paused:
            raise SandboxError("the call is paused: resume() or kill() it first, or wait with a timeout")
        return self._result if self._done.wait(timeout) else None

    def kill(self) -> ExecResult:
        with self._lock:
            self._kill_requested = True
            self._wake()
        self._done.wait()
        return self._result

    # -- the pump thread --------------------------------------------------------------------------------------
    def _wake(self) -> None:
        """Make the pump look at the clock and requests again. Called with the lock held, which `_finish` takes
        to close the pipe, so a closed (and maybe reused) descriptor is never written."""
        if self._wake_w is not None:
            os.write(self._wake_w, b"x")

    def _remaining(self) -> float | None:
        """Running time left before the wall limit; None while paused (the clock is stopped)."""
        with self._lock:
            if self._paused_at is not None:
                return None
            return self._timeout - (time.monotonic() - self._t0 - self._paused_total)

    def _run(self, stdin: bytes) -> None:
        try:
            result = self._pump(stdin)
        except BaseException as e:          # never leave a waiter hanging or a process tree running
            _signal_tree(self._p.pid, signal.SIGKILL)
            self._p.wait()
            result = ExecResult(exit_code=None, stdout="", stderr=f"sandbox error: {e!r}", signal="SIGKILL",
                                wall_s=time.monotonic() - self._t0 - self._paused_total)
        self._finish(result)

    def _pump(self, stdin: bytes) -> ExecResult:
        p, sel = self._p, selectors.DefaultSelector()
        bufs = {p.stdout.fileno(): bytearray(), p.stderr.fileno(): bytearray()}    # stdout, stderr
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        pidfd = os.pidfd_open(p.pid)         # readable when the process ends: no polling
        sel.register(pidfd, selectors.EVENT_READ)
        stdin_fd = p.stdin.fileno() if p.stdin is not None else None
        if stdin_fd is not None:
            sel.register(stdin_fd, selectors.EVENT_WRITE)
        sent, open_outputs, drain_until, timed_out, killed = 0, len(bufs), None, False, False
        while drain_until is None or (open_outputs and time.monotonic() < drain_until):
            wait = None if drain_until is None else drain_until - time.monotonic()
            if drain_until is None and not killed:
                wait = self._remaining()
                if (wait is not None and wait <= 0) or self._kill_requested:
                    timed_out, killed = not self._kill_requested, True
                    with self._lock:
                        _signal_tree(p.pid, signal.SIGKILL)
                    wait = _DRAIN_S
            for key, _ in sel.select(wait):
                if key.fd == self._wake_r:
                    os.read(key.fd, 512)
                elif key.fd == pidfd:        # the process ended: kill what it left in its group, drain the pipes
                    sel.unregister(pidfd)
                    _kill_group(p.pid)
                    drain_until = time.monotonic() + _DRAIN_S
                elif key.fd == stdin_fd:
                    try:
                        sent += os.write(stdin_fd, stdin[sent:sent + 65536])
                    except BrokenPipeError:
                        sent = len(stdin)
                    if sent >= len(stdin):
                        sel.unregister(stdin_fd)
                        p.stdin.close()
                elif data := os.read(key.fd, 65536):
                    buf = bufs[key.fd]
                    buf += data[:max(0, self._cap + 1 - len(buf))]
                else:
                    sel.unregister(key.fd)
                    open_outputs -= 1
        sel.close()
        os.close(pidfd)
        p.wait()
        for f in (p.stdout, p.stderr, p.stdin):
            if f is not None and not f.closed:
                f.close()
        with self._lock:
            paused_s = self._paused_total + (time.monotonic() - self._paused_at if self._paused_at else 0.0)
            self._paused_at = None
        out, err = (bytes(b) for b in bufs.values())
        rc, signum = p.returncode, None
        if rc < 0:
            signum = -rc
        elif self._exit_signals and 128 < rc <= 128 + 64:
            signum = rc - 128
        sig = None
        if signum is not None:
            try:
                sig = signal.Signals(signum).name
            except ValueError:
                sig = f"signal {signum}"
        return ExecResult(exit_code=None if (timed_out or sig) else rc,
                          stdout=out[:self._cap].decode("utf-8", "replace"),
                          stderr=err[:self._cap].decode("utf-8", "replace"), timed_out=timed_out, signal=sig,
                          truncated=len(out) > self._cap or len(err) > self._cap, paused_s=paused_s,
                          wall_s=time.monotonic() - self._t0 - paused_s)

    def _finish(self, result: ExecResult) -> None:
        with self._lock:
            self._result = result
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_w = None
        self._done.set()


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(name))
    return kids


def _process_tree(root: int) -> list[int]:
    kids, out, todo = _children_map(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, ()))
    return out


def _signal_tree(root: int, sig: int) -> None:
    """Send `sig` to `root` (alive: its descendants are found through it) and all its descendants, and SIGKILL
    to its process group too. For SIGSTOP, repeat until every process of the tree is stopped, so that one forking
    while it was being stopped leaves no running child behind."""
    seen: set[int] = set()
    for _ in range(200):
        pids = _process_tree(root)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if sig != signal.SIGSTOP or (set(pids) <= seen and all(_stopped(p) for p in pids)):
            break
        seen |= set(pids)
        time.sleep(0.001)
    if sig == signal.SIGKILL:
        _kill_group(root)


def _kill_group(pgid: int) -> None:
    """SIGKILL a call's process group: once its first process has ended, its children are no longer its
    descendants, but those that stayed in its group are still found this way (bwrap's are already gone with its
    PID namespace)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _stopped(pid: int) -> bool:
    """Whether a process can no longer fork: stopped, dead, gone, or with SIGSTOP pending (one in the middle of an
    exec is in uninterruptible sleep and stops as soon as it leaves it)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return True
    pending = int(fields.get("SigPnd", "0"), 16) | int(fields.get("ShdPnd", "0"), 16)
    return fields.get("State", "").split()[0] in ("T", "t", "Z", "X") or bool(pending & (1 << (signal.SIGSTOP - 1)))


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
        root = tempfile.mkdtemp(prefix="k3-sandbox-")
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
        d = tempfile.mkdtemp(prefix="k3-snapshot-")
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


def create_sandbox(kind: str = "bwrap", image: str | None = None, *, limits: Limits | None = None,
                   env: dict | None = None) -> Sandbox:
    """A new sandbox whose workspace starts as a copy of the directory `image` (empty when None)."""
    if kind not in SANDBOX_KINDS:
        raise ValueError(f"sandbox kind must be one of {list(SANDBOX_KINDS)}, got {kind!r}")
    if image is not None and not os.path.isdir(image):
        raise SandboxError(f"sandbox image {image!r} is not a directory")
    root = tempfile.mkdtemp(prefix="k3-sandbox-")
    ws = os.path.join(root, "workspace")
    try:
        if image is not None:
            copy_tree(image, ws)
        else:
            os.makedirs(ws)
        if kind == "none":
            print(UNISOLATED_WARNING, file=sys.stderr, flush=True)
            return UnisolatedSandbox(ws, env=env, limits=limits, owns_root=root)
        from k3.env.bwrap import BwrapSandbox
        return BwrapSandbox(ws, env=env, limits=limits, owns_root=root)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise


def with_limits(limits: Limits, **changes) -> Limits:
    return replace(limits, **changes)
