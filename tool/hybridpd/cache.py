"""The store: hybridpd's one cache, and how anything in it is written.

Location: ``$HYBRIDPD_CACHE``, else ``$XDG_CACHE_HOME/hybridpd``, else
``~/.cache/hybridpd``. Its entries: ``sdists/`` (release sources, under their index file
name), ``envs/`` (the patch tests' environments, :mod:`hybridpd.proof.testenv`), ``trees/`` and
``runs/`` (``hybridpd test``), ``e2e/`` (the e2e environments), ``bench/`` and
``installed/``.

The rules every entry follows, with the helpers here:

- one writer at a time: :func:`lock` (a second process waits, and says so);
- a directory a command creates is its own until it is complete: :func:`owned` (a
  failure removes what it made);
- an entry is reused only when its :class:`Marker`, written last and atomically,
  records the same inputs; a build killed halfway has no marker and is rebuilt;
- state files are replaced whole (:func:`hybridpd.guard.write_atomic`).

Nothing is trusted because it is cached: a source file is used only after its sha256
matches the one the caller expects, and a corrupt file is replaced by a fresh download.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hybridpd import guard, pkgindex, progress
from hybridpd.errors import ChecksumError, HybridpdError, LocalFileError
from hybridpd.progress import Log

CACHE_ENV = "HYBRIDPD_CACHE"


def cache_dir() -> Path:
    """The cache root (not created here)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "hybridpd"


@contextlib.contextmanager
def lock(path: Path, log: Log) -> Iterator[None]:
    """Be the only writer of cache entry ``path`` (lock file ``.<name>.lock`` beside it).

    A second caller waits for the first, saying so on ``log`` once. The holder removes
    the lock file when it is done; a waiter that then wakes on the removed file takes
    the lock again on a new one (it checks the inode), so two holders never overlap.
    """
    lock = path.with_name(f".{path.name}.lock")
    said = False
    while True:
        fh = open(lock, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not said:
                log(f"waiting for another hybridpd process that is writing {path}")
                said = True
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            if os.fstat(fh.fileno()).st_ino == os.stat(lock).st_ino:
                break
        except FileNotFoundError:
            pass
        fh.close()  # its holder removed it: lock the new file
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)
        fh.close()


@contextlib.contextmanager
def owned(dest: Path, not_empty: Callable[[str], HybridpdError]) -> Iterator[None]:
    """Create ``dest`` if needed and hold its lock (:func:`hybridpd.guard.directory`)
    while the caller fills it; on failure undo the creation, or empty a pre-existing
    empty directory.

    A second process on the same ``dest`` fails with one line and changes nothing; one
    that gets the lock after another process filled ``dest`` raises ``not_empty``.
    """
    created = next((p for p in reversed((dest, *dest.parents)) if not p.exists()), None)
    dest.mkdir(parents=True, exist_ok=True)
    with guard.directory(dest):
        if any(dest.iterdir()):  # another process filled it before we got the lock
            raise not_empty(f"{dest} already exists and is not an empty directory")
        try:
            yield
        except BaseException:
            if created is not None:
                shutil.rmtree(created, ignore_errors=True)
            else:
                empty(dest)
            raise


def empty(directory: Path) -> None:
    """Remove what ``directory`` holds, keeping the directory."""
    for child in directory.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


@dataclass(frozen=True)
class Marker:
    """The completion marker of a cache entry: a JSON object written after everything
    else, atomically. An entry without one is incomplete; callers reuse an entry only
    when its marker records the inputs they would build it from."""

    path: Path

    def read(self) -> dict | None:
        """The recorded object; None when there is none (or it is unreadable)."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def write(self, data: dict) -> None:
        guard.write_atomic(self.path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def file_sha256(path: Path) -> str:
    """Hex sha256 of the file at ``path``."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sdist(package: str, filename: str, sha256: str) -> Path:
    """Path of a verified copy of ``filename``, downloading it if needed.

    The returned file's sha256 is ``sha256``. It is looked up on the indexes pip is
    configured for (see :mod:`hybridpd.pkgindex`) when the cache has no good copy.
    """
    path = cache_dir() / "sdists" / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    with lock(path, progress.say):
        return _verified_or_downloaded(package, path, filename, sha256)


def sdist_listed(package: str, found: pkgindex.IndexFile,
                 settings: pkgindex.PipSettings) -> tuple[Path, str]:
    """``found`` (an index entry) in the sdist cache, and its sha256: verified against
    the index's hash where it lists one, else the hash of the bytes downloaded (or of
    the copy the cache already has), which the caller records."""
    if found.sha256 is not None:
        if not pkgindex.is_sha256(found.sha256):
            raise ChecksumError(
                f"the index lists {found.filename} with sha256 {found.sha256!r}, which is not "
                "a sha256 (64 hex digits): the index's page is wrong"
            )
        sha256 = found.sha256.lower()
        path = cache_dir() / "sdists" / found.filename
        path.parent.mkdir(parents=True, exist_ok=True)
        with lock(path, progress.say):
            return _verified_or_downloaded(package, path, found.filename, sha256,
                                           "the index"), sha256
    path = cache_dir() / "sdists" / found.filename
    path.parent.mkdir(parents=True, exist_ok=True)
    with lock(path, progress.say):
        if path.is_file():
            return path, file_sha256(path)
        return path, pkgindex.download(found.url, path, None, settings)


def _verified_or_downloaded(package: str, path: Path, filename: str, sha256: str,
                            expected_by: str = "series.toml") -> Path:
    if path.exists() and not path.is_file():
        raise LocalFileError(f"cache entry {path} is not a file; remove it and run again")
    if path.is_file():
        actual = file_sha256(path)
        if actual == sha256:
            return path
        progress.say(f"cached {path} has sha256 {actual}, expected {sha256}; re-downloading")
        path.unlink()
    settings = pkgindex.pip_settings()
    found = pkgindex.find_file(package, filename, settings)
    # Fail before a long download when the index already tells us the hash is wrong.
    if found.sha256 is not None and found.sha256 != sha256:
        raise ChecksumError(
            f"{filename} on the index has sha256 {found.sha256}, {expected_by} expects {sha256}"
        )
    pkgindex.download(found.url, path, sha256, settings, expected_by)
    return path
