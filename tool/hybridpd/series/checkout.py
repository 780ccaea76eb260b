"""Create a git checkout of a pinned vLLM release, ready for the patch series.

A checkout is a git work tree on branch ``hybridpd`` whose pinned release commit is
tagged with the pin's tag (``v<version>``); :mod:`hybridpd.series.apply` finds the pin from
that tag. It comes from one of two sources:

* ``sdist``: the release's source distribution from the package index, verified
  against the sha256 in ``series.toml`` and committed as a single commit with a fixed
  identity and date, so every machine gets the same commit hash. ``PKG-INFO`` and the
  ``*.egg-info`` directory are kept: building from the tree needs them.
* ``git``: a shallow clone of the release tag from the upstream repository.

``auto`` tries git and falls back to the sdist. Either way a failed checkout leaves
nothing behind: a directory it created is removed, a pre-existing empty one is
emptied again.
"""

from __future__ import annotations

import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from hybridpd import cache, gitops, guard, progress
from hybridpd.errors import CheckoutError, HybridpdError
from hybridpd.series.model import Pin, Series

Source = Literal["auto", "sdist", "git"]
SOURCES: tuple[Source, ...] = ("auto", "sdist", "git")
BRANCH = "hybridpd"
# Build and test by-products; everything shipped in the release is tracked.
EXCLUDES = ("__pycache__/", "*.pyc", ".pytest_cache/")


@dataclass(frozen=True)
class CheckoutResult:
    """A finished checkout; ``fallback`` says why git was not used (``auto`` only)."""

    pin: Pin
    dest: Path
    source: Literal["sdist", "git"]
    head: str
    fallback: str | None = None


def checkout(
    series: Series,
    pin: Pin,
    dest: Path,
    source: Source = "auto",
    git_url: str | None = None,
) -> CheckoutResult:
    """Check out ``pin`` into ``dest`` (which must not exist, or be empty)."""
    dest = dest.absolute()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        if dest.is_dir() and _unfinished(dest, pin):
            # Busy (a live checkout is filling it) unless its writer is gone.
            with guard.directory(dest):
                if _unfinished(dest, pin):
                    raise CheckoutError(
                        f"{dest} holds a checkout of {pin.version} that did not finish (a "
                        f"killed `hybridpd checkout`?); nothing was changed: if nothing in "
                        f"it is yours, remove it (rm -rf {dest}) and run again"
                    )
        raise CheckoutError(f"{dest} already exists and is not an empty directory")
    url = git_url or series.upstream_git
    with cache.owned(dest, CheckoutError):
        if source == "sdist":
            _from_sdist(series, pin, dest)
            return _finish(pin, dest, "sdist")
        try:
            _from_git(url, pin, dest)
            return _finish(pin, dest, "git")
        except HybridpdError as exc:
            if source == "git":
                raise
            reason = f"git clone of {pin.tag} from {url} failed ({exc.message})"
            progress.say(f"{reason}; using the sdist instead")
            cache.empty(dest)
            _from_sdist(series, pin, dest)
            return _finish(pin, dest, "sdist", fallback=reason)


def _unfinished(dest: Path, pin: Pin) -> bool:
    """Whether ``dest`` is a checkout of ``pin`` cut short: extracted or committed, but
    not yet tagged (the tag is the last step of both sources)."""
    if not (dest / ".git").exists():
        return (dest / "PKG-INFO").is_file()  # an extracted sdist, not yet a repository
    return gitops.is_repo(dest) and pin.tag not in gitops.tag_commits(dest)


def _from_sdist(series: Series, pin: Pin, dest: Path) -> None:
    archive = cache.sdist(series.package, pin.sdist, pin.sha256)
    extract_sdist(archive, dest)
    guard.fault("checkout:extracted")
    gitops.init(dest, BRANCH)
    gitops.commit_all(
        dest, f"{series.project} {pin.version} (sdist {pin.sdist} sha256 {pin.sha256})"
    )
    guard.fault("checkout:committed")
    gitops.tag(dest, pin.tag)


def _from_git(url: str, pin: Pin, dest: Path) -> None:
    gitops.clone(url, dest, pin.tag)
    gitops.create_branch(dest, BRANCH)


def _finish(
    pin: Pin, dest: Path, source: Literal["sdist", "git"], fallback: str | None = None
) -> CheckoutResult:
    gitops.add_excludes(dest, EXCLUDES)
    return CheckoutResult(pin, dest, source, gitops.head(dest), fallback)


def extract_sdist(archive: Path, dest: Path) -> None:
    """Extract a ``.tar.gz`` sdist into ``dest``, dropping its single top directory.

    Members that would land outside ``dest`` (absolute paths, ``..``, links out of
    the tree, device files) are refused by tarfile's ``data`` filter.
    """
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = _strip_top_directory(tar.getmembers(), archive)
            tar.extractall(dest, members=members, filter="data")
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise CheckoutError(f"cannot extract {archive.name}: {exc}") from exc


def _strip_top_directory(members: list[tarfile.TarInfo], archive: Path) -> list[tarfile.TarInfo]:
    tops = {PurePosixPath(m.name).parts[0] for m in members if PurePosixPath(m.name).parts}
    if len(tops) != 1:
        raise CheckoutError(f"{archive.name} does not have a single top-level directory")
    prefix = f"{tops.pop()}/"
    stripped = []
    for member in members:
        if not member.name.startswith(prefix):
            continue  # the top directory itself
        member.name = member.name[len(prefix) :]
        if member.islnk() and member.linkname.startswith(prefix):
            member.linkname = member.linkname[len(prefix) :]
        stripped.append(member)
    return stripped
