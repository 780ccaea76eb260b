"""The layout of an exported PR directory: its files, the upstream-style material it
draws on, and the manifest that lets a later export replace only its own work.

For one pin, every carried patch becomes a directory ``<out>/<id>/`` that a
contributor can turn into a pull request to the series' project (vLLM, or LMCache for
``patches/lmcache``) as it is:

* ``0001-<id>.patch`` ... : ``git format-patch`` files that ``git am`` applies to a
  stock checkout of the pin (``hybridpd checkout V``). The last one is the patch's own
  commit: its message without the ``Hybridpd-Patch`` trailer, plus the upstream-style
  unit test added under the project's ``tests/`` tree in the same commit, as a PR
  carries it.
  A patch that does not apply alone on stock is preceded by the earlier carried
  patches it needs (each with its own test), so the directory is self-contained.
* ``PR.md``: the PR body in the upstream project's words (what, why, design,
  alternatives, related work, the test plan and results ``--verify`` ran and measured,
  the AI-assistance checklist); ``SUBMITTING.md``: notes to the submitter (how to
  apply and re-check it, DCO, dependencies, the GPU plan to run, hybridpd's own e2e
  measurements), which do not belong in the PR.
* ``verify.json`` (with ``--verify``): the added tests run on stock (must fail), and
  after ``git am`` (must pass).
* ``.hybridpd-export-pr.json``: every file above as written, so that a later export
  replaces the directory only while it holds nothing else (no edit, no added file),
  or with ``--force``.

The upstream-style tests are data, kept per pin and patch in
``data/upstream_tests/<slug>/<id>/`` (``<slug>``: :meth:`Series.slug`, the version
for vLLM, ``lmcache-<version>`` for LMCache): the files under ``tests/`` there land at
the same paths in the project's tree (a file the tree already has is replaced: the PR
edits it); ``alternatives.md`` holds the PR's "Alternatives considered" and
``test_plan.md``, where present, more of its test plan (notes to the submitter);
``comment.md``, for a change that goes to an open PR's thread, what the comment says
besides the record's why and design (the exact count compared with that PR's, what
the tests show). ``--verify`` runs them in the
test environment ``hybridpd test`` gives the series (:func:`hybridpd.proof.testrun.pin_environment`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from hybridpd.errors import HybridpdError
from hybridpd.series.model import Pin

#: Where the upstream-style tests live: ``<series slug of the pin>/<patch id>/tests/...``.
UPSTREAM_TESTS_DIR = Path(__file__).parents[1] / "data" / "upstream_tests"
ALTERNATIVES_FILE = "alternatives.md"
TEST_PLAN_FILE = "test_plan.md"
#: What a comment for an open PR's thread says besides the record's why and design.
COMMENT_TEXT_FILE = "comment.md"
VERIFY_FILE = "verify.json"
#: Notes to the submitter (how the directory was made, DCO, GPU plan, hybridpd's own
#: measurements): what the PR text, ``PR.md``, must not carry.
NOTES_FILE = "SUBMITTING.md"
#: The comment for an open upstream PR's thread, written instead of ``PR.md`` for a
#: patch whose record names one (``upstream_thread``).
COMMENT_FILE = "COMMENT.md"
#: What export-pr wrote into a PR directory (path -> sha256), so that it replaces
#: only its own work there.
MANIFEST = ".hybridpd-export-pr.json"


class ExportPrError(HybridpdError):
    """A patch cannot be exported as a pull request."""


# Upstream-style material ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Material:
    """The upstream-style material of one patch on one pin."""

    tests: dict[str, bytes]  # path in the project's tree -> content
    alternatives: str | None
    test_plan: str | None = None
    comment: str | None = None


def material(key: str, patch_id: str, root: Path | None = None) -> Material:
    """The tests (files under ``tests/``), alternatives, test plan and comment text of
    ``patch_id`` on the pin whose series slug is ``key``."""
    base = (root or UPSTREAM_TESTS_DIR) / key / patch_id
    tests = {}
    if (base / "tests").is_dir():
        for path in sorted((base / "tests").rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                tests[path.relative_to(base).as_posix()] = path.read_bytes()

    def text(name: str) -> str | None:
        path = base / name
        if not path.is_file():
            return None
        return path.read_text(encoding="utf-8").strip() or None

    return Material(
        tests, text(ALTERNATIVES_FILE), text(TEST_PLAN_FILE), text(COMMENT_TEXT_FILE)
    )


def pytest_command(files: list[str] | tuple[str, ...]) -> str:
    """The test plan's command for ``files``, as a contributor types it in the tree root."""
    return "pytest -v " + " ".join(files)


# The directory and its commits ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrCommit:
    """One exported commit of a PR directory."""

    patch_id: str
    filename: str
    subject: str
    body: str
    tests: tuple[str, ...]
    files: tuple[str, ...]  # every path the commit changes, tests included
    #: The test files of ``tests`` the stock tree already has (the commit edits them).
    edited: tuple[str, ...] = ()


@dataclasses.dataclass
class PrExport:
    """One exported PR directory; the last commit is the patch's own."""

    patch_id: str
    pin: Pin
    dir: Path
    commits: list[PrCommit]
    prerequisites: list[str]
    warnings: list[str] = dataclasses.field(default_factory=list)
    verification: dict[str, Any] | None = None
    #: Where the upstream-style material comes from (None: UPSTREAM_TESTS_DIR).
    material_root: Path | None = None

    #: The open upstream PR this change goes to as a comment (the record's
    #: ``upstream_thread``); None: a PR of its own.
    thread: str | None = None

    @property
    def text_file(self) -> str:
        """``PR.md``, or ``COMMENT.md`` for a change that goes to an open PR's thread."""
        return COMMENT_FILE if self.thread else "PR.md"

    @property
    def own(self) -> PrCommit:
        return self.commits[-1]

    @property
    def tests(self) -> list[str]:
        """Every test file the directory's commits add, in commit order."""
        return list(dict.fromkeys(t for c in self.commits for t in c.tests))

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.patch_id,
            "pin": self.pin.version,
            "dir": str(self.dir),
            "files": [c.filename for c in self.commits]
            + [self.text_file, NOTES_FILE]
            + ([VERIFY_FILE] if self.verification else []),
            "prerequisites": self.prerequisites,
            "tests": self.tests,
            "warnings": self.warnings,
            "verification": self.verification,
        }


# The manifest -----------------------------------------------------------------------

def seal(target: Path) -> None:
    """Record every file of ``target`` as export-pr wrote it (:data:`MANIFEST`)."""
    files = {
        str(path.relative_to(target)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(target.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    }
    (target / MANIFEST).write_text(json.dumps({"files": files}, indent=2) + "\n")


def refuse_foreign(target: Path) -> None:
    """Raise ExportPrError when ``target`` holds anything export-pr did not write
    (a file added, or changed since, or a directory without :data:`MANIFEST`)."""
    if not target.is_dir() or not any(target.iterdir()):
        if target.exists() and not target.is_dir():
            raise ExportPrError(f"{target} exists and is not a directory; move it away")
        return
    try:
        written = json.loads((target / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        written = None
    if written is None:
        found = ["it was not written by export-pr"]
    else:
        found = [
            f"{rel} {'changed' if rel in written else 'added'}"
            for rel in (
                str(p.relative_to(target)) for p in sorted(target.rglob("*"))
                if p.is_file() and p.name != MANIFEST
            )
            if written.get(rel) != hashlib.sha256((target / rel).read_bytes()).hexdigest()
        ]
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise ExportPrError(
            f"{target} is not empty and holds work export-pr did not write ({shown}); "
            "move it away, or pass --force to replace it"
        )
