"""One hybridpd operation at a time on a checkout, and recovery from one that was killed.

Invariants:

* :func:`operation` holds an exclusive ``flock`` on ``<git dir>/hybridpd.lock`` for
  the whole operation. A second hybridpd on the same checkout fails at once with one
  line naming the operation and pid that hold it. The kernel drops a ``flock`` when
  its holder dies, even by SIGKILL, so the lock is never stale.
* An operation that changes the checkout writes a journal
  (``<git dir>/hybridpd-journal.json``: operation, pid, HEAD, the git lock files
  present) before its first change, and removes it once the checkout is final,
  after success or after its own restore. A journal that the next caller finds (it
  holds the lock, so the journal's writer is dead) means that operation was killed:
  :func:`recover` puts HEAD, index and work tree back at the journal's HEAD, removes
  the git lock files the dead operation left (never one that was there before it),
  and aborts the ``git am`` session, which the dead operation started (it refuses
  to start beside one).
* Without a journal, git state that is not hybridpd's (a ``git am`` session, an
  ``index.lock``) is refused with one line that says what to do; hybridpd never
  aborts a ``git am`` it did not start.
* :func:`directory` holds an exclusive ``flock`` on a directory being created (a
  checkout or a port's new tree), so two hybridpd processes never write one
  directory at once: the second fails with one line and touches nothing.
* :func:`fault` is the deterministic hook of the fault-injection tests:
  ``HYBRIDPD_FAULT=<point>`` (or ``<point>:TERM``) makes the process kill itself with
  SIGKILL (SIGTERM) when it reaches ``<point>``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from hybridpd import gitops
from hybridpd.errors import HybridpdError

LOCK = "hybridpd.lock"
JOURNAL = "hybridpd-journal.json"
FAULT_ENV = "HYBRIDPD_FAULT"
#: A stopped `hybridpd port` keeps its git am session on purpose; its state file says so.
PORT_STATE = "hybridpd-port.json"

# The git dirs whose lock this process holds (a flock is per open file: taking it
# twice in one process would fail against itself).
_HELD: set[str] = set()


class BusyError(HybridpdError):
    """Another hybridpd operation holds the checkout."""


class InterruptedStateError(HybridpdError):
    """The checkout is in the middle of a git operation that is not hybridpd's."""


def git_dir(repo: Path) -> Path:
    return gitops.git_dir(repo)


def fault(point: str) -> None:
    """Kill this process at ``point`` if ``$HYBRIDPD_FAULT`` names it (tests only)."""
    wanted = os.environ.get(FAULT_ENV)
    if not wanted:
        return
    name, sig = wanted, signal.SIGKILL
    if wanted.endswith(":TERM"):
        name, sig = wanted.removesuffix(":TERM"), signal.SIGTERM
    if name == point:
        os.kill(os.getpid(), sig)


@contextlib.contextmanager
def operation(repo: Path, name: str) -> Iterator[str | None]:
    """Hold ``repo``'s hybridpd lock for ``name``; recover a killed operation first.

    Yields what :func:`recover` did (a line for the user), or None.
    """
    gdir = git_dir(repo)
    key = str(gdir.resolve())
    if key in _HELD:  # an operation inside another one (port's export): already ours
        yield None
        return
    fh = open(gdir / LOCK, "a+")
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fh)
            raise BusyError(
                f"{repo} is busy: {holder} is running on it; run again when it ends"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"hybridpd {name} (pid {os.getpid()})\n")
        fh.flush()
        _HELD.add(key)
        yield recover(repo)
    finally:
        _HELD.discard(key)
        fh.close()  # releases the flock


@contextlib.contextmanager
def directory(dest: Path) -> Iterator[None]:
    """Hold ``dest``'s own lock (a ``flock`` on the directory) while it is filled.

    Re-entrant within a process (port's checkout runs inside port's). Fails at once
    with :class:`BusyError` when another process holds it.
    """
    key = f"dir:{dest.resolve()}"
    if key in _HELD:
        yield
        return
    busy = f"{dest} is busy: another hybridpd process is writing it; run again when it ends"
    with flocked(dest, BusyError(busy), os.O_DIRECTORY) as fd:
        if not dest.is_dir() or os.fstat(fd).st_ino != os.stat(dest).st_ino:
            # Removed (a failed writer cleaned up) and perhaps made again since we
            # opened it: the lock we hold is on a directory that is gone.
            raise BusyError(busy)
        _HELD.add(key)
        try:
            yield
        finally:
            _HELD.discard(key)


@contextlib.contextmanager
def flocked(path: Path, busy: HybridpdError, flags: int = 0) -> Iterator[int]:
    """An exclusive ``flock`` on ``path`` itself (opened read-only with ``flags``, so no
    lock file is left behind), held for the block; its descriptor is yielded. Raises
    ``busy`` at once when another process holds it."""
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy from None
        yield fd
    finally:
        os.close(fd)  # releases the flock


def write_atomic(path: Path, data: str | bytes, mode: int | None = None) -> None:
    """Write ``path`` so that a reader, or a process killed mid-write, sees the old file
    or the new one, never a part: a temporary file beside it (:func:`temporary_of`),
    flushed to disk, then renamed over it. ``mode``: the new file's permissions."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_of(path)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def temporary_of(path: Path) -> Path:
    """The temporary file :func:`write_atomic` writes ``path`` through (one per process,
    so two writers never share one); a SIGKILL may leave it behind."""
    return path.with_name(f".{path.name}.{os.getpid()}.hybridpd-tmp")


def _holder(fh) -> str:
    """Who holds the lock, as its holder wrote it just after taking the lock (waits a
    moment for that write: the holder may be between the two)."""
    for _ in range(20):
        fh.seek(0)
        holder = fh.read().strip()
        if holder:
            return holder
        time.sleep(0.05)
    return "another hybridpd"


def recover(repo: Path) -> str | None:
    """Undo the operation recorded in the journal; a line saying so, or None.

    Call with the lock held (so the journal's writer is not running). Without a
    journal, foreign interrupted state is refused (:class:`InterruptedStateError`).
    The journal is removed only once the checkout is back at its HEAD.
    """
    gdir = git_dir(repo)
    path = gdir / JOURNAL
    if not path.is_file():
        _refuse_foreign_state(repo, gdir)
        return None
    data = json.loads(path.read_text())
    for lock in _git_locks(gdir) - set(data["locks"]):
        (gdir / lock).unlink(missing_ok=True)
    if (gdir / "rebase-apply").is_dir():  # started by the journal's operation
        gitops.am_abort(repo)
    gitops.reset_hard(repo, data["head"])
    path.unlink()
    return (
        f"{repo}: recovered from an interrupted `hybridpd {data['operation']}` "
        f"(pid {data['pid']}): HEAD, index and work tree restored to {data['head'][:12]}"
    )


@contextlib.contextmanager
def journal(repo: Path, name: str) -> Iterator[None]:
    """Record ``repo``'s HEAD and git locks before the body changes the checkout.

    On a normal exit the journal is removed. On an exception it stays for the
    caller's restore (:func:`recover`, which removes it once the checkout is back);
    a process killed in the body leaves it for the next operation.
    """
    if gitops.am_in_progress(repo):  # recover() will abort the session: it must be ours
        raise InterruptedStateError(f"{repo}: a `git am` session is in progress")
    gdir = git_dir(repo)
    path = gdir / JOURNAL
    data = {
        "operation": name,
        "pid": os.getpid(),
        "head": gitops.head(repo),
        "locks": sorted(_git_locks(gdir)),
    }
    write_atomic(path, json.dumps(data, indent=2) + "\n")
    yield
    path.unlink(missing_ok=True)


def _git_locks(gdir: Path) -> set[str]:
    """git's lock files under ``gdir`` (relative paths), not counting hybridpd's."""
    found = set()
    for pattern in ("*.lock", "refs/**/*.lock"):
        for path in gdir.glob(pattern):
            if path.name != LOCK:
                found.add(str(path.relative_to(gdir)))
    return found


def _refuse_foreign_state(repo: Path, gdir: Path) -> None:
    if (gdir / "rebase-apply").is_dir() and not (gdir / PORT_STATE).is_file():
        raise InterruptedStateError(
            f"{repo} is in the middle of a `git am` that hybridpd did not start: finish it "
            f"(git -C {repo} am --continue) or abort it (git -C {repo} am --abort), then run again"
        )
    if (gdir / "index.lock").exists():
        raise InterruptedStateError(
            f"{gdir / 'index.lock'} exists: another git command is running on {repo}, or one "
            "crashed; if none is running, remove the file and run again"
        )
