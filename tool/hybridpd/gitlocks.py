"""git's lock files in a repository, and whether a live process may still be writing one.

Project agnostic: it knows git directories and /proc, not hybridpd's operations.

Invariants:

* :func:`found` lists every lock file git may leave in a git directory (``index.lock``,
  ``HEAD.lock``, ``packed-refs.lock``, ``config.lock``, ``refs/**/*.lock``...), minus the
  names the caller says are its own.
* :func:`writer` names a live process that may be writing ``repo``'s locks: one that
  holds a lock file open (git keeps a lock's descriptor open while it writes it), or a
  ``git`` whose working directory is inside ``repo`` (git closes a ref lock before it
  renames it). None means no process on this machine is doing either: the lock was left
  by a git that was killed or crashed. A lock is never removed here; callers remove
  only one they can prove is theirs.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path


def found(gdir: Path, own: Collection[str] = ()) -> set[str]:
    """git's lock files under ``gdir``, relative to it, except those in ``own`` (paths
    relative to ``gdir``: a branch may share a name with the caller's lock)."""
    locks = set()
    for pattern in ("*.lock", "refs/**/*.lock"):
        for path in gdir.glob(pattern):
            name = str(path.relative_to(gdir))
            if name not in own:
                locks.add(name)
    return locks


def writer(repo: Path, locks: list[Path]) -> int | None:
    """The pid of a live process (not this one) that holds one of ``locks`` open or runs
    ``git`` inside ``repo``; None when there is none (as far as /proc shows)."""
    wanted = {str(p.absolute()) for p in locks}
    top = str(repo.resolve())
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            if _is_git(entry) and _inside(os.readlink(entry / "cwd"), top):
                return int(entry.name)
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in wanted:
                    return int(entry.name)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return None


def _is_git(entry: Path) -> bool:
    return (entry / "comm").read_text().strip() == "git"


def _inside(path: str, top: str) -> bool:
    return path == top or path.startswith(top + os.sep)
