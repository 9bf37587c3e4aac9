"""Every fenced bash and Python block of README.md runs, in order, in one temporary directory, as written.

The blocks are found by Sybil's Markdown lexers (no parser of our own). The only changes to a block are the
substitutions in SUBSTITUTIONS below: step, time and size counts shrunk so the walk fits CI, a free loopback port
for each server, and /tmp/ made relative to the walk's directory. A block that needs a GPU, several hosts, the
internet or inputs of your own carries a marker on the line right before its fence,

    <!-- doctest: skip (needs a GPU) -->

and is skipped with that reason printed. Blocks of other languages (json, output tables) are not commands and are
not run. Shell blocks run under `bash -e` with `k3` on PATH and the repository's benchmarks/ linked in (a reader runs
the README from the checkout's root), each in its own session; Python blocks run in one shared namespace, as a reader
pasting them into one interpreter would. Servers a block leaves running (`k3 serve ... &`, `k3 route ... &`) are
waited for on their port and stopped when the walk ends. Each block's wall and CPU time is printed (`pytest -s`).
"""

import dataclasses
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from sybil import Document
from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer, FencedCodeBlockLexer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
RUN_LANGUAGES = {"bash": "bash", "sh": "bash", "python": "python"}


def _small_train(steps: int) -> str:
    """Counts that make a training small (each a count of the command's own flags, nothing else changes)."""
    return f"--max-steps {steps} --eval-batches 1 --batch-tokens 2048 --max-corpus-mb 1"


# benchmarks/mopd_demo.py's step and record counts: every stage runs once, on a few records, in seconds.
_SMALL_MOPD = ("--pretrain-steps 1 --corpus-mb 0.2 --teacher-steps 1 --records 16 --heldout 2 --mopd-steps 1 "
               "--rollouts-per-step 2 --max-new-tokens 4 --eval-prompts 1 --eval-samples 1")

# (regular expression, replacement), applied to every block in this order. Each must match somewhere (checked),
# so the table cannot outlive the README it shrinks. {port_a}... are free loopback ports, chosen per walk.
SUBSTITUTIONS = [
    # Training time and steps.
    (r"k3 train --max-minutes 10\b", f"k3 train {_small_train(1)}"),
    (r"k3 train --resume --max-minutes 20\b", f"k3 train --resume {_small_train(2)}"),
    (r"--out runs/base --max-minutes 10\b", f"--out runs/base {_small_train(1)}"),
    (r"--max-steps (200|300)\b", "--max-steps 1 --eval-batches 1 --batch-tokens 2048"),  # k3 sft
    (r"--max-steps (100|30)\b", "--max-steps 1"),
    (r"--preset tiny --max-steps 10\b", f"--preset tiny {_small_train(1)}"),
    (r"--out runs/vision --max-minutes 10\b", f"--out runs/vision {_small_train(1)} --seq-len 128"),
    # 40 pairs, small enough for the 128-token rows, with a held-out share that leaves some held out whatever this
    # installation's files are (the pairs are drawn from them, held out by their hash: at the default 5% of 40, an
    # installation could hold out none, or only a pair too large for a row)
    (r"render-pairs --out data/pairs --n 2000\b",
     "render-pairs --out data/pairs --n 40 --heldout-share 0.3 --max-image-tokens 32 --max-lines 3"),
    (r"--transcribe data/pairs/heldout\.jsonl --max-records 50\b",
     "--transcribe data/pairs/heldout.jsonl --max-records 1 --max-new-tokens 4"),
    (r"mopd_demo\.py --work runs/mopd_demo +#", f"mopd_demo.py --work runs/mopd_demo {_SMALL_MOPD} #"),
    # one thread, as every block of the walk has (OMP_NUM_THREADS=1 in its environment): two threads' spinning on
    # 2 shared cores made the demo several times slower
    (r"OMP_NUM_THREADS=2 python benchmarks/mopd_demo\.py", "OMP_NUM_THREADS=1 python benchmarks/mopd_demo.py"),
    (r"k3 eval --ckpt runs/k3\b", "k3 eval --ckpt runs/k3 --max-batches 1"),
    (r"--max-new-tokens (100|128)\b", "--max-new-tokens 8"),
    (r"--rollouts-per-step 8\b", "--rollouts-per-step 2"),
    (r"--rollout-budget 64\b", "--rollout-budget 8"),
    (r'reasoning_effort="high"\)', 'reasoning_effort="high", max_tokens=16)'),
    (r"max_tokens=32\b", "max_tokens=8"),
    (r"stream=True\)", "stream=True, max_tokens=16)"),
    (r"train-draft --ckpt runs/base --steps 200\b", "train-draft --ckpt runs/base --steps 1"),
    (r'"def fib\(n\):"', '"def fib(n):" --max-new-tokens 8'),
    # Task counts of the agent environments and RL.
    (r"--tasks arith:20 code:10\b", "--tasks arith:1"),  # one episode per harness: a server round trip each
    (r"--tasks arith:1500\b", "--tasks arith:16"),
    (r"--tasks arith:400 --heldout arith:100\b", "--tasks arith:4 --heldout arith:1"),
    (r"--groups 8 --samples 4\b", "--groups 1 --samples 2"),
    # Servers: a free loopback port each, in the background (the walk stops them at the end).
    (r"k3 serve --ckpt runs/k3 +#", "k3 serve --ckpt runs/k3 --port {port_a} & #"),
    (r"http://127\.0\.0\.1:8000/v1\"", 'http://127.0.0.1:{port_a}/v1"'),
    (r"k3 serve --ckpt runs/sft_qat/mxfp4 ", "k3 serve --ckpt runs/sft_qat/mxfp4 --port {port_b} & "),
    (r"k3 serve --ckpt runs/base --speculative eagle3 ", "k3 serve --ckpt runs/base --speculative eagle3 --port {port_c} & "),
    (r"--ckpt /tmp/t --port 8000 &", "--ckpt /tmp/t --port {port_d} &"),
    (r"--endpoint http://127\.0\.0\.1:8000/v1", "--endpoint http://127.0.0.1:{port_d}/v1"),
    (r"--ckpt /tmp/rl --port 8000 ", "--ckpt /tmp/rl --port {port_e} & "),
    (r"torchrun --nproc-per-node 2 ", "torchrun --nproc-per-node 2 --master-port {port_f} "),
    (r"--port 8001 &", "--port {port_g} &"),  # three instances and their router
    (r"--port 8002 &", "--port {port_h} &"),
    (r"--port 8003 &", "--port {port_i} &"),
    ((r"k3 route --backend http://127\.0\.0\.1:8001 --backend http://127\.0\.0\.1:8002 "
      r"--backend http://127\.0\.0\.1:8003 &"),
     ("k3 route --backend http://127.0.0.1:{port_g} --backend http://127.0.0.1:{port_h} "
      "--backend http://127.0.0.1:{port_i} --port {port_j} &")),
    (r"http://127\.0\.0\.1:8080/v1/", "http://127.0.0.1:{port_j}/v1/"),
    # The walk's own directory instead of the machine's /tmp.
    (r"/tmp/", "tmp/"),
]
PORTS = ("port_a", "port_b", "port_c", "port_d", "port_e", "port_f", "port_g", "port_h", "port_i", "port_j")


@dataclasses.dataclass
class Block:
    line: int  # the fence's line in README.md, 1-based
    language: str
    source: str
    skip: str | None  # the marker's reason, None when the block runs


def readme_blocks(text: str, path: str = README) -> list[Block]:
    """The fenced blocks of `text`, in order, each with the reason of a `<!-- doctest: skip (...) -->` right
    before it."""
    doc = Document(text, path)
    markers = {}
    for m in DirectiveInHTMLCommentLexer(directive="doctest")(doc):
        args = m.lexemes["arguments"].strip()
        found = re.fullmatch(r"skip \((.+)\)", args)
        assert found, f"README.md line {text.count(chr(10), 0, m.start) + 1}: marker '{args}', expected 'skip (reason)'"
        markers[m.end] = found.group(1)
    blocks = []
    for r in sorted(FencedCodeBlockLexer(language=r"[\w-]*")(doc), key=lambda r: r.start):
        # a marker's region ends before its closing "-->"; only blank space may lie between it and the fence
        reason = next((why for end, why in markers.items()
                       if end <= r.start and re.fullmatch(r"\s*(-->)?\s*", text[end:r.start])), None)
        blocks.append(Block(text.count("\n", 0, r.start) + 1, str(r.lexemes["language"]), str(r.lexemes["source"]),
                            reason))
    return blocks


def substitute(source: str, ports: dict[str, int], used: set[int]) -> str:
    for i, (pattern, replacement) in enumerate(SUBSTITUTIONS):
        source, n = re.subn(pattern, replacement.format(**ports).replace("\\", "\\\\"), source)
        if n:
            used.add(i)
    return source


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


# A server a block leaves running: `k3 serve ... --port N ... &`, or a router, `k3 route ... --port N ... &`. Either
# answers GET /v1/models once it can serve (the router: once one of its instances is healthy).
_BACKGROUND_SERVER = re.compile(r"k3 (?:serve|route) [^\n&]*--port (\d+)[^\n]*&")


def _cpu_seconds() -> float:
    """CPU time (user + system) of this process and of its children that have been waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _sessions_cpu_seconds(sids: set[int]) -> float:
    """CPU time (user + system) of the processes still running in the sessions `sids` (the servers the blocks left
    running, which this process never waits for), read from /proc; 0 where there is no /proc."""
    total, tick = 0, os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
        except OSError:  # exited meanwhile
            continue
        if int(fields[3]) in sids:  # state, ppid, pgrp, session, ...; utime and stime are the 12th and 13th
            total += int(fields[11]) + int(fields[12])
    return total / tick


def _wait_for_server(port: int, proc: subprocess.Popen, log: str, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        try:  # the block's session is gone only when every process in it (the server too) has exited
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    raise AssertionError(f"the server on port {port} did not come up:\n{open(log).read()[-3000:]}")


def walk(text: str, workdir, report=print) -> list[tuple[int, str]]:
    """Run the blocks of `text` in `workdir`, in order; stop at the first failure (AssertionError with the block's
    line and output). Returns (line, outcome) per block. Every server started is stopped before returning."""
    workdir = str(workdir)
    bindir = os.path.join(workdir, ".bin")
    os.makedirs(bindir)
    # the repository's scripts where a reader runs them, at the root of the checkout (`python benchmarks/x.py`)
    os.symlink(os.path.join(ROOT, "benchmarks"), os.path.join(workdir, "benchmarks"))
    for name, cmd in (("k3", f'exec "{sys.executable}" -m k3 "$@"'), ("python", f'exec "{sys.executable}" "$@"')):
        with open(os.path.join(bindir, name), "w") as f:
            f.write(f"#!/bin/sh\n{cmd}\n")
        os.chmod(os.path.join(bindir, name), 0o755)
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ["PATH"], OMP_NUM_THREADS="1")
    ports = dict(zip(PORTS, _free_ports(len(PORTS))))
    used: set[int] = set()
    sessions: list[subprocess.Popen] = []
    namespace: dict = {"__name__": "__readme__"}
    outcomes = []
    cwd = os.getcwd()
    walk_cpu0 = _cpu_seconds()
    try:
        for b in readme_blocks(text):
            if b.language not in RUN_LANGUAGES:
                continue
            if b.skip:
                report(f"README.md:{b.line}: skipped ({b.skip})")
                outcomes.append((b.line, f"skipped ({b.skip})"))
                continue
            source = substitute(b.source, ports, used)
            t0, cpu0 = time.monotonic(), _cpu_seconds()
            if RUN_LANGUAGES[b.language] == "bash":
                log = os.path.join(workdir, f".block-{b.line}.log")
                with open(log, "w") as out:  # a file, not a pipe: a background server keeps its end open
                    proc = subprocess.Popen(["bash", "-e", "-c", source], cwd=workdir, env=env, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
                sessions.append(proc)
                rc = proc.wait()
                assert rc == 0, (f"README.md:{b.line}: the block exited with {rc}:\n{source}\n--- output ---\n"
                                 f"{open(log).read()[-4000:]}")
                for port in _BACKGROUND_SERVER.findall(source):
                    _wait_for_server(int(port), proc, log)
            else:
                os.chdir(workdir)
                try:
                    exec(compile(source, f"README.md:{b.line}", "exec"), namespace)
                finally:
                    os.chdir(cwd)
            # CPU: this process's and the block's commands' (not that of a server the block leaves running)
            report(f"README.md:{b.line}: ran in {time.monotonic() - t0:.1f}s (CPU {_cpu_seconds() - cpu0:.1f}s)")
            outcomes.append((b.line, "ran"))
    finally:
        servers_cpu = _sessions_cpu_seconds({proc.pid for proc in sessions})
        report(f"README walk: CPU {_cpu_seconds() - walk_cpu0:.0f}s in the blocks and their commands, "
               f"{servers_cpu:.0f}s in the servers they left running")
        for proc in sessions:  # the servers the blocks left running, by the session each block started
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in sessions:
            try:
                for _ in range(100):
                    os.killpg(proc.pid, 0)
                    time.sleep(0.1)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return outcomes, used


def test_markers_name_a_reason_and_precede_a_block():
    text = open(README, encoding="utf-8").read()
    blocks = readme_blocks(text)
    assert text.count("<!-- doctest:") == sum(b.skip is not None for b in blocks)
    runnable = [b for b in blocks if b.language in RUN_LANGUAGES]
    counts = (sum(b.skip is None for b in runnable), sum(b.skip is not None for b in runnable))
    # the README's test section states these numbers; change it with them
    assert f"{counts[0]} of its {len(runnable)} bash and Python blocks run on CPU" in text, counts
    assert f"The other {counts[1]} (" in text, counts


@pytest.mark.slow
def test_readme_walk(tmp_path):
    """The whole README, in order (5.5 minutes on 2 shared CPU cores at a load of 4, 11 at a load of 9)."""
    text = open(README, encoding="utf-8").read()
    t0 = time.monotonic()
    outcomes, used = walk(text, tmp_path)
    print(f"README walk: {time.monotonic() - t0:.0f}s")
    unused = [SUBSTITUTIONS[i][0] for i in range(len(SUBSTITUTIONS)) if i not in used]
    assert not unused, f"substitutions that match no README block (stale): {unused}"
    assert sum(o == "ran" for _, o in outcomes) >= 10


def test_a_broken_command_fails_the_walk(tmp_path):
    """The test of the test: a renamed flag in the README's first runnable command stops the walk at that block."""
    text = open(README, encoding="utf-8").read()
    first = next(b for b in readme_blocks(text) if b.language in RUN_LANGUAGES and b.skip is None)
    assert "k3 init --preset tiny" in first.source
    broken = text.replace("k3 init --preset tiny", "k3 init --presets tiny", 1)
    with pytest.raises(AssertionError, match=rf"README.md:{first.line}: the block exited with 2"):
        walk(broken, tmp_path)
