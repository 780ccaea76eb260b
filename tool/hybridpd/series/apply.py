"""Apply the patch series to a checkout, and report where a checkout stands.

A checkout's pin is the pinned release whose tag is the nearest first-parent ancestor
of HEAD. Every commit after that tag is one applied patch and carries the trailer
``Hybridpd-Patch: <id>``; that trailer, not the subject or the file name, is how a
patch is recognized. Applied patches form an in-order subsequence of the pin's carried
patches; the carried patches they skip are ones whose change the tree already has.

:func:`apply` is atomic (on failure, Ctrl-C, SIGTERM or SIGHUP the checkout is exactly
as it was; after SIGKILL the next hybridpd operation on it restores it while nothing
changed since, and otherwise says in one line how to finish by hand, see
:mod:`hybridpd.guard`), idempotent (a fully applied checkout is left untouched), and
exclusive (one hybridpd operation per checkout at a time).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridpd import gitops, guard
from hybridpd.errors import (
    ApplyError,
    DirtyTreeError,
    GitError,
    PatchCommitError,
    UnknownPinError,
)
from hybridpd.series.model import Patch, Pin, Series
from hybridpd.series.source import proposed_for

TRAILER = "Hybridpd-Patch"
_SHOWN_DIRTY = 5


@dataclass(frozen=True)
class ApplyResult:
    """What :func:`apply` did on ``pin``.

    ``applied``: patches applied by this call; ``already``: applied before it;
    ``upstream``: carried patches skipped because the tree already has their change.
    ``recovered``: set when this call first undid an earlier apply that was killed.
    """

    pin: str
    applied: tuple[str, ...]
    already: tuple[str, ...]
    upstream: tuple[str, ...]
    recovered: str | None = None  # a killed earlier operation this call undid first

    def to_json(self) -> dict[str, Any]:
        return _to_json(self)


@dataclass(frozen=True)
class Status:
    """Where a checkout stands against the series (the ``status --json`` contract).

    ``upstream`` lists the records in state upstream for the pin, then carried
    patches whose change the tree already has (detected by reverse-applying them).
    """

    pin: str
    applied: tuple[str, ...]
    pending: tuple[str, ...]
    upstream: tuple[str, ...]
    #: What a killed operation left on the checkout (a line), or None.
    interrupted: str | None = None

    def to_json(self) -> dict[str, Any]:
        return _to_json(self)


def _to_json(result: ApplyResult | Status) -> dict[str, Any]:
    """Every field in order, tuples as lists (the ``apply``/``status --json`` contracts)."""
    return {
        f.name: list(value) if isinstance(value := getattr(result, f.name), tuple) else value
        for f in fields(result)
    }


@dataclass(frozen=True)
class _Plan:
    """The carried patches of a checkout, split by what has happened to them."""

    applied: list[str]
    skipped: list[str]  # before the last applied one, not applied
    remaining: list[Patch]  # after the last applied one


def checkout_pin(series: Series, repo: Path) -> Pin:
    """The pin ``repo`` was checked out at (see the module docstring)."""
    if not repo.is_dir() or not gitops.is_repo(repo):
        raise UnknownPinError(f"{repo} is not a git checkout (see hybridpd checkout)")
    if gitops.resolve(repo, "HEAD") is None:
        raise UnknownPinError(f"{repo} is a git repository without commits (see hybridpd checkout)")
    tags = gitops.tag_commits(repo)
    pins_by_commit = {tags[pin.tag]: pin for pin in series.pins if pin.tag in tags}
    for sha in gitops.first_parent_history(repo):
        if sha in pins_by_commit:
            return pins_by_commit[sha]
    known = ", ".join(pin.tag for pin in series.pins)
    raise UnknownPinError(f"{repo}: HEAD does not descend from a pinned release tag ({known})")


def patch_commits(repo: Path, pin: Pin) -> list[tuple[str, gitops.Commit]]:
    """The commits after ``pin``'s tag, oldest first, each with its patch id.

    Raises PatchCommitError for a commit without exactly one ``Hybridpd-Patch``
    trailer: the series cannot say what it is.
    """
    result = []
    for commit in gitops.commits(repo, f"{pin.tag}..HEAD"):
        ids = commit.trailer_values(TRAILER)
        if len(ids) != 1:
            raise PatchCommitError(
                f'commit {commit.sha[:12]} "{commit.subject}" needs exactly one '
                f'"{TRAILER}: <id>" trailer (git commit --amend --trailer '
                f'"{TRAILER}: <id>", or git rebase -i for an older commit)'
            )
        result.append((ids[0], commit))
    return result


def apply(series: Series, repo: Path, pin: Pin | None = None) -> ApplyResult:
    """Apply ``repo``'s pin's carried patches that are not applied yet, in order.

    ``pin``: the pin the caller checked ``repo`` out at; None: read from its history
    (:func:`checkout_pin`).

    Refuses a dirty tree while patches remain (with none left it changes nothing and
    keeps the user's work beside the series). Each patch is ``git am --3way``'d as one commit; a patch
    whose change is already present is skipped and reported upstream. On any failure
    HEAD, index and work tree are restored and ApplyError names the patch and files.
    """
    if port := guard.port_in_progress(repo):
        raise ApplyError(port)
    pin = pin or checkout_pin(series, repo)
    if not pin.ported:
        raise ApplyError(not_ported(series, pin))
    with guard.operation(repo, "apply") as recovered:
        return _apply_locked(series, repo, pin, recovered)


def not_ported(series: Series, pin: Pin) -> str:
    """What to do about ``pin`` not being ported: port from the pin `pin add` proposes."""
    proposed = proposed_for(series, pin)
    if proposed is None:
        return f"the series is not ported to {pin.version} yet, nor to any pin to port from"
    return (f"the series is not ported to {pin.version} yet (hybridpd port --from "
            f"{proposed.version} --to {pin.version}, the pin `hybridpd pin add` proposes)")


def _apply_locked(series: Series, repo: Path, pin: Pin, recovered: str | None) -> ApplyResult:
    plan = _plan(series, repo, pin)
    changes = gitops.status(repo)
    if changes and not plan.remaining:
        # A series applied already changes nothing: the user's work beside it is no
        # reason to refuse (`install` and `build` run apply on a checkout the user
        # works in). No journal either: a restore on an interrupt would reset that work.
        # (The reverse-apply check below reads the work tree, which holds their edits.)
        return ApplyResult(pin.version, (), tuple(plan.applied), tuple(plan.skipped), recovered)
    if changes:
        shown = ", ".join(line.strip() for line in changes[:_SHOWN_DIRTY])
        more = f" and {len(changes) - _SHOWN_DIRTY} more" if len(changes) > _SHOWN_DIRTY else ""
        raise DirtyTreeError(
            f"{repo} has uncommitted changes ({shown}{more}); commit or stash them"
        )
    missing = [
        i for i in plan.skipped if not gitops.reverse_applies(repo, series.patch_path(pin, i))
    ]
    if missing:
        raise ApplyError(
            f"{repo}: {', '.join(missing)} not applied but later patches are; "
            "start from a fresh checkout"
        )
    original_head = gitops.head(repo)
    applied: list[str] = []
    upstream = list(plan.skipped)
    with guard.journal(repo, "apply"):
        try:
            for number, patch in enumerate(plan.remaining, start=1):
                guard.fault(f"apply:patch-{number}")
                guard.expect(repo, series.patch_path(pin, patch.id))
                (applied if _apply_one(series, repo, pin, patch) else upstream).append(patch.id)
            guard.fault("apply:done")
        except BaseException:
            _restore(repo, original_head, changes)
            raise
    return ApplyResult(
        pin.version, tuple(applied), tuple(plan.applied), tuple(upstream), recovered
    )


def apply_only(series: Series, repo: Path, pin: Pin, ids: Sequence[str]) -> tuple[str, ...]:
    """Apply the carried patches of ``pin`` named in ``ids`` (in series order, the others
    left out) to a clean checkout of its tag; the ids applied.

    For a build that is the release plus only what it needs to run at all (the e2e's
    stock build); ids the pin does not carry are ignored. Raises ApplyError as
    :func:`apply` does.
    """
    applied = []
    for patch in series.carried(pin):
        if patch.id in ids and _apply_one(series, repo, pin, patch):
            applied.append(patch.id)
    return tuple(applied)


def status(series: Series, repo: Path) -> Status:
    """Report applied, pending and upstream patches of ``repo`` (changes nothing)."""
    if port := guard.port_in_progress(repo):
        raise ApplyError(port)
    pin = checkout_pin(series, repo)
    plan = _plan(series, repo, pin)
    present: list[str] = []
    pending: list[str] = []
    for patch_id in [*plan.skipped, *(p.id for p in plan.remaining)]:
        path = series.patch_path(pin, patch_id)
        found = path.is_file() and gitops.reverse_applies(repo, path)
        (present if found else pending).append(patch_id)
    recorded = [p.id for p, st in series.records(pin) if st.state == "upstream"]
    return Status(pin.version, tuple(plan.applied), tuple(pending), (*recorded, *present),
                  guard.interrupted(repo))


def _plan(series: Series, repo: Path, pin: Pin) -> _Plan:
    carried = series.carried(pin)
    order = {patch.id: index for index, patch in enumerate(carried)}
    applied = [patch_id for patch_id, _ in patch_commits(repo, pin)]
    last = -1
    for patch_id in applied:
        if patch_id not in order:
            raise PatchCommitError(
                f"{repo}: applied patch {patch_id} is not carried on {pin.version} in series.toml"
            )
        if order[patch_id] <= last:
            raise PatchCommitError(
                f"{repo}: applied patch {patch_id} is out of series order (or applied twice)"
            )
        last = order[patch_id]
    skipped = [p.id for p in carried[: last + 1] if p.id not in applied]
    return _Plan(applied, skipped, carried[last + 1 :])


def _apply_one(series: Series, repo: Path, pin: Pin, patch: Patch) -> bool:
    """Apply ``patch`` as one commit with its trailer; False if already present."""
    path = series.patch_path(pin, patch.id)
    shown = series.relative(path)
    if not path.is_file():
        raise ApplyError(f"{shown}: missing (patch {patch.id} is carried on {pin.version})")
    if gitops.reverse_applies(repo, path):
        return False
    before = gitops.head(repo)
    result = gitops.am(repo, [path])
    if not result.ok:
        # A 3-way merge that ran leaves its conflicts in the index. Without the
        # preimage blobs it never starts; then name the paths plain apply rejects.
        files = (
            gitops.conflicted_files(repo)
            or gitops.rejected_files(repo, path)
            or gitops.patch_files(repo, path)
        )
        raise ApplyError(
            f"patch {patch.id} ({shown}) does not apply to {pin.version}: "
            f"conflicts in {', '.join(files)}; checkout left unchanged"
        )
    after = gitops.head(repo)
    if after == before:
        return False  # the 3-way merge found the change already present
    if gitops.resolve(repo, f"{after}~1") != before:
        raise ApplyError(f"{shown} holds more than one commit; a patch must be one commit")
    ids = gitops.commits(repo, f"{before}..{after}")[0].trailer_values(TRAILER)
    if not ids:
        gitops.amend_trailer(repo, TRAILER, patch.id)
    elif ids != [patch.id]:
        raise ApplyError(f'{shown} has trailer "{TRAILER}: {ids[0]}", expected {patch.id}')
    return True


def _restore(repo: Path, head: str, status_before: list[str]) -> None:
    """Put ``repo`` back at ``head`` (the journal's) and check the work tree is as it was."""
    guard.recover(repo, own=True)
    if gitops.head(repo) != head or gitops.status(repo) != status_before:
        raise GitError(f"{repo}: could not restore the checkout to {head[:12]}; inspect it")
