"""Sandbox directories of a killed process are swept by the next one (k3.env.sandbox.sweep_stale): a process killed
outright cannot remove its sandboxes, and an RL run holds hundreds."""

import os
import signal
import subprocess
import sys
import textwrap

from k3.env import sandbox as sb


def _marked(tmp, name, mark):
    d = tmp / name
    (d / "workspace").mkdir(parents=True)
    (d / "workspace" / "f.txt").write_text("x")
    if mark is not None:
        (d / sb.OWNER_FILE).write_text(mark)
    return d


def test_dead_creators_directories_go_and_the_rest_stay(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(done.stdout)  # a process that has exited
    me = sb._identity(os.getpid())
    gone = [_marked(tmp_path, "k3-sandbox-dead", f"{dead} 123"), _marked(tmp_path, "k3-snapshot-dead", str(dead))]
    if " " in me:  # /proc tells start times: a live pid with another start time is a reused pid
        gone.append(_marked(tmp_path, "k3-sandbox-reused", f"{os.getpid()} 1"))
    kept = [_marked(tmp_path, "k3-sandbox-mine", me), _marked(tmp_path, "k3-sandbox-unmarked", None),
            _marked(tmp_path, "k3-sandbox-garbled", "not a pid"), _marked(tmp_path, "other-dead", f"{dead} 1")]
    (tmp_path / "k3-sandbox-uids").mkdir()  # the bwrap uid locks' directory: no marker
    removed = sb.sweep_stale(str(tmp_path))
    assert sorted(removed) == sorted(str(d) for d in gone)
    assert all(not d.exists() for d in gone) and all(d.exists() for d in kept)
    assert (tmp_path / "k3-sandbox-uids").exists()


def test_a_killed_process_sandboxes_are_swept_by_the_next(tmp_path):
    """A child makes two sandboxes (one forked) and a snapshot, then is killed with SIGKILL: its directories stay;
    the next process's first sandbox removes them and keeps its own."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    child = textwrap.dedent("""
        import os, sys, time
        from k3.env.sandbox import create_sandbox
        s = create_sandbox("none")
        f = s.fork()
        s.snapshot()
        print("ready", flush=True)
        time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", child], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGKILL)
    p.wait()
    left = sorted(n for n in os.listdir(tmp_path) if n.startswith(("k3-sandbox-", "k3-snapshot-")))
    assert len(left) == 3
    after = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import os
        from k3.env.sandbox import create_sandbox
        s = create_sandbox("none")
        print(os.path.dirname(s.workspace))
    """)], env=env, capture_output=True, text=True, check=True)
    now = sorted(n for n in os.listdir(tmp_path) if n.startswith(("k3-sandbox-", "k3-snapshot-")))
    assert not set(left) & set(now)  # the killed child's three went; the new process removed its own at exit
