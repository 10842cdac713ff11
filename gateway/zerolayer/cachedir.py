"""Cache directories: where they live (``data_root``), writing one once (``ensure_dir``) and
removing what interrupted writes left (``sweep``): the built-in model, converted GGUF files,
the built GGUF block kernel.

A directory is written into a temporary sibling (``.<name>-<8 random characters>``) and renamed
into place, so a crash or a concurrent daemon never leaves a half-written directory in place of
the real one; ``marker`` (a file the writer creates last or at all) tells a complete directory.
The writer holds an exclusive ``flock`` on the temporary directory while it writes, so a process
killed mid-write (kill -9, a power cut) leaves a temporary directory nobody holds, which the
next start's ``sweep`` removes, while a concurrent start's live one, still locked, is kept.
One directory has one writer at a time: a writer holds an exclusive ``flock`` on
``.<name>.lock`` beside it from its check for ``marker`` to the rename, so a second process (or
thread) writing the same directory at once waits, then finds it written, and the work (a kernel
compile, a conversion) is done once. The holder removes the lock file before it lets go; a
waiter that then holds a removed file takes the lock again on a fresh one (a writer killed
holding it leaves the empty file, which the next writer of that directory takes and removes).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

# mkdtemp's names: the prefix below, then 8 characters of [a-z0-9_]
_TEMPORARY = re.compile(r"\..+-[a-z0-9_]{8}")
SWEEP_DEPTH = 3  # data_root/gguf/<conversion>, data_root/kernels/<build>: deep enough


def data_root(data_dir: str = "") -> Path:
    """``model.data_dir``, or ``~/.cache/zerolayer`` when it is empty."""
    return Path(data_dir).expanduser() if data_dir else Path.home() / ".cache" / "zerolayer"


def _locked_temporary(target: Path) -> tuple[Path, int]:
    """A fresh temporary sibling of ``target`` and a descriptor holding its lock."""
    for _ in range(3):
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.path.samestat(os.fstat(fd), os.stat(tmp)):
                return tmp, fd
        except FileNotFoundError:
            pass  # a sweep took it between mkdtemp and flock: make another
        os.close(fd)
    raise OSError(f"cannot hold a temporary directory beside {target}")


@contextmanager
def _sole_writer(target: Path) -> Iterator[None]:
    """Held by the one writer of ``target``: the others wait here (see the module's docstring)."""
    path = target.parent / f".{target.name}.lock"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        except FileNotFoundError:
            pass  # removed by the writer this one waited for
        os.close(fd)
    try:
        yield
    finally:
        os.unlink(path)  # while held: whoever waits on it sees it removed and takes a new one
        os.close(fd)


def ensure_dir(target: Path, marker: str, write: Callable[[Path], None]) -> Path:
    """``target``, after ``write(tmp)`` filled a temporary sibling that is renamed to it; a
    ``target`` already holding ``marker`` is returned as it is, also when another writer wrote
    it while this one waited for it."""
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _sole_writer(target):
        if not (target / marker).is_file():
            _write(target, marker, write)
    return target


def _write(target: Path, marker: str, write: Callable[[Path], None]) -> None:
    tmp, fd = _locked_temporary(target)
    try:
        write(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is readable like any download
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / marker).is_file():
                raise  # not a writer without the lock (an older version) first: a real error
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        os.close(fd)  # the lock goes with it


def sweep(root: Path, depth: int = SWEEP_DEPTH) -> int:
    """Remove the temporary directories under ``root`` (``depth`` levels down) that no writer
    holds: what an interrupted ``ensure_dir`` left. Returns how many were removed."""
    removed = 0
    try:
        entries = list(os.scandir(root))
    except OSError:  # no cache yet, or unreadable: nothing to sweep here
        return 0
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue
        if not _TEMPORARY.fullmatch(entry.name):
            if depth > 1:
                removed += sweep(Path(entry.path), depth - 1)
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live writer holds it
            os.close(fd)
            continue
        try:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed += not os.path.exists(entry.path)
        finally:
            os.close(fd)
    return removed
