"""``port --abort``: undo a port, keeping everything in its directory the port did not make.

The model is ``git am --abort``: the files of the patch in flight go back to HEAD (its
conflict, and any resolution begun, are the port's), HEAD goes back to the target
release commit, and nothing else is touched.

Invariants:

* What the port made is: its commits after the release commit (each carries a
  ``Hybridpd-Patch`` trailer naming a patch of the plan, or is the one commit a user
  made on top of the stopped patch's parent to resolve it), the files those commits
  change, and the paths of the patch ``git am`` stopped on (the patch in
  ``rebase-apply``, and the conflicted paths).
* Everything else is the user's and is kept as it is: untracked files (nothing is
  cleaned), and edits, staged or not, to files no port commit changes (``git reset
  --keep`` leaves their content; a staged one ends unstaged).
* What the abort would have to discard and the port did not make (a commit without the
  port's trailer, an edit to a file a port commit changed, an untracked file where the
  release has one) is refused before anything changes, naming each.
* series.toml and the patch files are never touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hybridpd import gitops, guard
from hybridpd.porting.port import (
    PortError,
    PortState,
    drop_base,
    mark_ended,
)
from hybridpd.progress import Log, quiet
from hybridpd.series.apply import TRAILER

_SHOWN = 8


@dataclass(frozen=True)
class Aborted:
    """What ``port --abort`` left: ``repo`` back at ``to_version``'s release commit.
    ``recovered``: the line saying it first undid a killed replay. ``kept``: the
    changes in the directory the port did not make (``git status`` lines), left as
    they were."""

    repo: Path
    to_version: str
    stock: str
    recovered: str | None = None
    kept: tuple[str, ...] = ()

    def to_json(self) -> dict:
        data: dict = {"to": self.to_version, "dir": str(self.repo), "stock": self.stock}
        if self.recovered:
            data["recovered"] = self.recovered
        if self.kept:
            data["kept"] = list(self.kept)
        return data


def abort(dest: Path, log: Log = quiet) -> Aborted:
    """Stop the port in ``dest`` and put it back at the target release (see the module
    invariants). A killed replay is recovered first (and ``log`` says so), or refused
    with one line; so is a change the abort would discard that the port did not make."""
    dest = dest.absolute()
    state = PortState.load(dest)
    with guard.operation(dest, "port --abort") as recovered:
        if recovered:
            log(recovered)
        in_flight = _in_flight(dest)
        refused = _not_the_ports(dest, state, in_flight)
        if refused:
            shown = ", ".join(refused[:_SHOWN])
            more = f" and {len(refused) - _SHOWN} more" if len(refused) > _SHOWN else ""
            raise PortError(
                f"{dest}: --abort would discard what the port did not make ({shown}{more}); "
                "nothing was done: commit or move them out of the directory "
                f"(git -C {dest} stash -u keeps them all), then run again"
            )
        kept = tuple(
            line for line in gitops.status(dest) if _status_path(line) not in in_flight
        )
        gitops.restore_from_head(dest, sorted(in_flight))
        guard.fault("port-abort:restored")
        gitops.am_quit(dest)
        gitops.reset_keep(dest, state.stock)
        guard.fault("port-abort:reset")
        drop_base(dest)
        mark_ended(dest, "aborted")  # before the state goes: the directory is never unnamed
        PortState.path(dest).unlink()
    return Aborted(dest, state.to_version, state.stock, recovered, kept)


def _in_flight(dest: Path) -> set[str]:
    """The paths of the patch ``git am`` stopped on: its own and the conflicted ones."""
    paths = set(gitops.conflicted_files(dest))
    patch = guard.git_dir(dest) / "rebase-apply" / "patch"
    if gitops.am_in_progress(dest) and patch.is_file():
        paths |= set(gitops.patch_blobs(patch))
    return paths


def _not_the_ports(dest: Path, state: PortState, in_flight: set[str]) -> list[str]:
    """What moving ``dest`` back to the release would discard that the port did not make."""
    head = gitops.head(dest)
    if not gitops.run(dest, "merge-base", "--is-ancestor", state.stock, head).ok:
        return [f"HEAD {head[:12]}, which does not descend from {state.to_version}'s release"]
    found = []
    commits = gitops.commits(dest, f"{state.stock}..{head}")
    for number, commit in enumerate(commits):
        ids = commit.trailer_values(TRAILER)
        resolution = (
            state.current is not None
            and number == len(commits) - 1
            and gitops.resolve(dest, f"{commit.sha}~1") == state.before
        )
        if not (len(ids) == 1 and ids[0] in state.plan) and not resolution:
            found.append(f"commit {commit.sha[:12]} ({commit.subject})")
    ported = {path for _, path in gitops.changed_files(dest, state.stock, head)}
    untracked = set(gitops.untracked_files(dest))
    changed = [p for p in gitops.changed_paths(dest) if p not in in_flight]
    found += [f"{p} (edited after the port changed it)"
              for p in changed if p in ported and p not in untracked]
    # An untracked file where the release has one: moving HEAD back would overwrite it.
    covered = gitops.tracked_at(dest, state.stock, [p for p in changed if p in untracked])
    found += [f"{p} (untracked; {state.to_version} has a file there)" for p in sorted(covered)]
    return found


def _status_path(line: str) -> str:
    return line[3:].split(" -> ")[-1]
