"""Port the patch series from one pin to another, patch by patch.

A port replays the patches carried on pin ``V1`` onto a fresh checkout of pin ``V2``
with ``git am --3way``, classifies what happened to each, and, once every patch is
through, exports the resulting commits to ``patches/<V2>/`` and records each patch's
state on ``V2`` in ``series.toml``.

Each patch gets one result:

* ``clean``: applies to V2 as it is; ``3way``: needs a 3-way merge, which succeeds;
* ``resolved``: conflicted, and was resolved by hand (``--continue``);
* ``upstream``, with its evidence: ``recorded`` (series.toml already says so: the
  record is upstream on V2, or already on V1; not replayed; with ``--replace`` a
  patch V1 carries is replayed whatever V2's record says), ``reverse-applies``
  (the tree already has the change), ``empty`` (the automatic 3-way merge left
  nothing to commit) or ``manual`` (``--skip --upstream RELEASE``, the only way a
  patch that stopped the port is left out of it);
* ``dropped`` (evidence ``recorded``): the record drops the patch on V2, or on V1 and
  V2 has no state for it; not replayed, and it is dropped on V2;
* ``conflict``: the port stops there (see below).

Invariants:

* The port directory is a checkout of V2 (on branch ``hybridpd``, tag ``v<V2>``) whose
  commits after the tag are the replayed patches, each with its ``Hybridpd-Patch``
  trailer, in series order. V1's patched commits (its release commit and one commit
  per patch carried on V1) are fetched into it (under :data:`BASE_REF`) so that ``git
  am --3way`` finds the pre-image blob every V1 patch names: the release's file, or,
  for a patch that changes a file an earlier patch changed, the file as that patch left
  it. Without them a patch whose context changed could not be merged.
* While a port is under way its state lives in ``<dir>/.git/hybridpd-port.json``
  (:class:`PortState`). It is written before the first patch is replayed and after
  every patch, so any later call knows where the port stands. A stopped port is
  mid-``git am`` with conflict markers in the tree, ready to be resolved.
* A port that fails before its state is written leaves nothing behind: the directory
  it created is removed (or emptied again, if it existed empty).
* A port killed while it replays a patch (inside ``git am``, or before the result is
  saved) is undone to before that patch by the next call, which then replays it
  again: each replay runs under the checkout journal (:func:`hybridpd.guard.journal`).
  Killed while it writes ``series.toml`` and the files, ``--continue`` writes them
  again (``--abort`` would leave series.toml as far as it got). The ``git am
  --continue`` that ``--continue`` runs after a resolution is not journaled.
* ``series.toml`` and ``patches/`` are touched only at the very end, once every patch
  is through: the patch files are exported to a staging directory first, then
  series.toml is edited (validated; on failure nothing is written), then the files
  are moved into place. ``--abort`` (:mod:`hybridpd.porting.abort`) never touches them.
* A file in ``patches/<V2>/`` that neither a record nor a commit of the port names
  is the user's: a port keeps it, as ``export`` does, and reports it (``kept``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shlex
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from packaging.version import InvalidVersion

from hybridpd import cache, gitops, guard, scratch
from hybridpd.errors import ApplyError, CheckoutError, HybridpdError, UsageError
from hybridpd.porting import apinames
from hybridpd.porting import moves as moves_mod
from hybridpd.progress import Log, quiet
from hybridpd.series import apply as apply_mod
from hybridpd.series import checkout as checkout_mod
from hybridpd.series import edit as seriesedit
from hybridpd.series.apply import TRAILER, patch_commits
from hybridpd.series.export import export
from hybridpd.series.model import Pin, Series, release_key

STATE_FILE = guard.PORT_STATE
#: Left in ``.git/`` by a port that finished or was aborted: ``start`` may replace
#: such a directory (its results are in the series, or were dropped on purpose).
ENDED_FILE = "hybridpd-port-ended"
#: Written once the port's checkout exists, until its state file does: a port killed in
#: between (fetching the base) leaves only the checkout, which the next port clears.
STARTING_FILE = "hybridpd-port-starting.json"
#: Where the V1 release commit is kept in the port directory while a port runs.
BASE_REF = "refs/hybridpd/port-from"
STATE_SCHEMA = 1

Result = Literal["clean", "3way", "resolved", "upstream", "dropped", "conflict"]
Evidence = Literal["recorded", "reverse-applies", "empty", "manual"]
Action = Literal["start", "continue", "skip", "abort"]
CARRIED_RESULTS = ("clean", "3way", "resolved")


class PortError(HybridpdError):
    """A port cannot start or go on."""


@dataclass(frozen=True)
class PatchResult:
    """What happened to one patch. ``release`` is set exactly for ``upstream``;
    ``note`` says where a release that was not given came from."""

    id: str
    result: Result
    evidence: Evidence | None
    files: tuple[str, ...]
    release: str | None = None
    note: str | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "id": self.id,
            "result": self.result,
            "evidence": self.evidence,
            "files": list(self.files),
        }
        if self.release is not None:
            data["release"] = self.release
        if self.note is not None:
            data["note"] = self.note
        return data


@dataclass(frozen=True)
class ConflictFile:
    """A conflicted path; ``hunks`` are the 1-based line ranges of its conflict
    markers (``<<<<<<<`` to ``>>>>>>>``), empty when git left no markers (the file
    was deleted or renamed in V2, or the patch could not be merged at all)."""

    path: str
    hunks: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Conflict:
    """The patch a port stopped on, and where."""

    id: str
    files: tuple[ConflictFile, ...]
    merged: bool  # False: git could not even start a 3-way merge
    #: The patch's files that the target release renamed or turned into a re-export.
    moved: tuple[moves_mod.Move, ...] = ()
    #: Methods the patch calls that the source release defines and the target does not.
    missing_api: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "merged": self.merged,
            "files": [{"path": f.path, "hunks": [list(h) for h in f.hunks]} for f in self.files],
            "moved": [m.to_json() for m in self.moved],
            "missing_api": list(self.missing_api),
        }


@dataclass(frozen=True)
class PortReport:
    """Where a port stands after a call: finished (``written`` lists the files
    written, relative to the series dir's parent) or stopped on ``conflict``.
    ``kept``: patch files in TO's directory that neither a record nor a commit
    names (the user's own), left where they were. ``recovered``: the line saying
    this call first undid a killed replay (see :func:`hybridpd.guard.recover`)."""

    from_version: str
    to_version: str
    dir: Path
    patches: tuple[PatchResult, ...]
    written: tuple[str, ...] = ()
    conflict: Conflict | None = None
    kept: tuple[str, ...] = ()
    recovered: str | None = None

    @property
    def finished(self) -> bool:
        return self.conflict is None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "from": self.from_version,
            "to": self.to_version,
            "dir": str(self.dir),
            "patches": [p.to_json() for p in self.patches],
            "written": list(self.written),
        }
        if self.conflict is not None:
            data["conflict"] = self.conflict.to_json()
        if self.kept:
            data["kept"] = list(self.kept)
        if self.recovered:
            data["recovered"] = self.recovered
        return data


@dataclass
class PortState:
    """The state file: what a port is doing, so any later call can go on.

    ``plan`` is every patch id in series order; ``done`` the results so far, in the
    same order; ``current`` the patch ``git am`` stopped on and ``before`` HEAD before
    it; ``stock`` the V2 release commit; ``replace``: V2 was ported already (its
    upstream records are tried again, not copied).
    """

    from_version: str
    to_version: str
    series: str
    stock: str
    plan: list[str]
    done: list[dict[str, Any]] = field(default_factory=list)
    current: str | None = None
    before: str | None = None
    replace: bool = False
    schema: int = STATE_SCHEMA

    @staticmethod
    def path(repo: Path) -> Path:
        return repo / ".git" / STATE_FILE

    def save(self, repo: Path) -> None:
        guard.write_atomic(self.path(repo), json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, repo: Path) -> PortState:
        path = cls.path(repo)
        if not path.is_file():
            raise PortError(f"no port in progress in {repo} (no .git/{STATE_FILE})")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("schema") != STATE_SCHEMA:
                raise ValueError(f"schema {data.get('schema')!r}")
            return cls(**data)
        except (ValueError, TypeError, AttributeError) as exc:  # not JSON, or not an object
            raise PortError(f"{path}: unreadable port state ({exc})") from exc

    def results(self) -> list[PatchResult]:
        return [PatchResult(**{**d, "files": tuple(d["files"])}) for d in self.done]

    def record(self, result: PatchResult) -> None:
        self.done.append({**asdict(result), "files": list(result.files)})
        self.current = self.before = None


def default_dir(release: str) -> Path:
    """Where a port to ``release`` happens unless told otherwise (``--to`` as given, a
    leading v dropped: the request is parsed before the series is read)."""
    return cache.cache_dir() / "port" / release


# Entry points -----------------------------------------------------------------


def start(
    series: Series,
    from_version: str,
    to_version: str,
    dest: Path | None = None,
    log: Log = quiet,
    replace: bool = False,
) -> PortReport:
    """Start porting ``from_version``'s series to ``to_version`` in ``dest``.

    ``dest`` must not exist or be empty (a directory with a port under way is named
    as such). Runs until every patch is through (then finishes, see :func:`finish`)
    or one conflicts. A ``to_version`` that is already ported needs ``replace`` (and
    is never older than ``from_version``).
    """
    v1, v2 = series.pin(from_version), series.pin(to_version)
    if v1.version == v2.version:
        raise PortError(f"--from and --to are both {v1.version}")
    if not v1.ported:
        raise PortError(f"the series is not ported to {v1.version}; port from a ported pin")
    if v2.ported and _newer(v1.version, v2.version):
        # Until a port proves each change on such a pin, its series stays as committed.
        raise PortError(
            f"{v2.version} is older than {v1.version} and already ported: porting back onto "
            f"it would rewrite its committed patches ({series.relative(series.patch_dir(v2))}/); "
            "nothing was done"
        )
    if v2.ported and not replace:
        raise PortError(
            f"{v2.version} is already ported: a port onto it rewrites its committed patches "
            f"and records ({series.relative(series.patch_dir(v2))}/); pass --replace to do "
            f"that (then `hybridpd test --pin {v2.version}` proves each upstream record)"
        )
    _refuse_lost_fixes(series, v1, v2)
    dest = (dest or default_dir(v2.version)).absolute()
    other = "--dir" if dest == default_dir(v2.version).absolute() else "another --dir"
    if PortState.path(dest).is_file():
        raise PortError(
            f"a port is in progress in {dest}: use --continue, --skip --upstream RELEASE or --abort"
        )
    if (dest / ".git" / ENDED_FILE).is_file():
        # A finished or aborted port's repository: nothing of the port is pending, but
        # what the user made in it since (an abort keeps it) is never removed.
        changes = gitops.status(dest)
        if changes:
            shown = ", ".join(line.strip() for line in changes[:8])
            more = f" and {len(changes) - 8} more" if len(changes) > 8 else ""
            raise PortError(
                f"{dest} holds an ended port and changes it did not make ({shown}{more}); "
                "nothing was done: move them out of it, or pass another --dir"
            )
        log(f"replacing the ended port in {dest}")
        shutil.rmtree(dest)
    if (dest / ".git" / STARTING_FILE).is_file():
        _clear_killed_start(dest, other, log)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise PortError(f"{dest} already exists and is not empty; remove it or pass {other}")
    missing = [
        series.relative(series.patch_path(v1, p.id))
        for p in series.carried(v1)
        if not series.patch_path(v1, p.id).is_file()
    ]
    if missing:
        raise PortError(f"missing patch file(s) of {v1.version}: {', '.join(missing)}")
    with contextlib.ExitStack() as held:
        with cache.owned(dest, CheckoutError):
            log(f"checking out {v2.version} (sdist) into {dest}")
            checkout_mod.checkout(series, v2, dest, source="sdist")
            starting = dest / ".git" / STARTING_FILE
            guard.write_atomic(starting, json.dumps(
                {"from_version": v1.version, "to_version": v2.version,
                 "head": gitops.head(dest)}) + "\n")
            # The port's lock from the moment the repository exists until the run
            # ends: a `port --continue` started meanwhile is refused, never let in
            # between the state file and the first patch.
            held.enter_context(guard.operation(dest, "port"))
            log(f"fetching {v1.version}'s patched commits for 3-way merges")
            _fetch_base(series, v1, dest)
            state = PortState(
                from_version=v1.version,
                to_version=v2.version,
                series=str(series.path.resolve()),
                stock=gitops.head(dest),
                plan=[p.id for p in series.patches],
                replace=replace,
            )
            state.save(dest)
            starting.unlink()
        return _run(series, dest, state, log)


def _clear_killed_start(dest: Path, other: str, log: Log) -> None:
    """Remove the checkout a port killed before its state file left in ``dest``, if
    nothing changed in it since (HEAD, index, work tree, untracked files); else refuse,
    naming what changed. A port still starting there holds the directory: busy."""
    with guard.directory(dest):
        try:
            start = json.loads((dest / ".git" / STARTING_FILE).read_text(encoding="utf-8"))
            head = start["head"] if isinstance(start, dict) else None
        except (OSError, ValueError, KeyError):
            head = None
        changed = gitops.status(dest)
        moved = head is None or gitops.head(dest) != head
        if changed or moved:
            what = ", ".join([*(["HEAD moved"] if moved else []),
                              *(line[3:] for line in changed[:5])])
            raise PortError(
                f"{dest} holds the checkout of a port killed before its first patch, changed "
                f"since ({what}{', ...' if len(changed) > 5 else ''}); remove it, or pass {other}"
            )
        log(f"removing the checkout a killed port left in {dest} (unchanged since)")
        shutil.rmtree(dest)


def _refuse_lost_fixes(series: Series, v1: Pin, v2: Pin) -> None:
    """A patch upstream on V1 since a release later than V2 has no patch file on V1, and
    V2 does not have the fix: the port would record it upstream on V2 and so drop it."""
    lost = series.fixes_lost_on(v1.version, v2.version)
    if not lost:
        return
    carriers = [pin.version for pin in series.pins
                if pin.ported and all(series.patch(i).pins.get(pin.version) is not None
                                      and series.patch(i).pins[pin.version].state == "carried"
                                      for i in lost)]
    raise PortError(
        f"{v1.version} records {', '.join(lost)} upstream since a release later than "
        f"{v2.version}, which does not have the fix, and has no patch file to replay: "
        + (f"port from {' or '.join(carriers)}, which carries it" if carriers
           else "no ported pin carries it")
        + "; nothing was done"
    )


def resume(
    series: Series,
    dest: Path,
    action: Literal["continue", "skip"],
    upstream: str | None = None,
    log: Log = quiet,
) -> PortReport:
    """Go on with the port in ``dest`` after it stopped on a conflict.

    ``continue``: the conflicts are resolved and staged; the patch is committed as
    ``resolved``. A resolution that changes nothing is refused (as ``git am
    --continue`` refuses one), and the port stays stopped: only ``skip`` drops a
    patch. ``skip``: V2 already has the change; the patch is dropped and recorded
    upstream since ``upstream`` (evidence ``manual``). Then the port runs on.
    """
    dest = dest.absolute()
    state = _load_state(series, dest)
    with guard.operation(dest, "port") as recovered:
        if recovered:
            log(recovered)
            if state.current is not None and action == "continue":
                # Killed as it stopped on the conflict: the recovery ended the am
                # session, so the patch is replayed again (and stops again).
                state.current = state.before = None
                state.save(dest)
        report = _resume_locked(series, dest, state, action, upstream, log)
    return dataclasses.replace(report, recovered=recovered)


def _resume_locked(
    series: Series,
    dest: Path,
    state: PortState,
    action: Literal["continue", "skip"],
    upstream: str | None,
    log: Log,
) -> PortReport:
    if action == "skip":
        if not upstream:
            raise PortError("--skip needs --upstream RELEASE (the first release with the change)")
        if state.current is None:
            raise PortError(f"the port in {dest} is not stopped on a patch; nothing to skip")
        if _newer(upstream, state.to_version):
            raise PortError(
                f"--upstream {upstream} is newer than {state.to_version}, the release this "
                f"port is to: the first release with the change is {state.to_version} or older"
            )
        patch_id = state.current
        record = series.patch(patch_id)
        source = record.pins.get(state.from_version) if record is not None else None
        if source is not None and source.state == "carried" and not _newer(
            upstream, state.from_version
        ):
            # The source release needs the patch, so no release up to it has the change.
            raise PortError(
                f"--upstream {upstream} is not newer than {state.from_version}, which "
                f"carries {patch_id}: the first release with the change comes after "
                f"{state.from_version}"
            )
        files = _patch_files(series, dest, state, patch_id)
        _am(dest, "--skip", optional=True)
        _reset_to(dest, state.before)
        state.record(PatchResult(patch_id, "upstream", "manual", files, release=upstream))
        state.save(dest)
    elif state.current is not None:
        _continue_current(series, dest, state)
    return _run(series, dest, state, log)


@dataclass(frozen=True)
class PortRequest:
    """One ``hybridpd port`` call, checked: what to do, in which directory."""

    action: Action
    dir: Path
    from_version: str | None = None
    to_version: str | None = None
    upstream: str | None = None
    replace: bool = False

    @classmethod
    def parse(
        cls,
        from_version: str | None,
        to_version: str | None,
        repo: Path | None,
        go_on: bool = False,
        skip: bool = False,
        abort: bool = False,
        upstream: str | None = None,
        replace: bool = False,
    ) -> PortRequest:
        """The request the command line's options make, or a :class:`UsageError`.

        A resumed port (``--continue``, ``--skip``, ``--abort``) is checked against the
        port under way in the directory: a ``--from`` or ``--to`` given must be its own.
        """
        if sum((go_on, skip, abort)) > 1:
            raise UsageError("use only one of --continue, --skip and --abort")
        if upstream and not skip:
            raise UsageError("--upstream goes with --skip")
        if skip and not upstream:
            raise UsageError("--skip needs --upstream RELEASE (the first release with the change)")
        action: Action = "continue" if go_on else "skip" if skip else "abort" if abort else "start"
        if replace and action != "start":
            raise UsageError("--replace goes with --from and --to (it starts a port)")
        if action == "start" and not (from_version and to_version):
            raise UsageError("--from and --to are required to start a port")
        if repo is None:
            if not to_version:
                raise UsageError("--dir (or --to) is required")
            repo = default_dir(to_version.removeprefix("v"))
        if action != "start":
            started = PortState.load(repo.absolute())
            for given, actual in ((from_version, started.from_version),
                                  (to_version, started.to_version)):
                if given and given.removeprefix("v") != actual:
                    raise UsageError(
                        f"the port in {repo} is from {started.from_version} to {started.to_version}"
                    )
        return cls(action, repo, from_version, to_version, upstream, replace)


def run(series: Series, request: PortRequest, log: Log = quiet) -> PortReport:
    """Start or resume the port ``request`` names (not ``abort``: see :func:`abort`)."""
    if request.action == "start":
        assert request.from_version and request.to_version
        return start(series, request.from_version, request.to_version, request.dir, log=log,
                     replace=request.replace)
    assert request.action in ("continue", "skip")
    return resume(series, request.dir, request.action, upstream=request.upstream, log=log)


def next_steps(
    report: PortReport, series_option: Path | None = None, series: Series | None = None
) -> list[str]:
    """The commands that go on from a conflict: continue, skip, abort (with ``--series
    series_option`` where the port was started with one). The skip names the first
    release with the change where the patch's record knows one (an upstream state on
    some pin, no later than the target), else ``RELEASE``."""
    prefix = "hybridpd"
    if series_option is not None:
        prefix += f" --series {shlex.quote(str(series_option))}"
    where = shlex.quote(str(report.dir))
    release = "RELEASE"
    if series is not None and report.conflict is not None:
        release = _recorded_release(series, report.conflict.id, report.to_version) or release
    return [
        f"{prefix} port --continue --dir {where}",
        f"{prefix} port --skip --upstream {release} --dir {where}",
        f"{prefix} port --abort --dir {where}",
    ]


def source_patch(report: PortReport, series: Series) -> Path:
    """The source pin's file of the patch the port stopped on."""
    assert report.conflict is not None
    return series.patch_path(series.pin(report.from_version), report.conflict.id).resolve()


def apply_by_hand(report: PortReport, series: Series) -> list[str]:
    """For a patch git could not merge (a 3-way ``git apply`` would fail the same way):
    the command that applies the source pin's patch file hunk by hunk in the port's
    directory, leaving the hunks that do not apply in ``.rej`` files beside their files."""
    if report.conflict is None or report.conflict.merged:
        return []
    path = source_patch(report, series)
    return [f"git -C {shlex.quote(str(report.dir))} apply --reject {shlex.quote(str(path))}"]


def _recorded_release(series: Series, patch_id: str, target: str) -> str | None:
    patch = series.patch(patch_id)
    if patch is None:
        return None
    releases = []
    for state in patch.pins.values():
        if state.state != "upstream" or not state.release:
            continue
        try:
            if release_key(state.release) <= release_key(target):
                releases.append(release_key(state.release))
        except InvalidVersion:
            continue
    return str(min(releases)) if releases else None


# The replay -------------------------------------------------------------------


def _run(series: Series, dest: Path, state: PortState, log: Log) -> PortReport:
    """Replay the patches not done yet; stop on a conflict, else finish."""
    v1, v2 = series.pin(state.from_version), series.pin(state.to_version)
    for patch_id in state.plan[len(state.done) :]:
        # Killed before its result is saved, a replay is undone by the next call
        # (guard.recover: the am session, git's locks, HEAD back to before it), and
        # the patch is replayed again.
        with guard.journal(dest, "port"):
            try:
                result = _replay(series, dest, state, v1, v2, patch_id)
            except HybridpdError:
                guard.recover(dest, own=True)  # a refused patch, not an interruption: undo now
                raise
            if isinstance(result, Conflict):
                log(f"{patch_id}: conflict")
                return _report(state, dest, conflict=result)
            guard.fault("port:replayed")
            state.record(result)
            state.save(dest)
        log(f"{patch_id}: {result.result}" + (f" ({result.evidence})" if result.evidence else ""))
    return finish(series, dest, state)


def _replay(
    series: Series, dest: Path, state: PortState, v1: Pin, v2: Pin, patch_id: str
) -> PatchResult | Conflict:
    """Replay one patch on HEAD (see the module docstring for the results)."""
    record = series.patch(patch_id)
    if record is None:
        raise PortError(f"patch {patch_id} is no longer in {series.path}; --abort and start again")
    on_v2 = record.pins.get(v2.version)
    on_v1 = record.pins[v1.version]
    path = series.patch_path(v1, patch_id)
    files = tuple(gitops.patch_files(dest, path)) if path.is_file() else ()
    # Porting again onto V2 (--replace) tries every patch V1 carries, whatever V2's
    # record says: that record may be the one `hybridpd test` just disproved.
    retry = state.replace and on_v1.state == "carried"
    if on_v2 is not None and on_v2.state == "upstream" and not retry:
        return PatchResult(patch_id, "upstream", "recorded", files, release=on_v2.release)
    if (on_v2 or on_v1).state == "dropped":
        return PatchResult(patch_id, "dropped", "recorded", files)
    if on_v1.state == "upstream":
        note = f"upstream on {v1.version} already"
        return PatchResult(patch_id, "upstream", "recorded", files, on_v1.release, note)
    if gitops.reverse_applies(dest, path):
        return _upstream(series, v2, patch_id, "reverse-applies", files)
    plain = gitops.applies(dest, path)
    before = gitops.head(dest)
    guard.expect(dest, path)
    outcome = gitops.am(dest, [path])
    if not outcome.ok:
        guard.settle(dest)  # the conflict as left: a kill from here on is recovered
        state.current, state.before = patch_id, before
        state.save(dest)
        guard.fault("port:conflict")
        return _conflict(dest, path, patch_id, v2)
    after = gitops.head(dest)
    if after == before:
        return _upstream(series, v2, patch_id, "empty", files)
    if gitops.resolve(dest, f"{after}~1") != before:
        raise PortError(f"{series.relative(path)} holds more than one commit")
    _ensure_trailer(dest, patch_id)
    return PatchResult(patch_id, "clean" if plain else "3way", None, files)


def _continue_current(series: Series, dest: Path, state: PortState) -> None:
    """Finish the patch ``git am`` stopped on, after a manual resolution."""
    patch_id, before = state.current, state.before
    assert patch_id is not None and before is not None
    files = _patch_files(series, dest, state, patch_id)
    if not gitops.am_in_progress(dest) and gitops.head(dest) == before:
        raise PortError(
            f"the git am session of {patch_id} was ended outside hybridpd port: "
            "--skip --upstream RELEASE if the release has the change, else --abort"
        )
    if gitops.am_in_progress(dest):
        unmerged = gitops.conflicted_files(dest)
        if unmerged:
            raise PortError(
                f"unresolved conflicts in {', '.join(unmerged)}: resolve them, `git add` "
                "the files, then --continue"
            )
        marked = [f for f in files if _marker_lines(dest / f)]
        if marked:
            raise PortError(f"conflict markers are left in {', '.join(marked)}")
        if gitops.index_matches_head(dest):
            # As `git am --continue` does: a resolution that stages nothing is not
            # one. Dropping the patch loses it from the pin, so only an explicit
            # --skip --upstream RELEASE may say the release has the change.
            raise PortError(_nothing_resolved(patch_id, state.to_version, "nothing is staged"))
        _am(dest, "--continue")
    head = gitops.head(dest)
    if head == before or _tree(dest, head) == _tree(dest, before):
        raise PortError(_nothing_resolved(patch_id, state.to_version, "the commit changes nothing"))
    else:
        if gitops.resolve(dest, f"{head}~1") != before:
            raise PortError(
                f"{patch_id} must be one commit on top of {before[:12]}; "
                "squash the commits (git reset --soft) and --continue"
            )
        _ensure_trailer(dest, patch_id)
        state.record(PatchResult(patch_id, "resolved", None, files))
    state.save(dest)


def _nothing_resolved(patch_id: str, release: str, what: str) -> str:
    return (
        f"{what} for {patch_id}: resolve the conflicts, `git add` the files, then "
        f"--continue; or, if {release} already has the change, --skip --upstream RELEASE"
    )


def finish(series: Series, dest: Path, state: PortState) -> PortReport:
    """Write the port: patch files of V2, states and ``ported`` in series.toml.

    See the module invariants for the order. Removes the state file and the V1 ref;
    the directory stays, a patched V2 checkout.
    """
    v2 = series.pin(state.to_version)
    results = state.results()
    carried = [r.id for r in results if r.result in CARRIED_RESULTS]
    with scratch.tree("port-") as staging:
        exported = [i for i, _ in patch_commits(dest, v2)]
        if exported != carried:
            raise PortError(
                f"{dest}: the commits after {v2.tag} are {', '.join(exported) or 'none'}, "
                f"the port carries {', '.join(carried) or 'none'}; --abort and start again"
            )
        export(series, dest, staging)
        with seriesedit.edit(series.path) as editor:
            for r in results:
                state_name = (
                    "carried" if r.result in CARRIED_RESULTS
                    else "dropped" if r.result == "dropped"
                    else "upstream"
                )
                editor.set_patch_state(r.id, v2, state_name, r.release)
            editor.set_pin_ported(v2, True)
        guard.fault("port:series-written")
        patch_dir = series.patch_dir(v2)
        patch_dir.mkdir(parents=True, exist_ok=True)
        stale = sorted(p for p in patch_dir.glob("*.patch") if p.stem not in carried)
        # A file that neither a record nor a commit names is the user's: kept.
        kept = [p for p in stale if series.patch(p.stem) is None]
        for path in stale:
            if path not in kept:
                path.unlink()
        written = []
        for patch_id in carried:
            target = series.patch_path(v2, patch_id)
            # Atomic, as export writes: a kill leaves the old file or the new one.
            guard.remove_temporaries(target)
            guard.write_atomic(target, (staging / f"{patch_id}.patch").read_bytes())
            written.append(series.relative(target))
    drop_base(dest)
    PortState.path(dest).unlink()
    mark_ended(dest, "finished")
    report = _report(state, dest, written=(*written, series.relative(series.path)))
    return dataclasses.replace(report, kept=tuple(series.relative(p) for p in kept))


# Helpers ----------------------------------------------------------------------


def mark_ended(dest: Path, how: str) -> None:
    guard.write_atomic(dest / ".git" / ENDED_FILE, how + "\n")


def _load_state(series: Series, dest: Path) -> PortState:
    state = PortState.load(dest)
    if Path(state.series) != series.path.resolve():
        raise PortError(
            f"the port in {dest} was started with the series {state.series}; "
            f"pass --series {state.series}"
        )
    return state


def _upstream(
    series: Series, v2: Pin, patch_id: str, evidence: Evidence, files: tuple[str, ...]
) -> PatchResult:
    """An upstream result whose release comes from the record's state on another
    pin, else is V2's version (then ``note`` says so)."""
    record = series.patch(patch_id)
    known = [
        (version, st.release)
        for version, st in (record.pins.items() if record else ())
        if version != v2.version and st.state == "upstream" and st.release
    ]
    if known:
        version, release = known[0]
        note = f"release {release} from the record's state on {version}"
        return PatchResult(patch_id, "upstream", evidence, files, release, note)
    note = f"release {v2.version} is a guess (no pin records one): set the first release with it"
    return PatchResult(patch_id, "upstream", evidence, files, v2.version, note)


def _conflict(dest: Path, patch: Path, patch_id: str, v2: Pin) -> Conflict:
    moved = _moved(dest, patch, v2)
    missing = _missing_api(dest, patch, v2)
    unmerged = gitops.conflicted_files(dest)
    if unmerged:
        files = tuple(ConflictFile(f, _marker_lines(dest / f)) for f in unmerged)
        return Conflict(patch_id, files, merged=True, moved=moved, missing_api=missing)
    # No 3-way merge ran (git had no pre-image to merge from): name what plain
    # apply rejects.
    rejected = gitops.rejected_files(dest, patch) or gitops.patch_files(dest, patch)
    return Conflict(patch_id, tuple(ConflictFile(f, ()) for f in rejected), merged=False,
                    moved=moved, missing_api=missing)


def _missing_api(dest: Path, patch: Path, v2: Pin) -> tuple[str, ...]:
    """The methods the patch calls that V1's release defines and V2's does not
    (:mod:`hybridpd.porting.apinames`); nothing when the port has no V1 commits."""
    v1_release = _v1_release(dest)
    return () if v1_release is None else apinames.missing(dest, patch, v1_release, v2.tag)


def _moved(dest: Path, patch: Path, v2: Pin) -> tuple[moves_mod.Move, ...]:
    """The patch's files that V2 renamed or made a re-export, from V1's release commit
    (the root of BASE_REF) to V2's tag; nothing when the port has no V1 commits."""
    v1_release = _v1_release(dest)
    if v1_release is None:
        return ()
    return moves_mod.moves(dest, v1_release, v2.tag, gitops.patch_files(dest, patch))


def _v1_release(dest: Path) -> str | None:
    """V1's release commit (the root of BASE_REF), or None when the port has no V1
    commits."""
    if gitops.resolve(dest, BASE_REF) is None:
        return None
    return gitops.check(dest, "rev-list", "--max-parents=0", BASE_REF).split()[-1]


def _marker_lines(path: Path) -> tuple[tuple[int, int], ...]:
    """1-based line ranges from each ``<<<<<<<`` to its ``>>>>>>>``."""
    if not path.is_file():
        return ()
    ranges, start = [], None
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if line.startswith(b"<<<<<<<") and start is None:
            start = number
        elif line.startswith(b">>>>>>>") and start is not None:
            ranges.append((start, number))
            start = None
    return tuple(ranges)


def _patch_files(series: Series, dest: Path, state: PortState, patch_id: str) -> tuple[str, ...]:
    path = series.patch_path(series.pin(state.from_version), patch_id)
    return tuple(gitops.patch_files(dest, path)) if path.is_file() else ()


def _ensure_trailer(dest: Path, patch_id: str) -> None:
    head = gitops.commits(dest, "HEAD~1..HEAD")[0]
    ids = head.trailer_values(TRAILER)
    if not ids:
        gitops.amend_trailer(dest, TRAILER, patch_id)
    elif ids != [patch_id]:
        raise PortError(f'the commit of {patch_id} has trailer "{TRAILER}: {ids[0]}"')


def _am(dest: Path, verb: str, optional: bool = False) -> None:
    """``git am --continue`` or ``--skip``."""
    if optional and not gitops.am_in_progress(dest):
        return
    result = gitops.am_resume(dest, verb)
    if not result.ok:
        raise PortError(f"git am {verb} failed in {dest}: {gitops.first_error_line(result.stderr)}")


def _reset_to(dest: Path, rev: str | None) -> None:
    if rev is not None and gitops.head(dest) != rev:
        gitops.reset_hard(dest, rev)


def _newer(release: str, than: str) -> bool:
    """Whether ``release`` comes after ``than`` (:func:`release_key`)."""
    try:
        return release_key(release) > release_key(than)
    except InvalidVersion:
        raise PortError(f"{release!r} is not a release version (such as {than})") from None


def _tree(dest: Path, rev: str) -> str:
    return gitops.tree_id(dest, rev)


def _fetch_base(series: Series, v1: Pin, dest: Path) -> None:
    """Put V1's patched commits (and so every blob its patches name) into ``dest``
    under BASE_REF."""
    with scratch.tree("port-base-") as tmp:
        base = tmp / "src"
        checkout_mod.checkout(series, v1, base, source="sdist")
        guard.fault("port:base-checked-out")
        try:
            apply_mod.apply(series, base, v1)
        except ApplyError as exc:
            # Its paths name the temporary checkout, gone when the user reads them.
            raise ApplyError(
                f"{v1.version}'s own patches do not apply to its release, so the port has "
                f"no pre-images to merge against (hybridpd check says which): "
                f"{exc.message.replace(str(base), v1.version)}"
            ) from exc
        gitops.fetch_ref(dest, base, BASE_REF)


def drop_base(dest: Path) -> None:
    if gitops.resolve(dest, BASE_REF):
        gitops.delete_ref(dest, BASE_REF)


def _report(
    state: PortState,
    dest: Path,
    conflict: Conflict | None = None,
    written: tuple[str, ...] = (),
) -> PortReport:
    results = state.results()
    if conflict is not None:
        stopped = state.plan[len(state.done)]
        series_files = tuple(f.path for f in conflict.files)
        results.append(PatchResult(stopped, "conflict", None, series_files))
    return PortReport(state.from_version, state.to_version, dest, tuple(results), written, conflict)
