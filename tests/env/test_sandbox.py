"""The sandboxes (k3.env.sandbox, k3.env.bwrap): real escape attempts against bubblewrap, each of which must fail
and be reported in the ExecResult while this process keeps working; exact fork/snapshot/restore; pause/resume.

The bwrap tests are skipped, with the reason, only where bubblewrap cannot start a sandbox at all."""

import os
import shutil
import socket
import stat
import sys
import tempfile
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from k3.env.sandbox import Limits, SandboxError, UNISOLATED_WARNING, create_sandbox


def _bwrap_problem() -> str | None:
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    try:
        create_sandbox("bwrap").close()
    except SandboxError as e:
        return f"bubblewrap cannot start a sandbox here: {e}"
    return None


_PROBLEM = _bwrap_problem()
needs_bwrap = pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")
SMALL = Limits(cpu_seconds=10, memory_bytes=512 << 20, processes=32, wall_seconds=10.0)


@pytest.fixture
def sb():
    with create_sandbox("bwrap", limits=SMALL) as s:
        yield s


@pytest.fixture
def other():
    with create_sandbox("bwrap", limits=SMALL) as s:
        s.write_file("secret.txt", "other sandbox's secret\n")
        yield s


def still_works(sandbox):
    """After an attack, this process and the sandbox both still run commands normally."""
    r = sandbox.exec("echo alive")
    assert r.ok and r.stdout == "alive\n", r


def tree(root: str) -> dict:
    """A whole file tree as data: relative path -> (kind, mode, contents or link target)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            st_ = os.lstat(p)
            rel = os.path.relpath(p, root)
            if stat.S_ISLNK(st_.st_mode):
                out[rel] = ("link", None, os.readlink(p))
            elif stat.S_ISDIR(st_.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st_.st_mode), None)
            elif stat.S_ISFIFO(st_.st_mode):
                out[rel] = ("fifo", stat.S_IMODE(st_.st_mode), None)
            else:
                with open(p, "rb") as f:
                    out[rel] = ("file", stat.S_IMODE(st_.st_mode), f.read())
    return out


# -- escapes: filesystem ------------------------------------------------------------------------------------------
@needs_bwrap
@pytest.mark.parametrize("target", ["/etc/k3_owned", "/usr/k3_owned", "/k3_owned", "/usr/bin/python3"])
def test_writes_outside_the_workspace_fail(sb, target):
    existed = os.path.exists(target)
    r = sb.exec(f"echo owned > {target}")
    assert r.exit_code != 0 and ("Read-only" in r.stderr or "Permission denied" in r.stderr), r
    assert os.path.exists(target) == existed
    still_works(sb)


@needs_bwrap
def test_the_workspace_and_private_tmpfs_are_the_only_writable_places(sb):
    places = ["/", "/etc", "/dev", "/root", "/usr/lib", "/proc", sys.base_prefix, "/tmp", "/dev/shm", "/workspace"]
    r = sb.exec("for d in " + " ".join(places) + "; do touch $d/k3_w 2>/dev/null && echo $d; done")
    assert r.stdout.split() == ["/tmp", "/dev/shm", "/workspace"], r


@needs_bwrap
def test_the_host_tmp_and_another_workspace_are_not_reachable(sb, other):
    name = f"k3_escape_{os.getpid()}"
    host_tmp = os.path.join(tempfile.gettempdir(), name)
    r = sb.exec(f"echo owned > {host_tmp} && cat {host_tmp}")      # lands in the sandbox's private /tmp
    assert r.ok and not os.path.exists(host_tmp)
    r = sb.exec(f"echo owned > {other.workspace}/stolen; cat {other.workspace}/secret.txt")
    assert r.exit_code != 0 and "No such file" in r.stderr and "secret" not in r.stdout, r
    assert other.list_files() == ["secret.txt"]
    r = sb.exec(f"ls {os.path.dirname(other.workspace)}")
    assert r.exit_code != 0, r
    still_works(sb)


@needs_bwrap
def test_host_files_outside_the_workspace_are_unreadable(sb):
    home = os.path.expanduser("~")
    secret_dir = tempfile.mkdtemp(prefix="k3-secret-", dir=home)
    kept = tempfile.NamedTemporaryFile("w", suffix=".hidden", delete=False)    # a hidden test kept on the host
    try:
        with open(os.path.join(secret_dir, "key"), "w") as f:
            f.write("TOPSECRET")
        kept.write("HIDDEN_TEST")
        kept.close()
        for path in (os.path.join(secret_dir, "key"), kept.name, "/etc/shadow", f"{home}/.bash_history"):
            r = sb.exec(["cat", path])
            assert r.exit_code != 0 and r.stdout == "", (path, r)
        prune = " ".join(f"-path {p} -prune -o" for p in ["/proc", "/dev", "/usr", sys.base_prefix, sys.prefix])
        r = sb.exec(f"ls -a {home}; find / {prune} -type f -print | xargs grep -l -e TOPSECRET -e HIDDEN_TEST",
                    timeout=30)
        assert "k3-secret" not in r.stdout and kept.name not in r.stdout and "grep" not in r.stderr, r
        for host_dir in ("/work", "/home", "/root/.ssh"):
            assert sb.exec(["ls", host_dir]).exit_code != 0
    finally:
        shutil.rmtree(secret_dir)
        os.unlink(kept.name)
    still_works(sb)


# -- escapes: network ---------------------------------------------------------------------------------------------
@needs_bwrap
def test_no_network_reaches_the_host(sb):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        code = (f"import socket\ns = socket.socket()\ns.settimeout(2)\n"
                f"try:\n    s.connect(('127.0.0.1', {port}))\n    print('CONNECTED')\n"
                f"except OSError as e:\n    print('refused', e)\n")
        r = sb.exec(["python3", "-c", code])
        assert "refused" in r.stdout and "CONNECTED" not in r.stdout, r
        server.settimeout(0.2)
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    r = sb.exec("cat /proc/net/dev")
    interfaces = [line.split(":")[0].strip() for line in r.stdout.splitlines()[2:]]
    assert interfaces == ["lo"], r.stdout
    r = sb.exec(["python3", "-c", "import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)"])
    assert r.exit_code != 0 and "unreachable" in r.stderr.lower(), r
    still_works(sb)


# -- escapes: resources -------------------------------------------------------------------------------------------
@needs_bwrap
def test_fork_bomb_is_bounded_and_ends(sb, other):
    t0 = time.monotonic()
    r = sb.exec("bomb() { bomb | bomb & }; bomb; sleep 2; echo survived", timeout=5)
    assert time.monotonic() - t0 < 15
    assert "Cannot fork" in r.stderr or r.timed_out, r
    still_works(other)
    still_works(sb)


@needs_bwrap
def test_memory_bomb_fails(sb):
    r = sb.exec(["python3", "-c", "x = bytearray(2 << 30); print('allocated')"])
    assert r.exit_code != 0 and "MemoryError" in r.stderr and "allocated" not in r.stdout, r
    r = sb.exec(["python3", "-c", "x = []\nwhile True: x.append(bytearray(16 << 20))"])
    assert r.exit_code != 0 and "MemoryError" in r.stderr, r
    still_works(sb)


@needs_bwrap
@pytest.mark.parametrize("command", ["sleep 1000", "python3 -c 'while True: pass'"])
def test_a_call_that_never_returns_is_killed_at_the_wall_limit(sb, command):
    t0 = time.monotonic()
    r = sb.exec(command, timeout=1.0)
    assert r.timed_out and r.exit_code is None and r.signal == "SIGKILL" and not r.ok, r
    assert 1.0 <= r.wall_s < 3.0 and time.monotonic() - t0 < 4.0
    still_works(sb)


@needs_bwrap
def test_cpu_limit_and_signals_are_reported():
    with create_sandbox("bwrap", limits=Limits(cpu_seconds=1, wall_seconds=10)) as s:
        r = s.exec(["python3", "-c", "while True: pass"])
        assert r.signal in ("SIGKILL", "SIGXCPU") and r.exit_code is None and not r.timed_out and r.wall_s < 5, r
        r = s.exec("kill -SEGV $$")
        assert r.signal == "SIGSEGV" and r.exit_code is None, r
        assert s.exec("exit 3").exit_code == 3
        r = s.exec("head -c 100000000 /dev/zero > big")
        assert r.exit_code != 0 and os.path.getsize(s.host_path("big")) == Limits().file_size_bytes, r


def _host_processes_with(arg: str) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if arg.encode() in f.read().split(b"\0"):
                        out.append(int(name))
            except OSError:
                pass
    return out


@needs_bwrap
def test_background_processes_do_not_outlive_the_call(sb):
    marker = f"1000.{os.getpid()}"
    r = sb.exec(f"sleep {marker} & (sleep {marker} &) ; setsid sleep {marker} & echo started")
    assert r.ok and r.stdout == "started\n", r
    time.sleep(0.2)
    assert _host_processes_with(marker) == []
    still_works(sb)


@needs_bwrap
def test_signals_reach_nothing_outside(sb, other):
    victim = other.start("sleep 1000")
    time.sleep(0.3)
    victim_pids = [p for p in _host_processes_with("1000") if p != os.getpid()]
    assert victim_pids, "the other sandbox's call should be running"
    for pid in [os.getpid(), os.getppid(), 1] + victim_pids:
        r = sb.exec(f"kill -9 {pid}")
        assert r.exit_code != 0 or pid == 1, (pid, r)     # pid 1 inside is the sandbox's own init, protected
    r = sb.exec("kill -9 -1; echo after")                 # everything this sandbox's uid may signal
    assert not victim.done
    assert victim.kill().signal == "SIGKILL"
    still_works(sb)
    still_works(other)


# -- the interface ------------------------------------------------------------------------------------------------
@needs_bwrap
def test_commands_see_the_workspace_python_and_a_clean_environment(sb):
    sb.write_file("data/in.txt", "hello\n")
    sb.env["K3_VAR"] = "yes"
    r = sb.exec("pwd; cat data/in.txt; echo made > data/out.txt; python3 -c 'import sys; print(sys.version_info[0])'"
                "; echo $HOME $K3_VAR; env | cut -d= -f1 | sort | tr '\\n' ' '")
    assert r.ok, r
    lines = r.stdout.splitlines()
    assert lines[:5] == ["/workspace", "hello", "3", "/workspace yes"] + lines[4:5]
    assert set(lines[4].split()) <= {"HOME", "K3_VAR", "LANG", "PATH", "PWD", "TMPDIR", "SHLVL", "_"}, lines[4]
    assert sb.read_file("data/out.txt") == b"made\n"
    r = sb.exec("printf '%s' \"$(cat)\"", stdin="from stdin")
    assert r.stdout == "from stdin"
    r = sb.exec("head -c 200000 /dev/zero | tr '\\0' x")
    assert r.truncated and len(r.stdout) == SMALL.output_bytes


def test_missing_bwrap_names_the_fix(monkeypatch):
    from k3.env import bwrap
    monkeypatch.setattr(bwrap, "_tools", bwrap._tools.__wrapped__)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxError, match="apt-get install bubblewrap.*--sandbox none"):
        create_sandbox("bwrap")


def test_unisolated_sandbox_warns_loudly_once(capsys, monkeypatch):
    import k3.env.sandbox as sb

    monkeypatch.setattr(sb, "_warned_unisolated", False)
    with create_sandbox("none") as s:
        assert s.exec("echo hi").stdout == "hi\n"
    assert UNISOLATED_WARNING in capsys.readouterr().err
    with create_sandbox("none"):  # a batch of episodes makes many: the warning is printed once per process
        pass
    assert UNISOLATED_WARNING not in capsys.readouterr().err


# -- life cycle ---------------------------------------------------------------------------------------------------
def _populate(sandbox):
    """A tree with every kind of entry a command can leave: files of several modes, nested and empty directories,
    symlinks (relative, absolute, dangling, to a directory), made from inside the sandbox."""
    r = sandbox.exec("mkdir -p a/b/c empty/deeper && echo one > a/one.txt && printf 'x\\0y' > a/b/bin"
                     " && echo run > a/run.sh && chmod 755 a/run.sh && chmod 600 a/one.txt && chmod 700 a/b"
                     " && ln -s one.txt a/link && ln -s /workspace/a/b a/dirlink && ln -s missing dangling"
                     " && mkfifo pipe && chmod 640 pipe")
    assert r.ok, r


@needs_bwrap
def test_fork_is_an_exact_independent_copy(sb):
    _populate(sb)
    sb.env["STAGE"] = "parent"
    child = sb.fork()
    try:
        assert tree(child.workspace) == tree(sb.workspace)
        assert child.env == {"STAGE": "parent"} and child.owner != sb.owner
        assert child.exec("cat a/link; echo changed > a/one.txt; rm -r empty; touch new").ok
        assert sb.exec("echo parent-only > a/b/c/p").ok
        assert sb.read_file("a/one.txt") == b"one\n" and child.read_file("a/one.txt") == b"changed\n"
        assert "new" not in sb.list_files() and "a/b/c/p" not in child.list_files()
        assert os.path.isdir(os.path.join(sb.workspace, "empty/deeper"))
    finally:
        child.close()
    assert not os.path.exists(child.workspace)
    still_works(sb)


@needs_bwrap
def test_restore_brings_back_the_snapshot_exactly(sb):
    _populate(sb)
    sb.env["V"] = "1"
    before = tree(sb.workspace)
    snap = sb.snapshot()
    assert sb.exec("rm -rf a; echo new > a; chmod 777 empty; ln -sf elsewhere dangling; mkdir -p x/y").ok
    sb.env["V"] = "2"
    sb.restore(snap)
    assert tree(sb.workspace) == before and sb.env == {"V": "1"}
    assert sb.exec("echo again > a/b/c/ok && cat a/link").stdout == "one\n"    # still the sandbox's own files
    sb.restore(snap)
    assert tree(sb.workspace) == before


_NAMES = st.sampled_from(["a", "b", "c", "d/e", "d/f", "g/h/i"])
_EDITS = st.lists(st.one_of(
    st.tuples(st.just("write"), _NAMES, st.binary(max_size=64), st.sampled_from([0o600, 0o644, 0o755, 0o4755])),
    st.tuples(st.just("mkdir"), _NAMES),
    st.tuples(st.just("symlink"), _NAMES, st.sampled_from(["a", "../x", "/etc/passwd", "d"])),
    st.tuples(st.just("remove"), _NAMES),
), max_size=12)


def _apply(root, edits):
    """Apply edits directly to a workspace tree, as any command could (the host does them here to be fast)."""
    for kind, name, *rest in edits:
        p = os.path.join(root, name)
        if os.path.lexists(p):
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.unlink(p)
        if kind == "remove":
            continue
        os.makedirs(os.path.dirname(p), exist_ok=True)
        if kind == "write":
            with open(p, "wb") as f:
                f.write(rest[0])
            os.chmod(p, rest[1])
        elif kind == "mkdir":
            os.makedirs(p)
        else:
            os.symlink(rest[0], p)


@needs_bwrap
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=_EDITS, second=_EDITS)
def test_snapshot_restore_and_fork_are_exact_after_any_edits(sb, first, second):
    _apply(sb.workspace, first)
    before = tree(sb.workspace)
    snap = sb.snapshot()
    child = sb.fork()
    try:
        assert tree(child.workspace) == before
        _apply(sb.workspace, second)
        assert tree(child.workspace) == before
        sb.restore(snap)
        assert tree(sb.workspace) == before
    finally:
        child.close()
    _apply(sb.workspace, [("remove", name) for name in ("a", "b", "c", "d", "g")])


@needs_bwrap
def test_pause_stops_a_running_call_and_resume_continues_it(sb):
    # the counter is replaced atomically, so a read never sees a half-written file
    call = sb.start("i=0; while true; do i=$((i+1)); echo $i > c.tmp; mv c.tmp counter; sleep 0.02; done", timeout=20)
    time.sleep(0.5)
    call.pause()
    time.sleep(0.1)                                     # a write already under way lands
    paused_at = sb.read_file("counter")
    time.sleep(0.6)
    assert sb.read_file("counter") == paused_at and call.paused and not call.done
    with pytest.raises(SandboxError, match="paused"):
        call.wait()
    call.resume()
    time.sleep(0.5)
    assert int(sb.read_file("counter")) > int(paused_at)
    r = call.kill()
    assert r.signal == "SIGKILL" and not r.timed_out and r.paused_s >= 0.7
    still_works(sb)


@needs_bwrap
def test_paused_time_does_not_count_against_the_wall_limit(sb):
    call = sb.start("sleep 0.6; echo finished", timeout=1.0)
    time.sleep(0.2)
    call.pause()
    assert call.wait(timeout=1.2) is None               # paused longer than the whole limit: still not killed
    call.resume()
    r = call.wait(timeout=5)
    assert r.ok and r.stdout == "finished\n" and r.paused_s >= 1.2 and r.wall_s < 1.0, r
    r = sb.start("sleep 5", timeout=0.5).wait(timeout=5)   # without a pause, the same limit kills
    assert r.timed_out


@needs_bwrap
def test_close_kills_running_calls_and_refuses_more():
    sandbox = create_sandbox("bwrap", limits=SMALL)
    marker = f"999.{os.getpid()}"
    call = sandbox.start(f"sleep {marker}")
    time.sleep(0.2)
    sandbox.close()
    assert call.done and call.wait().signal == "SIGKILL" and _host_processes_with(marker) == []
    with pytest.raises(SandboxError, match="closed"):
        sandbox.exec("true")
    assert not os.path.exists(sandbox.workspace)


@needs_bwrap
def test_a_sandbox_dropped_without_close_leaves_nothing_behind():
    import gc
    sandbox = create_sandbox("bwrap")
    snap = sandbox.snapshot()
    dirs = [os.path.dirname(sandbox.workspace), snap.path]
    del sandbox
    gc.collect()
    assert not any(os.path.exists(d) for d in dirs)


@needs_bwrap
def test_host_paths_resolve_as_in_the_sandbox_and_never_leave_it(sb):
    assert sb.exec("mkdir -p d/e && echo in > d/e/f && ln -s /workspace/d abs && ln -s d/e rel && ln -s ../d/e d/up"
                   " && ln -s /etc/passwd out && ln -s .. parent && ln -s loop loop").ok
    for path in ("abs/e/f", "/workspace/rel/f", "d/up/f", "d/../abs/e/./f"):
        assert sb.read_file(path) == b"in\n", path
    for path in ("../x", "/etc/passwd", "/workspacex", "out", "parent/x", "d/../../x", "loop", "a\0b"):
        with pytest.raises(SandboxError):
            sb.read_file(path)
    with pytest.raises(SandboxError, match="cwd"):
        sb.exec("true", cwd="/tmp")


@needs_bwrap
def test_a_call_that_closes_its_output_still_runs_to_its_end(sb):
    r = sb.exec("exec >&- 2>&-; sleep 0.3; echo done > marker")
    assert r.ok and sb.read_file("marker") == b"done\n" and r.wall_s >= 0.3, r


@needs_bwrap
def test_a_call_paused_as_it_starts_stops_at_once(sb):
    call = sb.start("echo started > s; sleep 0.3; echo finished", timeout=1.0)
    t0 = time.monotonic()
    call.pause()                                        # while the call's processes are still being executed
    assert time.monotonic() - t0 < 0.2
    assert call.wait(timeout=1.5) is None and not call.done
    call.resume()
    r = call.wait(timeout=5)
    assert r.ok and r.stdout == "finished\n" and r.paused_s >= 1.5, r


def test_file_copies_are_clones_where_the_filesystem_can_and_exact_either_way(tmp_path):
    """fork/snapshot/restore copy regular files with a copy-on-write clone (FICLONE) where the filesystem supports
    it, else byte for byte; `last_copy_mode` says which, and the bytes, mode and times are the same either way."""
    import k3.env.sandbox as sandbox_module

    src, dst = tmp_path / "a", tmp_path / "b"
    data = os.urandom(3 << 20) + b"tail"
    src.write_bytes(data)
    os.chmod(src, 0o640)
    os.utime(src, (1_000_000, 2_000_000))
    sandbox_module._copy_entry(str(src), str(dst))
    assert dst.read_bytes() == data
    assert sandbox_module.last_copy_mode in ("reflink", "copy")
    st_a, st_b = os.stat(src), os.stat(dst)
    assert stat.S_IMODE(st_b.st_mode) == 0o640 and st_b.st_mtime == st_a.st_mtime
