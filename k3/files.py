"""Files written atomically and durably, and JSON files read with errors that name the file."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from typing import BinaryIO, Callable


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (files created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` and fsync it (a file inside a directory that is renamed into place afterwards)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_dir(new: str, path: str) -> None:
    """Swap the finished directory `new` into place as `path`: the previous `path` is kept as `path.old` until the
    new one is there (a crash in between leaves one of the two), and the rename is made durable."""
    fsync_dir(new)
    old = path + ".old"
    if os.path.exists(old):
        shutil.rmtree(old)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(new, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (/proc/self/status, "Umask:"); elsewhere
    set and restored at once (os.umask has no read-only form: a file another thread creates in that instant gets
    umask 022)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> None:
    """Call `write(f)` on a temporary file in the same directory, fsync, rename over `path`, fsync the directory.

    A crash at any point leaves either the old file or the new one, never a torn write; once this returns the
    new one survives a power loss too (the rename itself is only durable once the directory is synced). The file
    gets the mode a plain `open(path, "wb")` would leave it with, not mkstemp's private 0600: the replaced file's
    mode, or for a new file 0666 less the umask.
    """
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix="-" + os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(d)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def read_json_file(path: str, error: type[Exception]):
    """The JSON value stored in `path`; `error(message naming the file)` when it cannot be read, is not UTF-8 text
    or is not JSON (a damaged checkpoint or config file gets one clear line, never a traceback)."""
    import json

    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except OSError as e:
        raise error(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise error(f"{path} is not valid JSON: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise error(f"{path} is not valid JSON: {e}") from None
