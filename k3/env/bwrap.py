"""The bubblewrap sandbox (report §5.3.2): every tool call is one `bwrap` invocation.

What a command sees: the system (/usr and the /bin, /lib* links, a few files of /etc) and the Python prefix(es) of
this interpreter read-only at their own paths, a fresh /proc of its own PID namespace, a minimal /dev, a private
tmpfs /tmp, and the workspace read-write at /workspace, the one writable place besides /tmp. Nothing else of the
host exists for it (no /root, /home, /work, host /tmp, other sandboxes). It has its own network namespace (a
private loopback, up but reaching nothing of the host), IPC and UTS namespaces, a new session (no terminal to
inject keystrokes into), a clean environment, and rlimits on CPU time, address space, file size and processes.

Uids. As root, each sandbox gets its own unprivileged host uid (SANDBOX_UID_BASE + n, the lowest n not locked by
another live sandbox on this host; a flock on a file in the temp dir holds it), bwrap sets up the namespaces as
root, and `setpriv` drops the command to that uid with no capabilities and no_new_privs. The workspace is owned by
that uid. So RLIMIT_NPROC, which counts the processes of a real uid and never limits root, bounds each sandbox on
its own, and a sandbox cannot signal or read another sandbox or the host. Not as root, bwrap makes an
unprivileged user namespace and commands run as the caller's uid; RLIMIT_NPROC then counts all of that user's
processes, so it is set to what the user runs now plus `limits.processes` (the best available without root).

The wall limit kills bwrap, whose PID namespace's init dies with it (--die-with-parent), which kills every process
of the call: nothing outlives a call, background processes included. bwrap passes a command's death by signal n
on as exit status 128 + n; results read it back as that signal (so a command that itself exits 129-192 reads the
same, the shell's convention).
"""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import weakref

from k3.env.sandbox import WORKSPACE, Launch, Limits, Sandbox, SandboxError, chown_tree

SANDBOX_UID_BASE = 3_000_000_000     # far above login users and the usual subuid ranges (100000-165535 per user)
SANDBOX_UID_COUNT = 1_000_000
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "nsswitch.conf", "hosts",
        "ssl", "ca-certificates", "mime.types", "protocols", "services")
_SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_HELD: set[int] = set()              # uids this process's open sandboxes hold
_HELD_LOCK = threading.Lock()
_FIX = "apt-get install bubblewrap (and util-linux), or pass --sandbox none to run commands unisolated explicitly"


class BwrapSandbox(Sandbox):
    """A sandbox whose calls run in bubblewrap; see the module docstring for what a command can see and do."""

    kind = "bwrap"

    def __init__(self, workspace: str, env: dict | None = None, limits: Limits | None = None,
                 owns_root: str | None = None):
        super().__init__(workspace, env=env, limits=limits, owns_root=owns_root)
        self._bwrap, self._setpriv = _tools()
        self._release_uid = None
        if os.geteuid() == 0:
            lock, uid = _allocate_uid()
            self._release_uid = weakref.finalize(self, _release_uid, lock, uid)
            self.owner = (uid, uid)
            try:
                chown_tree(workspace, self.owner)
            except OSError:
                self.close()
                raise

    def _launch(self, argv: list[str], *, cwd: str, env: dict) -> Launch:
        return bwrap_launch(self._bwrap, self._setpriv, self.workspace, argv, cwd=cwd, env=env, limits=self.limits,
                            owner=self.owner)

    def close(self) -> None:
        super().close()
        if self._release_uid is not None:  # the uid is free once its workspace and processes are gone
            self._release_uid()


def bwrap_launch(bwrap: str, setpriv: str | None, workspace: str, argv: list[str], *, cwd: str, env: dict,
                 limits: Limits, owner: tuple[int, int] | None) -> Launch:
    """The host command line of one call: prlimit, bwrap with its namespaces and mounts, then (with `owner`)
    setpriv dropping to the sandbox's uid."""
    uid, gid = owner if owner is not None else (os.getuid(), os.getgid())
    fds = []

    def data(text: str) -> str:       # a file's contents, given to bwrap through a pipe
        r, w = os.pipe()
        os.write(w, text.encode())
        os.close(w)
        fds.append(r)
        return str(r)

    if owner is not None:             # as root: no user namespace; setpriv drops to the sandbox's own uid
        ns = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        nproc = limits.processes
    else:
        ns = ["--unshare-all"]
        nproc = _processes_of(uid) + limits.processes
    args = [bwrap, *ns, "--die-with-parent", "--new-session", "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for d in _SYSTEM_LINKS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    args += ["--perms", "0755", "--dir", "/etc"]
    for name in _ETC:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    passwd = f"root:x:0:0::/root:/bin/sh\nsandbox:x:{uid}:{gid}::{WORKSPACE}:/bin/sh\n"
    args += ["--perms", "0644", "--ro-bind-data", data(passwd), "/etc/passwd",
             "--perms", "0644", "--ro-bind-data", data(f"root:x:0:\nsandbox:x:{gid}:\n"), "/etc/group",
             "--proc", "/proc", "--dev", "/dev"]
    for tmp in ("/tmp", "/dev/shm"):   # private and bounded: tmpfs pages are memory
        args += ["--perms", "1777", "--size", str(int(limits.file_size_bytes)), "--tmpfs", tmp]
    made = {"/", "/tmp", "/etc", "/usr"}
    for prefix in _python_prefixes():
        parents = []
        d = os.path.dirname(prefix)
        while d not in made and d != "/":
            parents.append(d)
            d = os.path.dirname(d)
        for d in reversed(parents):
            args += ["--perms", "0755", "--dir", d]
            made.add(d)
        args += ["--ro-bind", prefix, prefix]
        made.add(prefix)
    args += ["--bind", workspace, WORKSPACE,
             "--remount-ro", "/dev", "--remount-ro", "/",     # the skeleton bwrap built (/, /etc, /dev) is read-only
             "--chdir", cwd, "--"]
    if owner is not None:
        args += [setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all",
                 "--bounding-set=-all", "--no-new-privs", "--"]
    path = ":".join(dict.fromkeys(os.path.join(p, "bin") for p in _python_prefixes())) + ":/usr/local/bin:/usr/bin:/bin"
    full_env = {"PATH": path, "HOME": WORKSPACE, "LANG": "C.UTF-8", "TMPDIR": "/tmp", **env}
    return Launch(limits.prlimit_argv(nproc) + args + argv, env=full_env, cwd="/", pass_fds=tuple(fds),
                  exit_signals=True)


@functools.cache
def _python_prefixes() -> tuple[str, ...]:
    """This interpreter's prefix and its base (a venv's interpreter links into the base), unless /usr has them."""
    out = []
    for p in (sys.prefix, sys.base_prefix):
        p = os.path.realpath(p)
        if p not in out and not (p == "/usr" or p.startswith("/usr/")):
            out.append(p)
    return tuple(out)


@functools.cache
def _tools() -> tuple[str, str | None]:
    """The bwrap (and, as root, setpriv) executables, after checking once per process that a sandbox starts."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxError(f"bubblewrap (bwrap) is not installed: {_FIX}")
    setpriv = shutil.which("setpriv") if os.geteuid() == 0 else None
    if os.geteuid() == 0 and setpriv is None:
        raise SandboxError(f"util-linux's setpriv is not on PATH (needed to drop root in the sandbox): {_FIX}")
    with tempfile.TemporaryDirectory(prefix="k3-bwrap-check-") as ws:
        owner = (SANDBOX_UID_BASE - 1, SANDBOX_UID_BASE - 1) if os.geteuid() == 0 else None
        if owner:
            os.chown(ws, *owner)
        launch = bwrap_launch(bwrap, setpriv, ws, ["true"], cwd=WORKSPACE, env={}, limits=Limits(), owner=owner)
        try:
            p = subprocess.run(launch.argv, env=launch.env, pass_fds=launch.pass_fds, capture_output=True, timeout=30)
        finally:
            for fd in launch.pass_fds:
                os.close(fd)
    if p.returncode != 0:
        raise SandboxError(f"bubblewrap cannot start a sandbox here (exit {p.returncode}: "
                           f"{p.stderr.decode(errors='replace').strip()}); it needs unprivileged user namespaces "
                           f"(sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0) or root. "
                           f"Otherwise: {_FIX}")
    return bwrap, setpriv


def _allocate_uid() -> tuple[int, int]:
    """(lock fd, uid): the lowest sandbox uid no live sandbox on this host holds. The flock dies with its holder,
    so a crashed process frees its uids."""
    d = os.path.join(tempfile.gettempdir(), "k3-sandbox-uids")
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise SandboxError(f"{d} must be a directory of uid {os.geteuid()} with mode 0700 (another user could "
                           f"forge its uid locks), got uid {st.st_uid} mode {oct(st.st_mode & 0o7777)}")
    with _HELD_LOCK:
        for n in range(SANDBOX_UID_COUNT):
            uid = SANDBOX_UID_BASE + n
            if uid in _HELD:          # this process holds it: no need to ask the kernel
                continue
            fd = os.open(os.path.join(d, str(uid)), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            _HELD.add(uid)
            return fd, uid
    raise SandboxError(f"all {SANDBOX_UID_COUNT} sandbox uids from {SANDBOX_UID_BASE} are in use")


def _release_uid(fd: int, uid: int) -> None:
    with _HELD_LOCK:
        _HELD.discard(uid)
        os.close(fd)


def _processes_of(uid: int) -> int:
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                n += os.stat(f"/proc/{name}").st_uid == uid
            except OSError:
                pass
    return n
