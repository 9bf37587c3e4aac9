"""`k3 serve` instances on this machine, each its own process on a free loopback port: a fleet for the router's
benchmark (benchmarks/route_bench.py) and tests, and for trying `k3 route` on one machine. An instance can be killed
(SIGKILL, as a crashed machine) and started again on its port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (another process may take it before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServeProcess:
    """One `python -m k3 serve --ckpt CKPT --port PORT ARGS...`, its output in `log_path`."""

    def __init__(self, ckpt: str, port: int, args=(), log_path: str | None = None, host: str = "127.0.0.1",
                 threads: int = 1):
        self.ckpt, self.port, self.args, self.host = str(ckpt), port, list(args), host
        self.log_path = log_path or os.devnull
        self.threads = threads
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServeProcess:
        env = {k: v for k, v in os.environ.items() if k != "K3_API_KEY"}
        env["OMP_NUM_THREADS"] = str(self.threads)  # one instance a core or less: no thread pool fights another
        cmd = [sys.executable, "-m", "k3", "serve", "--ckpt", self.ckpt, "--host", self.host, "--port",
               str(self.port), "--device", "cpu", "--log-level", "warning", *self.args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(trust_env=False, timeout=2.0) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"k3 serve on port {self.port} exited with {self.proc.returncode}; see "
                                       f"{self.log_path}")
                try:
                    if c.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        raise RuntimeError(f"k3 serve on port {self.port} did not answer /health within {timeout:g} s")

    def kill(self) -> None:
        """SIGKILL, as a machine that fails: no graceful shutdown, connections reset."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def start_fleet(ckpt: str, n: int, args=(), log_dir: str | None = None, timeout: float = 180.0) -> list[ServeProcess]:
    """`n` instances of `ckpt`, started together and ready (each answering /health); stopped again when one fails
    to start."""
    procs = [ServeProcess(ckpt, free_port(), args, os.path.join(log_dir, f"serve-{i}.log") if log_dir else None)
             for i in range(n)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready(timeout)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs
