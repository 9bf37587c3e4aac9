"""The run directory on disk: one training process at a time (a lock on `OUT/.lock`), and its checkpoints
directory `OUT/checkpoints/`: which checkpoints are complete, the latest one, retention, and what an
interrupted save leaves behind.

A save writes `step-N.partial/`, renames it to `step-N/`, then rewrites `latest.json`, then prunes. A
process killed at any point leaves a `.partial` (or, while re-saving the same step, an `.old`) folder and
possibly one checkpoint too many or a `latest.json` one step behind; everything here reads the directory
listing, so the next start recovers from each of these.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
from typing import IO, Callable

from k3.checkpoint import INDEX
from k3.files import fsync_dir

_STEP = re.compile(r"^step-(\d+)$")
# What a save writes; a directory holding all of them was renamed into place complete (save_pretrained).
COMPLETE_FILES = ("config.json", INDEX, "trainer_state.json", "trainer_state.safetensors")
# A distributed run's checkpoint is the official layout above (gathered on rank 0, for `k3 eval` / `k3 serve` and
# the settings --resume reads) with its sharded training state (k3.parallel.checkpoint: model and optimizer
# shards, trainer state) in the subfolder `sharded/`. All ranks write it first as `step-N.sharded/` next to the
# checkpoint; rank 0 moves it in once `step-N/` is in place. clean_interrupted finishes a move cut short.
SHARDED_DIR = "sharded"
_STAGED = ".sharded"
SHARDED_FILES = (".metadata", "sharded_state.json", "config.json")  # k3.parallel.checkpoint.SHARDED_COMPLETE_FILES


class RunLockedError(ValueError):
    """Another process is training in this run directory."""


# --- one process per run directory ---------------------------------------------------------------------
def lock_run_dir(out: str) -> IO:
    """Take the run directory's exclusive lock, or raise RunLockedError naming the process that holds it.
    The lock lives as long as the returned file stays open: close it to release. A crashed or killed process
    releases it too (the kernel drops a flock with the last descriptor), so a lock is never stale."""
    import fcntl

    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, ".lock")
    f = open(path, "a+", encoding="utf-8")  # not "w": the holder's pid and host are in the file
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = _holder(f.read())
        f.close()
        raise RunLockedError(f"run directory {out} is in use by another training run ({holder}, lock {path}); "
                             "wait for it to finish or stop it, or choose another --out") from None
    except OSError as e:
        f.close()
        raise RunLockedError(f"cannot lock run directory {out} ({path}: {e.strerror or e}); "
                             "use a run directory on a local file system") from None
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n")
    f.flush()
    return f


_HELD: dict[str, IO] = {}  # the run directories this process holds, by real path


@contextlib.contextmanager
def holding_run_dir(out: str):
    """Hold the run directory's lock for the block; re-entered by the same process (run_training holds it
    around building the run and Trainer.fit), a no-op inside."""
    key = os.path.realpath(out)
    if key in _HELD:
        yield
        return
    f = lock_run_dir(out)
    _HELD[key] = f
    try:
        yield
    finally:
        del _HELD[key]
        f.close()


def _holder(text: str) -> str:
    try:
        d = json.loads(text)
        return f"pid {int(d['pid'])} on host {d['host']}"
    except (ValueError, KeyError, TypeError):  # taken a moment ago, its pid not yet written
        return "pid unknown"


# --- the checkpoints directory -----------------------------------------------------------------------------
def step_of(name: str) -> int | None:
    m = _STEP.match(name)
    return int(m.group(1)) if m else None


def is_complete(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in COMPLETE_FILES)


def sharded_state(path: str) -> str | None:
    """The complete sharded training state of the checkpoint `path` (a distributed run's), or None."""
    sub = os.path.join(path, SHARDED_DIR)
    return sub if is_complete(path) and all(os.path.isfile(os.path.join(sub, f)) for f in SHARDED_FILES) else None


def complete_checkpoints(ckdir: str) -> list[tuple[int, str]]:
    """(step, path) of every complete `step-N` checkpoint, oldest first."""
    if not os.path.isdir(ckdir):
        return []
    out = []
    for n in os.listdir(ckdir):
        s = step_of(n)
        if s is not None and is_complete(os.path.join(ckdir, n)):
            out.append((s, os.path.join(ckdir, n)))
    return sorted(out)


def latest_checkpoint(out: str) -> str | None:
    """The newest complete checkpoint of the run in `out`, or None. `latest.json` is written after the
    checkpoint it names, so a crash in between leaves it one save behind (or a damaged write leaves it
    unreadable): the directory listing decides, and latest.json only counts when it names a complete
    checkpoint of another name."""
    ckdir = os.path.join(out, "checkpoints")
    done = complete_checkpoints(ckdir)
    if done:
        return done[-1][1]
    try:
        with open(os.path.join(ckdir, "latest.json"), encoding="utf-8") as f:
            name = json.load(f)["checkpoint"]
        path = os.path.join(ckdir, os.path.basename(str(name)))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return path if is_complete(path) else None


class CheckpointPathError(ValueError):
    """A checkpoint flag names no checkpoint."""


def resolve_checkpoint(path: str, what: str = "--ckpt", log: Callable[[str], object] | None = None) -> str:
    """The checkpoint a flag's `path` names, for every command and flag that reads a model: a checkpoint directory
    (it holds config.json: a training checkpoint, an export, the release) is itself; a training run directory is
    its latest complete checkpoint (`latest_checkpoint`), which `log` is told as "WHAT: PATH -> CHECKPOINT";
    anything else raises CheckpointPathError naming the flag, the path and what was expected. `what` names the
    flag in both ("--ckpt", "--student", "--teacher code")."""
    expected = ("expected a checkpoint directory (with config.json) or a training run directory (its latest "
                "complete checkpoint, under checkpoints/step-N/)")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    if not os.path.exists(path):
        why = "it does not exist"
    elif not os.path.isdir(path):
        why = "it is a file, not a directory"
    elif os.path.isdir(os.path.join(path, "checkpoints")):
        ck = latest_checkpoint(path)
        if ck is not None:
            if log is not None:
                log(f"{what}: {path} -> {ck}")
            return ck
        why = f"a run directory without a complete checkpoint in {os.path.join(path, 'checkpoints')}"
    else:
        why = "no config.json and no checkpoints/ in it"
    raise CheckpointPathError(f"{what}: {path}: no checkpoint there ({why}); {expected}")


def truncated_files(path: str) -> list[str]:
    """The safetensors files of the checkpoint `path` that are shorter than their own header says (cut off by a
    full disk, a copy or a transfer), as "FILE (N of M bytes)"; reads the headers only. A file whose header cannot
    be read at all is listed too. (A save renames a checkpoint into place only after every file is written and
    fsynced, so a truncated file in a complete checkpoint was damaged afterwards.)"""
    import struct

    out = []
    for name in sorted(os.listdir(path)):
        f = os.path.join(path, name)
        if not (name.endswith(".safetensors") and os.path.isfile(f)):
            continue
        size = os.path.getsize(f)
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > size:
                    raise ValueError
                header = json.loads(fh.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
            expected = 8 + n + end
        except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
            out.append(f"{f} (its header is unreadable: {size} bytes)")
            continue
        if size < expected:
            out.append(f"{f} ({size:,} of {expected:,} bytes)")
    return out


def resume_checkpoint(out: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(the checkpoint `--resume` continues the run in `out` from, [(path, why)] of the newer `step-N` folders it
    passes over): the newest complete checkpoint whose tensor files are whole. A newer folder that lacks files (a
    save killed in a way that left them out, or files removed by hand) or holds a truncated file is passed over
    when an older usable checkpoint exists; with none, the newest complete one is returned and its load says
    what is wrong with it."""
    ckdir = os.path.join(out, "checkpoints")
    names = sorted(((step_of(n), n) for n in (os.listdir(ckdir) if os.path.isdir(ckdir) else ())
                    if step_of(n) is not None and os.path.isdir(os.path.join(ckdir, n))), reverse=True)
    skipped = []
    for _, n in names:
        p = os.path.join(ckdir, n)
        missing = [f for f in COMPLETE_FILES if not os.path.isfile(os.path.join(p, f))]
        if missing:
            skipped.append((p, f"incomplete: no {', '.join(missing)}"))
            continue
        cut = truncated_files(p)
        if cut:
            skipped.append((p, f"damaged: truncated {', '.join(cut)}"))
            continue
        return p, skipped
    newest = latest_checkpoint(out)
    return newest, [(p, why) for p, why in skipped if newest is None or step_of(os.path.basename(p)) >
                    step_of(os.path.basename(newest))]


def clean_interrupted(ckdir: str, log: Callable[[str], object] = print) -> list[str]:
    """Remove what interrupted saves left in `ckdir` (`*.partial`, `*.old` folders, temporary files of
    latest.json); returns their names. Only call it while holding the run's lock: a running save's
    `.partial` looks the same."""
    if not os.path.isdir(ckdir):
        return []
    names = sorted(os.listdir(ckdir))
    removed, restored = [], []
    for n in names:
        p = os.path.join(ckdir, n)
        if n.endswith(".old") and os.path.isdir(p):
            base = p[: -len(".old")]
            # Killed while swapping a re-saved step into place (k3.files.replace_dir): the previous version
            # is the one still known to be whole.
            if not os.path.exists(base) and os.path.isdir(base + ".partial") and is_complete(p):
                os.replace(p, base)
                restored.append(n)
                continue
            shutil.rmtree(p, ignore_errors=True)
            removed.append(n)
    for n in names:
        p = os.path.join(ckdir, n)
        if n.endswith(_STAGED) and os.path.isdir(p):
            # A distributed save's sharded state, not yet moved into its checkpoint: moved in when that
            # checkpoint is complete and lacks it (the save was killed between the two), removed otherwise.
            base = p[: -len(_STAGED)]
            if (step_of(os.path.basename(base)) is not None and is_complete(base)
                    and not os.path.exists(os.path.join(base, SHARDED_DIR))
                    and all(os.path.isfile(os.path.join(p, f)) for f in SHARDED_FILES)):
                os.replace(p, os.path.join(base, SHARDED_DIR))
                fsync_dir(base)
                restored.append(n)
                continue
            shutil.rmtree(p, ignore_errors=True)
            removed.append(n)
    for n in names:
        p = os.path.join(ckdir, n)
        if step_of(n) is not None and os.path.isdir(p):  # a re-save's swap of sharded/ cut short
            for sub in (SHARDED_DIR + ".old", SHARDED_DIR + ".partial"):
                if os.path.isdir(os.path.join(p, sub)):
                    shutil.rmtree(os.path.join(p, sub), ignore_errors=True)
                    removed.append(f"{n}/{sub}")
        if n.endswith(_STAGED + ".partial") and os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(n)
        elif n.endswith(".partial") and os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(n)
        elif n.startswith(".tmp-") and os.path.isfile(p):  # k3.files.atomic_write's temporary files
            os.unlink(p)
            removed.append(n)
    if removed or restored:
        fsync_dir(ckdir)
    if restored:
        log(f"checkpoints: restored {', '.join(restored)} (its replacement or move was interrupted)")
    if removed:
        log(f"checkpoints: removed {', '.join(sorted(removed))} left by an interrupted save")
    return sorted(removed)


def prune(ckdir: str, current: str, keep: int, log: Callable[[str], object] = print) -> list[str]:
    """Keep the `keep` newest complete checkpoints up to `current` (the one just saved, always kept) and
    remove the others, whatever earlier crashes left; also checkpoints newer than `current` (from a run
    continued from an earlier checkpoint), which resuming would otherwise take for the latest."""
    cur = step_of(os.path.basename(current))
    done = complete_checkpoints(ckdir)
    ahead = [p for s, p in done if cur is not None and s > cur]
    upto = [p for s, p in done if cur is None or s <= cur]
    drop = ahead + upto[: max(0, len(upto) - keep)]
    drop = [p for p in drop if os.path.basename(p) != os.path.basename(current)]
    for p in drop:
        # Renamed first, so that a crash in the middle of the removal never leaves a half-deleted `step-N`
        # that still looks complete; the `.old` left by such a crash goes at the next start.
        old = p + ".old"
        if os.path.exists(old):
            shutil.rmtree(old)
        os.replace(p, old)
        shutil.rmtree(old, ignore_errors=True)
    if drop:
        fsync_dir(ckdir)
    if ahead:
        log(f"checkpoints: removed {', '.join(os.path.basename(p) for p in ahead)}, "
            f"newer than {os.path.basename(current)} (from a run that was continued from an earlier checkpoint)")
    return [os.path.basename(p) for p in drop]
