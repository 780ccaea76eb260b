"""One hybridpd operation at a time on a checkout, and recovery from one that was killed.

Invariants:

* :func:`operation` holds an exclusive ``flock`` on ``<git dir>/hybridpd.lock`` for
  the whole operation. A second hybridpd on the same checkout fails at once with one
  line naming the operation and pid that hold it. The kernel drops a ``flock`` when
  its holder dies, even by SIGKILL, so the lock is never stale.
* An operation that changes the checkout writes a journal
  (``<git dir>/hybridpd-journal.json``: operation, pid, HEAD, the git lock files
  present) before its first change, and removes it once the checkout is final,
  after success or after its own restore. Before each patch it records the paths
  that patch may touch with the contents it may leave in them (:func:`expect`: the
  blob before and after, in the index and the work tree), and when it stops with a
  patch half applied, the contents as left (:func:`settle`). A journal that the
  next caller finds (it holds the lock, so the journal's writer is dead) means that
  operation was killed: :func:`recover` first proves the checkout is still as the
  dead operation left it (HEAD is the journal's or descends from it through
  hybridpd's own commits only; every changed path is one the patch in flight may
  touch, with a content it may leave). Then it puts HEAD, index and work tree back
  at the journal's HEAD, removes the git lock files the dead operation left (never
  one that was there before it), and aborts the ``git am`` session, which the dead
  operation started (it refuses to start beside one). Otherwise it changes nothing
  and refuses with one line: what was interrupted, what changed since, and the
  commands that finish by hand (the reflog is named, never relied on).
* Without a journal, git state that is not hybridpd's (a ``git am`` session, any git
  lock file: ``index.lock``, ``HEAD.lock``, a ref's) is refused up front, before any
  journal or am session exists, with one line that says what to do: wait for the git
  process that holds it, or remove a lock no live process writes
  (:func:`hybridpd.gitlocks.writer`). hybridpd never aborts a ``git am`` it did not
  start, and recovery never removes a lock a live git process may be writing.
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

from hybridpd import gitlocks, gitops, proc
from hybridpd.errors import HybridpdError

LOCK = "hybridpd.lock"
JOURNAL = "hybridpd-journal.json"
FAULT_ENV = "HYBRIDPD_FAULT"
#: A stopped `hybridpd port` keeps its git am session on purpose; its state file says so.
PORT_STATE = "hybridpd-port.json"

# The git dirs whose lock this process holds (a flock is per open file: taking it
# twice in one process would fail against itself).
_HELD: set[str] = set()
# The journal each git dir's running operation keeps (see :func:`journal`).
_JOURNALS: dict[str, dict] = {}


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
        fault(f"write:{path.name}")  # killed with the temporary file written, not renamed
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def temporary_of(path: Path) -> Path:
    """The temporary file :func:`write_atomic` writes ``path`` through (one per process,
    so two writers never share one); a SIGKILL may leave it behind."""
    return path.with_name(f".{path.name}.{os.getpid()}.hybridpd-tmp")


def remove_temporaries(path: Path) -> list[Path]:
    """Remove the temporary files of ``path`` (:func:`temporary_of`) that processes
    which are gone left (a writer killed mid-write); a live writer's is kept. The
    removed ones."""
    removed = []
    for tmp in path.parent.glob(f".{path.name}.*.hybridpd-tmp"):
        pid = tmp.name[len(path.name) + 2 : -len(".hybridpd-tmp")]
        if pid.isdigit() and proc.identity(int(pid)) is None:
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


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


def recover(repo: Path, own: bool = False) -> str | None:
    """Undo the operation recorded in the journal; a line saying so, or None.

    Call with the lock held (so the journal's writer is not running). Without a
    journal, foreign interrupted state is refused (:class:`InterruptedStateError`).
    A killed operation is undone only while the checkout is as it left it (see the
    module docstring; ``own``: the caller is that operation, restoring after its own
    failure). The journal is removed only once the checkout is back at its HEAD.
    """
    gdir = git_dir(repo)
    path = gdir / JOURNAL
    if not path.is_file():
        _refuse_foreign_state(repo, gdir)
        return None
    data = _read_journal(repo, path)
    left = sorted(_git_locks(gdir) - set(data["locks"]))
    writer = gitlocks.writer(repo, [gdir / lock for lock in left]) if left else None
    if writer is not None:
        # A lock made since the journal, but a live git may be writing it: not the
        # dead operation's to remove.
        raise InterruptedStateError(
            f"{', '.join(str(gdir / lock) for lock in left)}: a git process (pid {writer}) "
            f"is running on {repo}; nothing was done: run again when it ends"
        )
    if not own:
        changes = _changed_since(repo, data)
        if changes:
            raise InterruptedStateError(_finish_by_hand(repo, gdir, data, changes, left))
    for lock in left:
        (gdir / lock).unlink(missing_ok=True)
    if (gdir / "rebase-apply").is_dir():  # started by the journal's operation
        gitops.am_abort(repo)
    gitops.reset_hard(repo, data["head"])
    path.unlink()
    _JOURNALS.pop(str(gdir.resolve()), None)
    return (
        f"{repo}: recovered from an interrupted `hybridpd {data['operation']}` "
        f"(pid {data['pid']}): HEAD, index and work tree restored to {data['head'][:12]}"
    )


def interrupted(repo: Path) -> str | None:
    """What a killed operation left on ``repo`` (a line), or None: no journal, or its
    operation still runs (it holds the lock). Reads only."""
    gdir = git_dir(repo)
    path = gdir / JOURNAL
    if not path.is_file() or _held(gdir / LOCK):
        return None  # none, or its operation is running
    try:
        data = _read_journal(repo, path)
    except FileNotFoundError:
        return None  # the operation ended, or the next one recovered it, meanwhile
    except InterruptedStateError as exc:
        return exc.message
    if _held(gdir / LOCK):  # an operation started meanwhile: its journal, not a dead one's
        return None
    return (
        f"a killed `hybridpd {data['operation']}` (pid {data['pid']}) left this checkout "
        "mid-operation; the next apply, export or build on it recovers it first, or says "
        "in one line what to do"
    )


def _held(lock: Path) -> bool:
    """Whether a process holds a ``flock`` on ``lock``, read from ``/proc/locks`` (taking
    even a shared lock to find out would make a starting operation fail as busy)."""
    try:
        st = os.stat(lock)
        text = Path("/proc/locks").read_text()
    except OSError:
        return False
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return any(
        fields[1] == "FLOCK" and fields[-3] == dev
        for line in text.splitlines()
        if len(fields := line.split()) >= 8
    )


def _read_journal(repo: Path, path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        if not _well_formed(data):
            raise ValueError
    except (ValueError, UnicodeDecodeError):
        raise InterruptedStateError(
            f"{path} is not a hybridpd journal (corrupt); nothing was done. If no hybridpd "
            f"is running on {repo}, inspect `git -C {repo} status`, then `rm {path}` and "
            "run again"
        ) from None
    return data


def _well_formed(data: object) -> bool:
    """Whether ``data`` has the shape :func:`journal`, :func:`expect` and :func:`settle`
    write, in every part that recovery reads."""
    if not isinstance(data, dict) or not all(
        isinstance(data.get(key), kind)
        for key, kind in (("operation", str), ("pid", int), ("head", str), ("locks", list))
    ):
        return False
    touching = data.get("touching", {})
    return (
        all(isinstance(lock, str) for lock in data["locks"])
        and isinstance(touching, dict)
        and all(
            isinstance(contents, dict)
            and all(
                isinstance(contents.get(kind), list)
                and all(blob is None or isinstance(blob, str) for blob in contents[kind])
                for kind in ("work", "index")
            )
            for contents in touching.values()
        )
    )


def _changed_since(repo: Path, data: dict) -> list[str]:
    """What differs from the state the journal's operation can have left (empty: none)."""
    head = gitops.head(repo)
    if not gitops.made_here(repo, data["head"], head):
        return [f"HEAD moved to {head[:12]}"]
    touching: dict = data.get("touching", {})
    changed = gitops.changed_paths(repo)
    # An untracked file the reset cannot reach (no such path in the journal's HEAD) is
    # left alone by it: not a reason to refuse.
    untracked = [p for p in gitops.untracked_files(repo) if p not in touching]
    safe = set(untracked) - gitops.tracked_at(repo, data["head"], untracked)
    changed = [p for p in changed if p not in safe]
    known = [p for p in changed if p in touching]
    work = gitops.work_tree_blobs(repo, known)
    index = gitops.index_entries(repo, known)
    return [
        f"{p} changed"
        for p in changed
        if p not in touching
        or not _admissible(work[p], touching[p]["work"])
        or not _admissible(" ".join(index[p]) or None, touching[p]["index"])
    ]


def _admissible(found: str | None, allowed: list) -> bool:
    """Whether ``found`` (a blob id, or index entries "<blob> <stage> ...", or None for
    none) is one of ``allowed``; a patch's index line may abbreviate its blob ids."""

    def same(want: str | None) -> bool:
        if found is None or want is None:
            return found == want
        have, wanted = found.split(" "), want.split(" ")
        return len(have) == len(wanted) and all(
            h.startswith(w) if i % 2 == 0 else h == w
            for i, (h, w) in enumerate(zip(have, wanted))
        )

    return any(same(want) for want in allowed)


def _finish_by_hand(repo: Path, gdir: Path, data: dict, changes: list[str], left: list) -> str:
    commands = [f"rm {gdir / lock}" for lock in left]  # git refuses to run beside them
    if (gdir / "rebase-apply").is_dir():
        commands.append(f"git -C {repo} am --quit")  # keeps HEAD, index and work tree
    commands.append(f"rm {gdir / JOURNAL}")
    return (
        f"{repo}: found an interrupted `hybridpd {data['operation']}` (pid {data['pid']}), "
        f"but {', '.join(changes)} since, so nothing was done; to finish by hand, keep "
        f"your work and run {'; '.join(commands)}; HEAD before that run was "
        f"{data['head'][:12]} (`git -C {repo} reflog` lists every step since)"
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
        "index": gitops.run(repo, "write-tree").stdout.strip() or None,  # for the record
        "locks": sorted(_git_locks(gdir)),
        "touching": {},
    }
    key = str(gdir.resolve())
    _JOURNALS[key] = data
    write_atomic(path, json.dumps(data, indent=2) + "\n")
    try:
        yield
    finally:
        _JOURNALS.pop(key, None)
    path.unlink(missing_ok=True)


def expect(repo: Path, patch: Path) -> None:
    """Record in the journal that ``patch`` is about to be applied to ``repo``: the
    paths it may touch, and the contents it may leave in them (before or after)."""
    data, path = _journal_of(repo)
    blobs = gitops.patch_blobs(patch)
    work = gitops.work_tree_blobs(repo, list(blobs))
    index = gitops.index_entries(repo, list(blobs))
    data["touching"] = {
        p: {
            "work": [before, after, work[p]],
            "index": [f"{before} 0" if before else None, f"{after} 0" if after else None,
                      " ".join(index[p]) or None],
        }
        for p, (before, after) in blobs.items()
    }
    write_atomic(path, json.dumps(data, indent=2) + "\n")


def settle(repo: Path) -> None:
    """Record in the journal the contents the patch in flight left in its paths (a
    stop on a conflict), so that a kill from here on is still recovered."""
    data, path = _journal_of(repo)
    paths = list(data["touching"])
    work = gitops.work_tree_blobs(repo, paths)
    index = gitops.index_entries(repo, paths)
    for p in paths:
        data["touching"][p]["work"].append(work[p])
        data["touching"][p]["index"].append(" ".join(index[p]) or None)
    write_atomic(path, json.dumps(data, indent=2) + "\n")


def _journal_of(repo: Path) -> tuple[dict, Path]:
    gdir = git_dir(repo)
    return _JOURNALS[str(gdir.resolve())], gdir / JOURNAL


def _git_locks(gdir: Path) -> set[str]:
    """git's lock files under ``gdir`` (relative paths), not counting hybridpd's."""
    return gitlocks.found(gdir, {LOCK})


def port_in_progress(repo: Path) -> str | None:
    """A line saying that ``repo`` holds a `hybridpd port` under way (its state file,
    :data:`PORT_STATE`), and how to end it; None when it holds none."""
    try:
        path = git_dir(repo) / PORT_STATE
        data = json.loads(path.read_text(encoding="utf-8"))
    except (HybridpdError, OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    what = (f"from {data['from_version']} to {data['to_version']} "
            if isinstance(data.get("from_version"), str) and isinstance(data.get("to_version"), str)
            else "")
    return (f"{repo} holds a `hybridpd port` {what}in progress: `hybridpd port --continue "
            f"--dir {repo}` (or --skip --upstream RELEASE, or --abort) ends it, then status "
            "and apply work on the checkout")


def _refuse_foreign_state(repo: Path, gdir: Path) -> None:
    if (gdir / "rebase-apply").is_dir() and not (gdir / PORT_STATE).is_file():
        raise InterruptedStateError(
            f"{repo} is in the middle of a `git am` that hybridpd did not start: finish it "
            f"(git -C {repo} am --continue) or abort it (git -C {repo} am --abort), then run again"
        )
    locks = [gdir / lock for lock in sorted(_git_locks(gdir))]
    if not locks:
        return
    # Refused before any journal or git am session exists: git would fail on the lock
    # midway, and a journal written beside it would make a later recovery blame (and
    # clean up after) a hybridpd run that never touched it.
    names = ", ".join(str(lock) for lock in locks)
    writer = gitlocks.writer(repo, locks)
    if writer is not None:
        raise InterruptedStateError(
            f"{names}: a git process (pid {writer}) is running on {repo}; nothing was done: "
            "run again when it ends"
        )
    raise InterruptedStateError(
        f"{names}: no git process is running on {repo}, so a git command that was killed or "
        f"crashed left it; nothing was done: remove it (rm {' '.join(str(lock) for lock in locks)}) "
        "and run again"
    )
