"""Export a checkout's patch commits as patch files, and check the committed series.

The patch files are the byte-stable output of :func:`export`: one ``<id>.patch`` per
patch commit, written by ``git format-patch`` with every config-dependent detail
pinned down (see :func:`hybridpd.gitops.format_patch`), each atomically
(:func:`hybridpd.guard.write_atomic`: a kill leaves the old file or the new one, and the
next export removes the temporary file it left). Exporting the same commits twice gives
identical bytes, and so does re-applying the files and exporting again. That makes
:func:`check` possible: a fresh checkout, apply and export must reproduce the committed
files exactly.
"""

from __future__ import annotations

import email.parser
import email.policy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion

from hybridpd import gitops, guard, scratch
from hybridpd.errors import ApplyError, ExportError
from hybridpd.progress import Log, quiet
from hybridpd.series import checkout as checkout_mod
from hybridpd.series.apply import apply, checkout_pin, patch_commits
from hybridpd.series.model import Pin, Series, release_key

#: Makes a fresh checkout of a pin at a path that does not exist yet.
FreshCheckout = Callable[[Series, Pin, Path], object]


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export` did to the pin's patch directory, by patch id.

    ``unrecorded`` lists exported patches that have no record in ``series.toml``;
    export writes their files but never edits the records. ``kept`` lists files it
    left alone: neither a record nor a commit names them (the user's own, removed
    only with ``prune``). ``dirty`` says the checkout had uncommitted changes, which
    are not exported.
    """

    pin: str
    written: tuple[str, ...]
    unchanged: tuple[str, ...]
    removed: tuple[str, ...]
    unrecorded: tuple[str, ...]
    dirty: bool
    kept: tuple[str, ...] = ()


def export(
    series: Series,
    repo: Path,
    out_dir: Path | None = None,
    prune: bool = False,
    log: Log = quiet,
) -> ExportResult:
    """Write ``repo``'s patch commits to ``out_dir`` (default: the pin's patch dir).

    Only files of patches export knows are touched: a record in ``series.toml`` or a
    commit with a ``Hybridpd-Patch`` trailer. Files of recorded patches that no longer
    have a commit are removed; a file neither names is kept unless ``prune``. Nothing
    is written (an :class:`ExportError`) when a commit has no trailer, or when a
    patch that ``series.toml`` records as carried on the pin has a file but no
    commit, unless ``prune``: exporting an unapplied checkout must not delete the
    pin's series.
    """
    with guard.operation(repo, "export") as recovered:
        if recovered:
            log(recovered)  # said before anything else can fail
        return _export_locked(series, repo, out_dir, prune)


def _export_locked(series: Series, repo: Path, out_dir: Path | None, prune: bool) -> ExportResult:
    pin = checkout_pin(series, repo)
    out_dir = out_dir or series.patch_dir(pin)
    exported: dict[str, bytes] = {}
    for patch_id, commit in patch_commits(repo, pin):
        if patch_id in exported:
            raise ExportError(
                f"patch {patch_id} is on more than one commit (second: {commit.sha[:12]})"
            )
        exported[patch_id] = gitops.format_patch(repo, commit.sha)
    stale = sorted(p.stem for p in out_dir.glob("*.patch") if p.stem not in exported)
    carried = {patch.id for patch in series.carried(pin)}
    lost = [i for i in stale if i in carried]
    if lost and not prune:
        raise ExportError(
            f"{len(lost)} patch(es) carried on {pin.version} have no commit in {repo}: "
            f"{', '.join(lost)} (not applied? `hybridpd apply --dir {repo}`); "
            "--prune removes their files"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    written, unchanged = [], []
    guard.fault("export:before-writes")
    for patch_id, content in exported.items():
        path = out_dir / f"{patch_id}.patch"
        guard.remove_temporaries(path)  # what an export killed mid-write left
        if path.is_file() and path.read_bytes() == content:
            unchanged.append(patch_id)
        else:
            guard.write_atomic(path, content)  # a kill leaves the old file or the new one
            written.append(patch_id)
    # A file that neither a record nor a commit names is the user's: only --prune.
    kept = [] if prune else [i for i in stale if series.patch(i) is None]
    removed = [i for i in stale if i not in kept]
    for patch_id in removed:
        (out_dir / f"{patch_id}.patch").unlink()
    guard.fault("export:after-writes")
    unrecorded = [i for i in exported if series.patch(i) is None]
    return ExportResult(
        pin.version,
        tuple(written),
        tuple(unchanged),
        tuple(removed),
        tuple(unrecorded),
        dirty=gitops.is_dirty(repo),
        kept=tuple(kept),
    )


@dataclass(frozen=True)
class CheckResult:
    """``hybridpd check``: the problems :func:`check` found (none: the series is in order)."""

    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"ok": self.ok, "problems": list(self.problems)}


def check(
    series: Series,
    fresh_checkout: FreshCheckout | None = None,
    round_trip: bool = True,
) -> list[str]:
    """Problems with the committed series, one line each; empty means all good.

    For every pin: each carried patch has a file, each file has a carried record, no
    upstream patch still has a file. Then, if ``round_trip`` and the pin's files are
    in order, a fresh checkout (``fresh_checkout``, by default from the sdist) is
    patched and exported, and the result must equal the committed files byte for byte.
    """
    fresh_checkout = fresh_checkout or _sdist_checkout
    problems = _stray_directories(series)
    for pin in series.pins:
        pin_problems = _file_problems(series, pin)
        if not pin_problems and round_trip and series.carried(pin):
            pin_problems = _round_trip_problems(series, pin, fresh_checkout)
        problems += pin_problems
    return problems


def _sdist_checkout(series: Series, pin: Pin, dest: Path) -> None:
    checkout_mod.checkout(series, pin, dest, source="sdist")


def _stray_directories(series: Series) -> list[str]:
    versions = {pin.version for pin in series.pins}
    return [
        f"{series.relative(d)}/: patch directory for {d.name}, which is not a pin"
        for d in sorted(series.dir.iterdir())
        if d.is_dir() and d.name not in versions and any(d.glob("*.patch"))
    ]


def _file_problems(series: Series, pin: Pin) -> list[str]:
    problems = []
    if not pin.ported and any(series.patch_dir(pin).glob("*.patch")):
        return [
            f"{series.relative(series.patch_dir(pin))}/: patch files for {pin.version}, "
            "which the series is not ported to (ported = false)"
        ]
    for patch, state in series.records(pin):
        path = series.patch_path(pin, patch.id)
        if state.state == "carried" and not path.is_file():
            problems.append(f"{series.relative(path)}: missing (carried on {pin.version})")
        if state.state == "upstream":
            problems += _release_problems(patch.id, pin, state.release)
        if state.state == "upstream" and path.exists():
            problems.append(
                f"{series.relative(path)}: patch is upstream in {pin.version} "
                f"(since {state.release}); delete the file"
            )
        if state.state == "dropped" and path.exists():
            problems.append(
                f"{series.relative(path)}: patch is dropped on {pin.version}; delete the file"
            )
    for path in sorted(series.patch_dir(pin).glob("*.patch")):
        if series.patch(path.stem) is None:
            problems.append(f"{series.relative(path)}: no record in series.toml")
        elif (author := _author(path)) != PROJECT_AUTHOR:
            problems.append(
                f"{series.relative(path)}: authored by {author!r}; committed patches carry "
                f"the project identity {PROJECT_AUTHOR!r} (export-pr sets the submitter's)"
            )
    return problems


#: The one author of every committed patch file: neutral and fixed, so `export` and
#: `check` are byte-stable on any machine. A PR's commits are authored by whoever
#: submits it (export-pr --author, or their git identity), never by this.
PROJECT_AUTHOR = f"{gitops.IDENTITY_NAME} <{gitops.IDENTITY_EMAIL}>"


def _author(path: Path) -> str | None:
    """The ``From:`` header of a patch file (git's mbox), unfolded and decoded, or None."""
    headers = email.parser.BytesHeaderParser(policy=email.policy.default).parsebytes(
        path.read_bytes()
    )
    author = headers["From"]
    return None if author is None else str(author)


def _release_problems(patch_id: str, pin: Pin, release: str | None) -> list[str]:
    """An "upstream since ``release``" record on ``pin`` that cannot be true."""
    where = f"series.toml: {patch_id} on {pin.version}"
    try:
        since = release_key(str(release))
    except InvalidVersion:
        return [f"{where}: upstream since {release!r}, which is not a release"]
    if since > release_key(pin.version):
        # The fix cannot be in a release older than the one that first shipped it: the
        # record drops a patch the pin still needs.
        return [f"{where}: upstream since {release}, a later release than the pin"]
    return []


def _round_trip_problems(series: Series, pin: Pin, fresh_checkout: FreshCheckout) -> list[str]:
    with scratch.tree("check-") as tmp:
        repo, out_dir = tmp / "src", tmp / "export"
        fresh_checkout(series, pin, repo)
        guard.fault("check:round-trip")
        try:
            result = apply(series, repo, pin)
        except ApplyError as exc:
            return [f"{pin.version}: {exc.message}"]
        problems = [
            f"{series.relative(series.patch_path(pin, i))}: already in {pin.version}; "
            "mark it upstream and delete the file"
            for i in result.upstream
        ]
        export(series, repo, out_dir)
        for patch_id in result.applied:
            committed = series.patch_path(pin, patch_id)
            if committed.read_bytes() != (out_dir / f"{patch_id}.patch").read_bytes():
                problems.append(
                    f"{series.relative(committed)}: not up to date (run hybridpd export)"
                )
        return problems
