"""Running a candidate in its own process: a fresh interpreter (k3.kernel_reward.worker) with a time limit, a
memory limit and no network, that the harness survives whatever the candidate does.

* time: each phase (check, time) has a wall-clock limit; past it the process group is killed;
* memory: on CPU the address space is capped (RLIMIT_AS, Linux: `memory_bytes` above what is mapped at the
  start), so an unbounded allocation fails inside the
  candidate; on CUDA (where the driver maps far more address space than it uses) the process gets a fraction of
  the GPU's memory (torch.cuda.set_per_process_memory_fraction);
* network: the worker replaces the socket functions before the candidate is imported, and the environment
  carries no proxy settings. (For hostile code, run the harness itself inside a network namespace as well.)

The process is a fresh interpreter (``subprocess``, the default) or, with ``Limits(start="forkserver")``, a fork
of a fresh interpreter that has imported torch and the worker and run nothing else (k3.kernel_reward.forkserver):
the same isolation without paying torch's import (seconds) per candidate, for large batches.

A crash, a hang, an exception or an out-of-memory becomes a `Failure` with the reason; nothing is raised.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from k3.kernel_reward.outputs import load_outputs

__all__ = ["Failure", "Limits", "Run"]

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the directory above k3/
_PROXIES = ("http_proxy", "https_proxy", "ftp_proxy", "all_proxy", "no_proxy")


@dataclass(frozen=True)
class Limits:
    check_s: float = 300.0  # wall clock for start-up, import and the correctness calls
    time_s: float = 300.0  # wall clock for the timed calls
    memory_bytes: int = 8 << 30  # CPU: address space the candidate's process may map beyond its start
    gpu_memory_fraction: float = 0.9  # CUDA: of the device's memory
    start: str = "subprocess"  # or "forkserver" (see the module docstring)

    def __post_init__(self):
        if self.start not in ("subprocess", "forkserver"):
            raise ValueError(f"Limits.start={self.start!r} is invalid: use subprocess or forkserver")


@dataclass(frozen=True)
class Failure:
    """Why a run gave no result: "crash", "timeout", "memory" or "exception", with the details."""

    kind: str
    reason: str


_OOM_WORDS = ("can't allocate memory", "out of memory", "cannot allocate memory", "memoryerror")


def _classify(err: dict) -> Failure:
    text = f"{err['type']}: {err['message']}"
    kind = "memory" if err["type"] == "MemoryError" or any(w in text.lower() for w in _OOM_WORDS) else "exception"
    where = "importing the candidate" if err["stage"] == "import" else err["stage"]
    if kind == "memory":
        return Failure(kind, f"out of memory ({where}): {text[:300]}")
    last = [ln for ln in err["traceback"].strip().splitlines() if ln.strip().startswith("File")][-1:]
    at = f" at {last[0].strip()}" if last else ""
    return Failure(kind, f"raised {text[:500]} ({where}){at}")


class Run:
    """One candidate's process. `check()` waits for the correctness phase's results, `time()` (if the spec's
    phases include it) for the timing's; each returns the worker's JSON payload and its tensors, or a Failure."""

    def __init__(self, task: str, candidate_path: str, device: str, directory: str, *, phases=("check", "time"),
                 limits: Limits = Limits(), timing: dict | None = None, trusted: bool = False):
        self.dir, self.limits, self.device = directory, limits, device
        spec = {"task": task, "candidate": os.path.abspath(candidate_path), "device": device, "dir": directory,
                "phases": list(phases), "wait": "check" in phases and "time" in phases, "trusted": trusted,
                "timing": timing or {}, "gpu_memory_fraction": limits.gpu_memory_fraction}
        with open(os.path.join(directory, "spec.json"), "w") as f:
            json.dump(spec, f)
        mem = limits.memory_bytes if device == "cpu" else None
        spec_path = os.path.join(directory, "spec.json")
        log = os.path.join(directory, "log.txt")
        if limits.start == "forkserver":
            self.proc = _fork(spec_path, log, mem, device)
        else:
            env = _environment(dict(os.environ), device)
            env["PYTHONPATH"] = os.pathsep.join([_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
            self.log = open(log, "wb")
            self.proc = subprocess.Popen([sys.executable, "-m", "k3.kernel_reward.worker", spec_path],
                                         stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                         env=env, cwd=directory, start_new_session=True,
                                         preexec_fn=(lambda: _limit(mem)) if os.name == "posix" else None)
            self.log.close()
        self.started = time.monotonic()

    def _wait_for(self, name: str, limit_s: float):
        path = os.path.join(self.dir, f"{name}.json")
        deadline = time.monotonic() + limit_s
        while not os.path.exists(path):
            if self.proc.poll() is not None:
                if os.path.exists(path):
                    break
                return self._died()
            if time.monotonic() > deadline:
                self.kill()
                return Failure("timeout", f"time limit of {limit_s:g} s exceeded ({name} phase)")
            time.sleep(0.02)
        with open(path) as f:
            payload = json.load(f)
        outputs = os.path.join(self.dir, f"{name}.safetensors")
        try:
            tensors = load_outputs(outputs) if os.path.exists(outputs) else []
        except ValueError as e:  # written by the candidate's process: untrusted
            return Failure("exception", str(e))
        if payload.get("error"):
            return _classify(payload["error"])
        return payload, tensors

    def _died(self) -> Failure:
        code = self.proc.returncode
        with open(os.path.join(self.dir, "log.txt"), "rb") as f:
            tail = f.read()[-1500:].decode("utf-8", "replace").strip()
        if code < 0:
            name = signal.Signals(-code).name
            kind = "memory" if -code == signal.SIGKILL else "crash"
            return Failure(kind, f"the candidate's process was killed by {name}"
                                 f"{' (out of memory?)' if kind == 'memory' else ''}; output: {tail[-500:]}")
        low = tail.lower()
        kind = "memory" if any(w in low for w in _OOM_WORDS) else "crash"
        return Failure(kind, f"the candidate's process exited with status {code}: {tail[-500:]}")

    def check(self):
        return self._wait_for("check", self.limits.check_s)

    def _go(self, what: str) -> None:
        path = os.path.join(self.dir, "go")
        with open(path + ".tmp", "w") as f:
            f.write(what)
        os.replace(path + ".tmp", path)

    def time(self):
        self._go("time")
        return self._wait_for("time", self.limits.time_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self._go("stop")
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


def _environment(env: dict, device: str) -> dict:
    """The candidate's environment: no proxies; on CPU, Triton's interpreter and no CUDA devices."""
    env = {k: v for k, v in env.items() if k.lower() not in _PROXIES}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"  # Triton candidates run in its interpreter on CPU tensors
        env["CUDA_VISIBLE_DEVICES"] = ""
        # Under the address-space cap every thread's stack and malloc arena count: on a many-core host OpenMP's
        # pool and glibc's per-thread arenas alone would exhaust it. A few threads, two arenas.
        env.setdefault("OMP_NUM_THREADS", str(min(4, os.cpu_count() or 1)))
        env.setdefault("MALLOC_ARENA_MAX", "2")
    return env


def _address_space() -> int:
    """This process's mapped address space in bytes (Linux: VmSize), 0 where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _limit(mem: int | None) -> None:
    """In the candidate's process, before anything runs: no core dumps, and the address space capped at `mem`
    above what is mapped now (a CUDA build of torch maps several GB of libraries before anything is allocated, and
    this runs in the harness's forked image, which has torch imported: the cap is headroom, not a total)."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if mem is not None:
        cap = _address_space() + mem
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


_server = None
_server_lock = threading.Lock()


def _fork(spec_path: str, log: str, mem: int | None, device: str) -> "_Forked":
    """A child of the fork server (started on first use, one per harness process)."""
    global _server
    with _server_lock:
        if _server is None or _server.poll() is not None:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
            _server = subprocess.Popen([sys.executable, "-m", "k3.kernel_reward.forkserver"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=env, start_new_session=True)
        req = {"spec": spec_path, "log": log, "mem": mem, "device": device}
        _server.stdin.write((json.dumps(req) + "\n").encode())
        _server.stdin.flush()
        pid = int(_server.stdout.readline())
    return _Forked(pid, os.path.join(os.path.dirname(spec_path), "exit"))


class _Forked:
    """A fork server's child behind Popen's poll / wait / kill / returncode / pid (the server writes its status)."""

    def __init__(self, pid: int, exit_path: str):
        self.pid, self.exit_path, self.returncode = pid, exit_path, None

    def poll(self):
        if self.returncode is None and os.path.exists(self.exit_path):
            with open(self.exit_path) as f:
                self.returncode = int(f.read())
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("candidate", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self):
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
