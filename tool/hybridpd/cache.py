"""The per-user download cache.

Location: ``$HYBRIDPD_CACHE``, else ``$XDG_CACHE_HOME/hybridpd``, else
``~/.cache/hybridpd``. Source distributions live in ``sdists/`` under their index file
name. Nothing is trusted because it is cached: a file is used only after its sha256
matches the one the caller expects, and a corrupt file is replaced by a fresh download.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from hybridpd import guard, pkgindex, progress
from hybridpd.errors import ChecksumError, LocalFileError

CACHE_ENV = "HYBRIDPD_CACHE"


def cache_dir() -> Path:
    """The cache root (not created here)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "hybridpd"


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
    with guard.entry(path, progress.say):
        return _verified_or_downloaded(package, path, filename, sha256)


def _verified_or_downloaded(package: str, path: Path, filename: str, sha256: str) -> Path:
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
            f"{filename} on the index has sha256 {found.sha256}, series.toml expects {sha256}"
        )
    pkgindex.download(found.url, path, sha256, settings)
    return path
