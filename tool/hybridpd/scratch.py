"""Temporary trees (a fresh checkout for ``check``, the stock tree of ``export-pr``, a
port's staging and base trees: 100-200 MB each) in the cache, where the next run
removes what a killed one left.

Invariants:

* A tree is ``<cache>/tmp/<prefix><pid>-<random>/``, created empty by :func:`tree`
  and removed when its block ends, by an exception or a signal (hybridpd turns SIGTERM
  and SIGHUP into KeyboardInterrupt) included.
* Its process holds an exclusive ``flock`` on the tree's lock file
  (``<tree>.lock``, beside it) for the tree's whole life; the kernel drops it when the
  process dies, even by SIGKILL. A tree whose lock nobody holds is a dead process's:
  every :func:`tree` first removes those (:func:`sweep`), and never a live one's.
* Creating a tree and sweeping happen under ``<cache>/tmp/.lock``, so a sweep never
  sees a tree between its creation and its lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hybridpd import cache

_LOCK_SUFFIX = ".lock"


def root() -> Path:
    return cache.cache_dir() / "tmp"


@contextlib.contextmanager
def tree(prefix: str) -> Iterator[Path]:
    """An empty temporary directory, removed when the block ends (see the module)."""
    base = root()
    base.mkdir(parents=True, exist_ok=True)
    with _exclusive(base / ".lock"):
        sweep(base)
        path = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=base))
        lock = os.open(path.with_name(path.name + _LOCK_SUFFIX), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        path.with_name(path.name + _LOCK_SUFFIX).unlink(missing_ok=True)
        os.close(lock)


def sweep(base: Path | None = None) -> list[Path]:
    """Remove the trees of processes that are gone; the removed ones. Call with
    ``<base>/.lock`` held (:func:`tree` does)."""
    base = base or root()
    removed = []
    for lock_file in sorted(base.glob(f"*{_LOCK_SUFFIX}")):
        if lock_file.name == ".lock":
            continue
        fd = os.open(lock_file, os.O_RDWR)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its process is alive
            dead = lock_file.with_name(lock_file.name[: -len(_LOCK_SUFFIX)])
            shutil.rmtree(dead, ignore_errors=True)
            lock_file.unlink(missing_ok=True)
            removed.append(dead)
        finally:
            os.close(fd)
    # A process killed between creating its tree and its lock (under the tmp lock,
    # so not a live one's): a tree without a lock file.
    for path in base.iterdir():
        if path.is_dir() and not path.with_name(path.name + _LOCK_SUFFIX).exists():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
