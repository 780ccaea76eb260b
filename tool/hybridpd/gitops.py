"""Git verbs, through GitPython.

Everything here is project agnostic: it knows nothing about vLLM, pins or the patch
series. Functions take a repository path, run one git operation, and return a plain
result (a sha, a list of paths, bytes). Policy -- which patches, in what order, what a
trailer means -- lives in the callers.

Invariants every call keeps:

* Commits this module creates have a fixed committer (and, for :func:`commit_all`, a
  fixed author) with a fixed date, so the same tree and the same patches give the same
  commit hashes on every machine.
* The user's git configuration cannot change what is committed or exported: the
  settings that would (line-ending conversion, signing, hooks, diff prefixes) are
  overridden on every command line, and the export flags are spelled out.
* A failing command raises :class:`~hybridpd.errors.GitError` with git's first error
  line, unless the verb's contract is to report failure as a value.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import git

from hybridpd.errors import GitError

#: The identity of commits made by this module (see the module invariants).
IDENTITY_NAME = "hybridpd"
IDENTITY_EMAIL = "hybridpd@localhost"
IDENTITY_DATE = "2000-01-01T00:00:00Z"

_FIXED_COMMITTER = {
    "GIT_COMMITTER_NAME": IDENTITY_NAME,
    "GIT_COMMITTER_EMAIL": IDENTITY_EMAIL,
    "GIT_COMMITTER_DATE": IDENTITY_DATE,
}
_FIXED_AUTHOR = {
    "GIT_AUTHOR_NAME": IDENTITY_NAME,
    "GIT_AUTHOR_EMAIL": IDENTITY_EMAIL,
    "GIT_AUTHOR_DATE": IDENTITY_DATE,
}

# Passed as ``-c`` to every command. user.* lets git run on machines without an
# identity; the others keep user configuration out of committed and exported bytes.
_CONFIG = (
    f"user.name={IDENTITY_NAME}",
    f"user.email={IDENTITY_EMAIL}",
    "core.autocrlf=false",
    "core.hooksPath=/dev/null",
    "commit.gpgsign=false",
    "tag.gpgsign=false",
    "diff.noprefix=false",
    "diff.mnemonicPrefix=false",
    "advice.detachedHead=false",
    "init.defaultBranch=main",
    # No automatic gc or maintenance: after committing a release (thousands of loose
    # objects) git starts one in the background, which kept writing into a temporary
    # checkout while it was removed ("Directory not empty" in `port`).
    "gc.auto=0",
    "maintenance.auto=false",
)

# One commit as a byte-stable mbox message: no commit hash, stat, numbering, version
# signature or config-dependent diff options, so the output depends only on the commit.
_FORMAT_PATCH_FLAGS = (
    "--stdout",
    "--keep-subject",
    "--no-stat",
    "--no-signature",
    "--zero-commit",
    "--full-index",
    "--no-numbered",
    "--no-renames",
    "--binary",
    "--no-notes",
    "--no-thread",
    "--no-to",
    "--no-cc",
    "--no-add-header",
    "--no-base",
    "--no-signoff",
    "--no-attach",
    "--no-color",
    "--no-ext-diff",
    "--unified=3",
    "--inter-hunk-context=0",
    "--diff-algorithm=myers",
    "--indent-heuristic",
    "--src-prefix=a/",
    "--dst-prefix=b/",
    f"-O{os.devnull}",
)

_FIELD = "\x1f"
_RECORD = "\x1e"


@dataclass(frozen=True)
class Commit:
    """A commit with its subject and trailers, as ``git log`` parses them."""

    sha: str
    subject: str
    trailers: tuple[tuple[str, str], ...]

    def trailer_values(self, key: str) -> list[str]:
        """Values of every trailer named ``key`` (case-insensitive), in order."""
        return [v for k, v in self.trailers if k.lower() == key.lower()]


@dataclass(frozen=True)
class Result:
    """Outcome of a command whose failure the caller handles."""

    status: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.status == 0


def run(repo: Path, *args: str, env: Mapping[str, str] | None = None) -> Result:
    """Run ``git <args>`` in ``repo`` and return its outcome without raising."""
    status, stdout, stderr = _execute(repo, args, env)
    return Result(status, stdout.decode("utf-8", errors="replace"), stderr)


def check(repo: Path, *args: str, env: Mapping[str, str] | None = None) -> str:
    """Run ``git <args>`` in ``repo``; return stdout, raise GitError on failure."""
    return check_bytes(repo, *args, env=env).decode("utf-8", errors="replace")


def check_bytes(repo: Path, *args: str, env: Mapping[str, str] | None = None) -> bytes:
    """Like :func:`check`, but return stdout exactly as git wrote it."""
    status, stdout, stderr = _execute(repo, args, env)
    if status != 0:
        raise GitError(f"git {args[0]} failed in {repo}: {first_error_line(stderr)}")
    return stdout


def first_error_line(stderr: str) -> str:
    """The most telling line of git's stderr (an ``error:``/``fatal:`` line if any)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in lines:
        if line.startswith(("fatal:", "error:")):
            return line
    return lines[0] if lines else "(no message)"


def _execute(
    repo: Path, args: Sequence[str], env: Mapping[str, str] | None
) -> tuple[int, bytes, str]:
    config = [arg for setting in _CONFIG for arg in ("-c", setting)]
    status, stdout, stderr = git.Git(repo).execute(
        ["git", *config, *args],
        with_extended_output=True,
        with_exceptions=False,
        stdout_as_string=False,
        strip_newline_in_stdout=False,
        env=dict(env or {}),
    )
    if isinstance(stderr, bytes):
        stderr = stderr.decode("utf-8", errors="replace")
    return status, stdout or b"", stderr or ""


# Creating repositories ----------------------------------------------------------


def init(repo: Path, branch: str) -> None:
    """Make ``repo`` (an existing directory) a new repository on ``branch``."""
    check(repo, "init", "--quiet", f"--initial-branch={branch}")


def commit_all(repo: Path, message: str) -> str:
    """Commit every file in the work tree, ignored ones included; return the sha.

    Author and committer are the fixed identity, so the same tree and message give
    the same commit hash wherever this runs.
    """
    check(repo, "add", "--all", "--force")
    check(
        repo,
        "commit",
        "--quiet",
        "--allow-empty",
        "--no-verify",
        f"--message={message}",
        env={**_FIXED_AUTHOR, **_FIXED_COMMITTER},
    )
    return head(repo)


def clone(url: str, dest: Path, ref: str) -> None:
    """Shallow-clone ``ref`` (a branch or tag) of ``url`` into ``dest``.

    ``dest`` must not exist or be empty; its parent must exist.
    """
    dest = dest.absolute()
    check(dest.parent, "clone", "--quiet", "--depth=1", f"--branch={ref}", url, str(dest))


def clone_local(source: Path, dest: Path, branch: str) -> None:
    """Clone the local repository ``source`` into ``dest`` (which must not exist) with
    branch ``branch`` at ``source``'s HEAD, and its tags."""
    dest = dest.absolute()
    check(dest.parent, "clone", "--quiet", "--no-checkout", str(source), str(dest))
    check(dest, "checkout", "--quiet", "-B", branch, head(source))
    check(dest, "fetch", "--quiet", "--tags", str(source))


def add_worktree(repo: Path, path: Path, rev: str) -> None:
    """A detached work tree of ``rev`` at ``path``, kept (see :func:`worktree`)."""
    check(repo, "worktree", "add", "--quiet", "--detach", str(path), rev)


@contextlib.contextmanager
def worktree(repo: Path, rev: str, path: Path) -> Iterator[Path]:
    """A detached work tree of ``rev`` at ``path`` for the body; removed and pruned
    after it, whatever the body did."""
    add_worktree(repo, path, rev)
    try:
        yield path
    finally:
        run(repo, "worktree", "remove", "--force", str(path))
        prune_worktrees(repo)


def prune_worktrees(repo: Path) -> None:
    """Forget work trees of ``repo`` whose directories are gone."""
    run(repo, "worktree", "prune")


def fetch_ref(repo: Path, source: Path, ref: str) -> None:
    """Fetch ``source``'s HEAD into ``ref`` of ``repo`` (no tags)."""
    check(repo, "fetch", "--quiet", "--no-tags", str(source), f"+HEAD:{ref}")


def delete_ref(repo: Path, ref: str) -> None:
    check(repo, "update-ref", "-d", ref)


def add(repo: Path, *paths: str, force: bool = False) -> None:
    """Stage ``paths`` (``force``: ignored ones too)."""
    check(repo, "add", *(["--force"] if force else []), "--", *paths)


def clean(repo: Path, *paths: str) -> None:
    """Remove untracked files and folders (not ignored ones) under ``paths`` (all)."""
    check(repo, "clean", "--quiet", "-d", "--force", *(["--", *paths] if paths else []))


def create_branch(repo: Path, name: str) -> None:
    """Create branch ``name`` at HEAD and switch to it."""
    check(repo, "checkout", "--quiet", "-b", name)


def add_excludes(repo: Path, patterns: Iterable[str]) -> None:
    """Append ignore patterns to the repository's ``info/exclude`` (local, untracked)."""
    path = repo / check(repo, "rev-parse", "--git-path", "info/exclude").strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.writelines(f"{pattern}\n" for pattern in patterns)


def tag(repo: Path, name: str, rev: str = "HEAD") -> None:
    """Create the lightweight tag ``name`` at ``rev`` (no tagger date: reproducible)."""
    check(repo, "tag", name, rev)


# Reading state ------------------------------------------------------------------


def head(repo: Path) -> str:
    """The sha of HEAD."""
    return check(repo, "rev-parse", "--verify", "HEAD").strip()


def resolve(repo: Path, rev: str) -> str | None:
    """The commit sha ``rev`` names, or None if it names no commit."""
    result = run(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    return result.stdout.strip() if result.ok else None


def git_dir(repo: Path) -> Path:
    """The repository's git directory."""
    return repo / check(repo, "rev-parse", "--git-dir").strip()


def message(repo: Path, rev: str = "HEAD") -> str:
    """The full commit message of ``rev``."""
    return check(repo, "log", "-1", "--format=%B", rev)


def tree_id(repo: Path, rev: str) -> str:
    """The id of ``rev``'s tree (equal ids: equal contents)."""
    return check(repo, "rev-parse", f"{rev}^{{tree}}").strip()


def files_of(repo: Path, commit: str) -> list[str]:
    """The paths ``commit`` changes against its parent."""
    return check(repo, "diff-tree", "--no-commit-id", "--name-only", "-r", commit).splitlines()


def is_tracked(repo: Path, path: str) -> bool:
    return run(repo, "ls-files", "--error-unmatch", "--", path).ok


def has_changes(repo: Path, path: str) -> bool:
    """Whether ``path`` differs from HEAD, untracked files included."""
    return bool(check(repo, "status", "--porcelain", "--", path).strip())


def last_commit_date(repo: Path, path: str) -> str | None:
    """ISO committer date of the last commit touching ``path``."""
    return check(repo, "log", "-1", "--format=%cI", "--", path).strip() or None


def made_here(repo: Path, old: str, new: str) -> bool:
    """Whether ``new`` is ``old`` or descends from it through commits this module made
    only (the fixed committer and date): no one else committed in between."""
    if new == old:
        return True
    if not run(repo, "merge-base", "--is-ancestor", old, new).ok:
        return False
    out = check(repo, "log", "--format=%ce %cI", f"{old}..{new}")
    made = {f"{IDENTITY_EMAIL} {IDENTITY_DATE.replace('Z', '+00:00')}"}
    return set(out.splitlines()) <= made


def changed_paths(repo: Path) -> list[str]:
    """Paths whose index or work tree differs from HEAD, untracked files included
    (ignored ones not); both sides of a rename."""
    fields = check(repo, "status", "--porcelain=v1", "-z", "--untracked-files=all").split("\0")
    paths, rest = [], iter(fields)
    for entry in rest:
        if not entry:
            continue
        paths.append(entry[3:])
        if entry[0] in "RC":
            paths.append(next(rest))
    return paths


def untracked_files(repo: Path) -> list[str]:
    """Paths of untracked files (ignored ones not)."""
    out = check(repo, "ls-files", "--others", "--exclude-standard", "-z")
    return [p for p in out.split("\0") if p]


def tracked_at(repo: Path, rev: str, paths: Sequence[str]) -> set[str]:
    """Those of ``paths`` that are files in ``rev``'s tree."""
    if not paths:
        return set()
    out = check(repo, "ls-tree", "-r", "-z", "--name-only", "--full-tree", rev, "--", *paths)
    return {p for p in out.split("\0") if p}


def work_tree_blobs(repo: Path, paths: Sequence[str]) -> dict[str, str | None]:
    """The blob id each of ``paths`` would have if added now (None: no such file)."""
    present = [p for p in paths if (repo / p).is_file() or (repo / p).is_symlink()]
    ids = check(repo, "hash-object", "--", *present).split() if present else []
    return {p: dict(zip(present, ids)).get(p) for p in paths}


def index_entries(repo: Path, paths: Sequence[str]) -> dict[str, list[str]]:
    """``path -> ["<blob> <stage>", ...]`` in the index (empty: not in it; more than
    one: a conflict)."""
    found: dict[str, list[str]] = {p: [] for p in paths}
    if not paths:
        return found
    out = check(repo, "ls-files", "--stage", "-z", "--", *paths)
    for entry in filter(None, out.split("\0")):
        meta, name = entry.split("\t", 1)
        _mode, sha, stage = meta.split()
        if name in found:
            found[name].append(f"{sha} {stage}")
    return found


def index_matches_head(repo: Path) -> bool:
    """Whether the index has nothing staged against HEAD."""
    return run(repo, "diff", "--cached", "--quiet", "HEAD").ok


def is_repo(path: Path) -> bool:
    """Whether ``path`` is the top level of a git work tree."""
    result = run(path, "rev-parse", "--show-toplevel")
    return result.ok and Path(result.stdout.strip()).resolve() == path.resolve()


def status(repo: Path) -> list[str]:
    """``git status --porcelain`` lines, untracked files included (ignored ones not)."""
    out = check(repo, "status", "--porcelain=v1", "--untracked-files=all")
    return out.splitlines()


def is_dirty(repo: Path) -> bool:
    """Whether the work tree or index differs from HEAD, or has untracked files."""
    return bool(status(repo))


def has_tracked_changes(repo: Path, path: str = ".") -> bool:
    """Whether tracked files under ``path`` differ from HEAD (untracked ones ignored)."""
    return bool(check(repo, "status", "--porcelain=v1", "--untracked-files=no", "--", path))


def is_ignored(repo: Path, path: str) -> bool:
    """Whether git ignores ``path`` in ``repo``'s work tree."""
    return run(repo, "check-ignore", "--quiet", path).ok


def tree_files(repo: Path, rev: str, path: str) -> dict[str, tuple[int, str]]:
    """``file -> (mode, blob sha)`` of every file under ``path`` at ``rev`` (repository
    paths; one ``ls-tree``)."""
    out = check(repo, "ls-tree", "-r", "-z", "--full-tree", rev, "--", path)
    files = {}
    for entry in filter(None, out.split("\0")):
        meta, name = entry.split("\t", 1)
        mode, kind, sha = meta.split()
        if kind == "blob":
            files[name] = (int(mode, 8), sha)
    return files


def read_blob(repo: Path, rev: str, path: str) -> bytes:
    """The bytes of ``path`` at ``rev``."""
    return check_bytes(repo, "cat-file", "blob", f"{rev}:{path}")


def changed_files(repo: Path, old: str, new: str, *paths: str) -> list[tuple[str, str]]:
    """``(status letter, path)`` of each file under ``paths`` that ``old..new`` adds (A),
    modifies (M), deletes (D) or otherwise changes (renames are split in D and A)."""
    out = check(repo, "diff", "--name-status", "-z", "--no-renames", old, new, "--", *paths)
    fields = [f for f in out.split("\0") if f]
    return [(status[0], path) for status, path in zip(fields[0::2], fields[1::2])]


def tag_commits(repo: Path) -> dict[str, str]:
    """Map every tag name to the commit it points at (annotated tags peeled)."""
    out = check(
        repo,
        "for-each-ref",
        "--format=%(refname:strip=2) %(objectname) %(*objectname)",
        "refs/tags",
    )
    tags = {}
    for line in out.splitlines():
        name, obj, peeled = (line.split(" ") + [""])[:3]
        tags[name] = peeled or obj
    return tags


def first_parent_history(repo: Path, rev: str = "HEAD") -> list[str]:
    """Shas from ``rev`` back to the root, following first parents only."""
    return check(repo, "rev-list", "--first-parent", rev).split()


def commits(repo: Path, rev_range: str) -> list[Commit]:
    """Commits in ``rev_range`` (e.g. ``v1.0..HEAD``), oldest first, with trailers."""
    out = check(
        repo,
        "log",
        "--reverse",
        f"--format=%H{_FIELD}%s{_FIELD}%(trailers:only,unfold){_RECORD}",
        rev_range,
    )
    result = []
    for record in out.split(_RECORD):
        if not record.strip():
            continue
        sha, subject, trailer_block = record.strip("\n").split(_FIELD)
        result.append(Commit(sha, subject, _parse_trailers(trailer_block)))
    return result


def _parse_trailers(block: str) -> tuple[tuple[str, str], ...]:
    pairs = []
    for line in block.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            pairs.append((key.strip(), value.strip()))
    return tuple(pairs)


def conflicted_files(repo: Path) -> list[str]:
    """Paths with unresolved merge conflicts in the index."""
    return check(repo, "diff", "--name-only", "--diff-filter=U").splitlines()


_REJECTED = re.compile(
    r"^error: (.+): (?:patch does not apply|already exists in (?:index|working directory)"
    r"|does not exist in index|does not match index|No such file or directory)$",
    re.MULTILINE,
)


_DIFF_GIT = re.compile(r"^diff --git a/(.*) b/(.*)$")
_INDEX_LINE = re.compile(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)")


def patch_blobs(patch: Path) -> dict[str, tuple[str | None, str | None]]:
    """``path -> (blob before, blob after)`` for each file a ``--full-index`` patch
    changes (None: the file does not exist on that side). A file whose mode alone
    changes has no index line and is not listed."""
    blobs: dict[str, tuple[str | None, str | None]] = {}
    path = None
    for line in patch.read_text(encoding="utf-8", errors="replace").splitlines():
        if match := _DIFF_GIT.match(line):
            path = match.group(2)
        elif path and (match := _INDEX_LINE.match(line)):
            old, new = (None if set(sha) == {"0"} else sha for sha in match.groups())
            blobs[path] = (old, new)
            path = None
    return blobs


def applies(repo: Path, patch: Path) -> bool:
    """Whether ``patch`` applies to the work tree as it is (``git apply --check``)."""
    return run(repo, "apply", "--check", "--whitespace=nowarn", str(patch)).ok


def rejected_files(repo: Path, patch: Path) -> list[str]:
    """Paths of ``patch`` that do not apply to the work tree (``git apply --check``)."""
    stderr = run(repo, "apply", "--check", "--whitespace=nowarn", str(patch)).stderr
    return list(dict.fromkeys(_REJECTED.findall(stderr)))


def patch_files(repo: Path, patch: Path) -> list[str]:
    """Paths a patch (a diff or mbox file) touches, in the order it touches them."""
    out = check(repo, "apply", "--numstat", "-z", str(patch))
    return [entry.split("\t", 2)[2] for entry in out.split("\0") if entry.count("\t") >= 2]


# Applying and exporting patches -------------------------------------------------


def am(
    repo: Path,
    patch_paths: Sequence[Path],
    three_way: bool = True,
    keep_cr: bool = True,
) -> Result:
    """``git am`` the mbox files, in order; return the outcome without raising.

    Subjects keep bracketed prefixes such as ``[Core]`` (only ``[PATCH...]`` is
    stripped) and whitespace is applied verbatim, so an exported commit re-applies to
    an identical commit. On failure the am session is left in progress; see
    :func:`am_abort`.
    """
    args = ["am", "--quiet", "--keep-non-patch", "--no-scissors", "--whitespace=nowarn"]
    if three_way:
        args.append("--3way")
    if keep_cr:
        args.append("--keep-cr")
    return run(repo, *args, *(str(p) for p in patch_paths), env=_FIXED_COMMITTER)


def am_in_progress(repo: Path) -> bool:
    """Whether a ``git am`` session is waiting to be continued or aborted."""
    path = check(repo, "rev-parse", "--git-path", "rebase-apply").strip()
    return (repo / path).is_dir()


def am_abort(repo: Path) -> None:
    """Abort the ``git am`` session in progress, if any."""
    if am_in_progress(repo):
        check(repo, "am", "--abort")


def am_resume(repo: Path, verb: str) -> Result:
    """``git am --continue``, ``--skip`` or ``--abort`` (fixed committer), as a result."""
    if verb not in ("--continue", "--skip", "--abort"):
        raise ValueError(f"not a git am verb: {verb}")
    return run(repo, "am", verb, env=_FIXED_COMMITTER)


def reset_hard(repo: Path, rev: str) -> None:
    """Point the current branch, index and work tree at ``rev``."""
    check(repo, "reset", "--quiet", "--hard", rev)


def reset_keep(repo: Path, rev: str) -> None:
    """Point the current branch at ``rev``, updating only the files that differ between
    HEAD and ``rev``; local changes to other files stay (git refuses, changing nothing,
    when a file it must update has local changes)."""
    check(repo, "reset", "--quiet", "--keep", rev)


def restore_from_head(repo: Path, paths: Sequence[str]) -> None:
    """Put ``paths`` back in the index and work tree as HEAD has them (conflicts
    included); a path HEAD does not have is removed from both."""
    present = sorted(tracked_at(repo, "HEAD", paths))
    absent = sorted(set(paths) - set(present))
    if present:
        check(repo, "checkout", "--quiet", "HEAD", "--", *present)
    if absent:
        check(repo, "rm", "--quiet", "--cached", "--force", "--ignore-unmatch", "--", *absent)
        for path in absent:
            (repo / path).unlink(missing_ok=True)


def am_quit(repo: Path) -> None:
    """End the ``git am`` session in progress, if any, keeping HEAD, index and work tree."""
    if am_in_progress(repo):
        check(repo, "am", "--quit")


def amend_trailer(repo: Path, key: str, value: str) -> str:
    """Add the trailer ``key: value`` to HEAD's message; return the new HEAD sha."""
    check(
        repo,
        "commit",
        "--quiet",
        "--amend",
        "--no-edit",
        "--no-verify",
        f"--trailer={key}: {value}",
        env=_FIXED_COMMITTER,
    )
    return head(repo)


def user_config(key: str, cwd: Path | None = None) -> str | None:
    """``git config --get key`` as the user's own git resolves it in ``cwd`` (their
    system, global and repository settings; none of this module's ``-c`` settings,
    which would answer with the fixed identity); None when unset or git is missing."""
    try:
        done = subprocess.run(["git", "config", "--get", key], cwd=cwd,
                              capture_output=True, text=True, check=False)
    except OSError:
        return None
    value = done.stdout.strip()
    return value if done.returncode == 0 and value else None


def amend_message(repo: Path, text: str, author: str | None = None) -> str:
    """Replace HEAD's message by ``text`` (whitespace cleaned up, fixed committer) and,
    given ``author`` (``Name <email>``), its author (the author date is kept); return
    the new HEAD sha."""
    with tempfile.NamedTemporaryFile("w", suffix=".msg", delete=False) as fh:
        fh.write(text)
    try:
        check(repo, "commit", "--quiet", "--amend", "--no-verify", "--allow-empty",
              "--cleanup=whitespace", f"--file={fh.name}",
              *([f"--author={author}"] if author else []), env=_FIXED_COMMITTER)
    finally:
        Path(fh.name).unlink()
    return head(repo)


def format_patch(repo: Path, commit: str) -> bytes:
    """``commit`` as a byte-stable mbox message (see ``_FORMAT_PATCH_FLAGS``)."""
    return check_bytes(repo, "format-patch", *_FORMAT_PATCH_FLAGS, "-1", commit)


def reverse_applies(repo: Path, patch: Path) -> bool:
    """Whether the work tree already contains the change ``patch`` makes.

    True when the patch can be applied in reverse without conflicts, i.e. every
    postimage it describes is present.
    """
    return run(repo, "apply", "--reverse", "--check", "--whitespace=nowarn", str(patch)).ok
