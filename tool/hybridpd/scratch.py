"""Temporary trees (a fresh checkout for ``check``, the stock tree of ``export-pr``, a
port's staging and base trees: 100-200 MB each) in the cache, where the next run
removes what a killed one left.

Invariants:

* A tree is ``<cache>/tmp/<prefix><pid>-<random>/``, created empty by :func:`tree`
  and removed when its block ends, by an exception or a signal (hybridpd turns SIGTERM
  and SIGHUP into KeyboardInterrupt) included.
* Its process holds an exclusive ``flock`` on the tree directory itself
  (:func:`hybridpd.guard.flocked`) for the tree's whole life; the kernel drops it when
  the process dies, even by SIGKILL. A tree nobody holds is a dead process's: every
  :func:`tree` first removes those (:func:`sweep`), and never a live one's.
* Creating a tree and sweeping happen under the cache lock of ``<cache>/tmp``
  (:func:`hybridpd.cache.lock`), so a sweep never sees a tree between its creation and
  its lock.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hybridpd import cache, guard, progress
from hybridpd.errors import HybridpdError


class _Held(HybridpdError):
    """A tree whose process is alive (never shown to the user)."""


def root() -> Path:
    return cache.cache_dir() / "tmp"


@contextlib.contextmanager
def tree(prefix: str) -> Iterator[Path]:
    """An empty temporary directory, removed when the block ends (see the module)."""
    base = root()
    base.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as held:
        with cache.lock(base, progress.quiet):
            sweep(base)
            path = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=base))
            held.enter_context(guard.flocked(path, _Held(str(path)), os.O_DIRECTORY))
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)


def sweep(base: Path | None = None) -> list[Path]:
    """Remove the trees of processes that are gone; the removed ones. Call under the
    cache lock of ``base`` (:func:`tree` does)."""
    removed = []
    for path in sorted((base or root()).iterdir()):
        if not path.is_dir() or path.is_symlink():
            continue
        try:
            with guard.flocked(path, _Held(str(path)), os.O_DIRECTORY):
                shutil.rmtree(path, ignore_errors=True)
        except _Held:
            continue  # its process is alive
        except FileNotFoundError:
            continue  # its process removed it meanwhile (it does so without the lock)
        removed.append(path)
    return removed
