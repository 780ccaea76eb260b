"""Building the commits of a PR directory: each patch applied with ``git am`` to stock
as one commit, without its ``Hybridpd-Patch`` trailer, with the ``Assisted-by`` trailer
placeholder and its upstream-style tests; and the earlier patches it needs to apply."""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from pathlib import Path

from hybridpd import gitops
from hybridpd.series.apply import TRAILER
from hybridpd.series.model import Pin, Series
from hybridpd.upstreaming.layout import ExportPrError, PrCommit, material


def strip_trailer(message: str, key: str = TRAILER) -> str:
    """``message`` without ``key:`` trailer lines (and the blank lines they leave)."""
    lines = [ln for ln in message.splitlines() if not ln.lower().startswith(f"{key.lower()}:")]
    return "\n".join(lines).rstrip() + "\n"


#: The AI-attribution trailer each exported commit carries, for the submitter to fill
#: in (vLLM's contributing guide, "AI Assisted Contributions", asks for one).
ASSISTED_BY = "Assisted-by: <AI tool and model that assisted; fill in before submitting>"
_TRAILER_LINE = re.compile(r"^[A-Za-z][A-Za-z0-9-]*: \S")


def with_assisted_by(message: str) -> str:
    """``message`` with the :data:`ASSISTED_BY` trailer placeholder, in its trailer
    block (a new one when its last paragraph holds no trailers); kept once."""
    if any(ln.lower().startswith("assisted-by:") for ln in message.splitlines()):
        return message
    text = message.rstrip()
    last = text.rsplit("\n\n", 1)[-1].splitlines()
    in_trailers = "\n\n" in text and all(_TRAILER_LINE.match(ln) for ln in last)
    return text + ("\n" if in_trailers else "\n\n") + ASSISTED_BY + "\n"


def _applies(repo: Path, base: str, patches: Sequence[Path]) -> bool:
    """Whether ``patches`` ``git am`` (no 3-way) in order onto ``base``; leaves ``base``."""
    gitops.reset_hard(repo, base)
    try:
        return gitops.am(repo, list(patches), three_way=False).ok
    finally:
        gitops.am_abort(repo)
        gitops.reset_hard(repo, base)


def prerequisites(repo: Path, base: str, series: Series, pin: Pin, patch_id: str) -> list[str]:
    """The earlier carried patches ``patch_id`` needs to apply on stock, in series order.

    Found by trying: nothing if the patch applies alone; otherwise the earlier patches
    touching one of its files (with their own prerequisites), pruned to those it
    cannot apply without.
    """
    carried = [p.id for p in series.carried(pin)]
    path = series.patch_path(pin, patch_id)
    if _applies(repo, base, [path]):
        return []
    files = set(gitops.patch_files(repo, path))
    earlier = carried[: carried.index(patch_id)]
    needed: set[str] = set()
    for other in earlier:
        if files & set(gitops.patch_files(repo, series.patch_path(pin, other))):
            needed |= {other, *prerequisites(repo, base, series, pin, other)}
    ordered = [i for i in earlier if i in needed]
    if not ordered or not _applies(
        repo, base, [*(series.patch_path(pin, i) for i in ordered), path]
    ):
        tried = f" after {', '.join(ordered)}" if ordered else ""
        raise ExportPrError(
            f"patch {patch_id} does not apply with git am to stock {pin.version}{tried}"
        )
    for other in list(ordered):
        trial = [i for i in ordered if i != other]
        if _applies(repo, base, [*(series.patch_path(pin, i) for i in trial), path]):
            ordered = trial
    return ordered


def _check_adds_to_patch(
    repo: Path, series: Series, pin: Pin, patch_id: str, tests: dict[str, bytes]
) -> None:
    """Refuse material that rewrites a test file the patch itself changes.

    A patch may edit the project's own tests (a fake that must take a new argument);
    the material of such a file is the patched file with tests added, so the PR
    changes it once, as the patch does. ExportPrError when the material drops or
    changes a line of the patched file (checked right after ``git am`` of the patch).
    """
    changed = set(gitops.files_of(repo, gitops.head(repo)))
    for rel, content in tests.items():
        if rel not in changed:
            continue
        patched = (repo / rel).read_bytes().splitlines()
        matcher = difflib.SequenceMatcher(None, patched, content.splitlines(), autojunk=False)
        if any(tag not in ("equal", "insert") for tag, *_ in matcher.get_opcodes()):
            raise ExportPrError(
                f"data/upstream_tests/{series.slug(pin)}/{patch_id}/{rel} changes lines "
                f"patch {patch_id} makes or keeps in {rel}: start it from the patched "
                "file and only add to it"
            )


def build_commits(
    repo: Path,
    base: str,
    series: Series,
    pin: Pin,
    patch_ids: Sequence[str],
    tests_root: Path | None = None,
    *,
    author: str,
) -> list[tuple[PrCommit, bytes]]:
    """Apply ``patch_ids`` onto ``base``, each as one commit without its trailer and
    with its upstream-style tests, authored by ``author`` (the submitter,
    :mod:`hybridpd.upstreaming.author`); return each commit and its format-patch bytes."""
    gitops.reset_hard(repo, base)
    out = []
    try:
        for number, patch_id in enumerate(patch_ids, 1):
            path = series.patch_path(pin, patch_id)
            result = gitops.am(repo, [path], three_way=False)
            if not result.ok:
                raise ExportPrError(
                    f"patch {patch_id} does not apply with git am to stock {pin.version}: "
                    f"{gitops.first_error_line(result.stderr)}"
                )
            tests = material(series.slug(pin), patch_id, tests_root).tests
            _check_adds_to_patch(repo, series, pin, patch_id, tests)
            edited = tuple(rel for rel in tests if (repo / rel).exists())
            for rel, content in tests.items():
                (repo / rel).parent.mkdir(parents=True, exist_ok=True)
                (repo / rel).write_bytes(content)
            if tests:
                gitops.add(repo, *tests, force=True)
            message = with_assisted_by(strip_trailer(gitops.message(repo)))
            sha = gitops.amend_message(repo, message, author=author)
            subject, _, body = message.partition("\n")
            commit = PrCommit(
                patch_id,
                f"{number:04d}-{patch_id}.patch",
                subject.strip(),
                body.strip(),
                tuple(tests),
                tuple(gitops.files_of(repo, sha)),
                edited,
            )
            out.append((commit, gitops.format_patch(repo, sha)))
    finally:
        gitops.am_abort(repo)
        gitops.reset_hard(repo, base)
    return out
