"""One tool call in a sandbox: its limits, the process tree it starts, and its result.

`Sandbox.start` builds a `Launch` (how the call starts on the host: bubblewrap's argv for an isolated sandbox, the
command itself for an unisolated one) and hands it to a `RunningCall`, which pumps the call's input and output,
enforces the wall-clock limit over running time, and pauses, resumes or kills the call's whole process tree. When
the call ends nothing of it is left running, which is what makes a sandbox's state only its files (k3.env.sandbox).
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

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
