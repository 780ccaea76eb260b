"""Export carried patches as upstream pull requests, with their evidence.

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
* ``PR.md``: the PR body (what, why, design, alternatives, test plan, results).
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
``test_plan.md``, where present, more of its test plan. ``--verify`` runs them in the
test environment ``hybridpd test`` gives the series (:func:`hybridpd.proof.testrun.pin_environment`).

Measured numbers come only from committed ``report.json`` files of ``hybridpd e2e``
under ``reports/`` (and ``benchmarks/``) of the project; none are ever made up. A
report committed before the newest of the exported patch files is called stale. Those
reports measure vLLM's series (no run with LMCache's is committed): a PR to another
project cites none.

:func:`upstream_candidates` answers the other question of the upstreaming work: which
carried patches have no upstream release yet, and which can be dropped where.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib.machinery
import json
import re
import shlex
import shutil
import tempfile
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from hybridpd import gitops
from hybridpd.e2e import report as e2e_report
from hybridpd.errors import HybridpdError
from hybridpd.progress import Log, quiet
from hybridpd.proof.pytestrun import FINISHED, Counts
from hybridpd.series.apply import TRAILER
from hybridpd.series.checkout import checkout
from hybridpd.series.model import SERIES_FILE, Patch, Pin, Series

#: Where the upstream-style tests live: ``<series slug of the pin>/<patch id>/tests/...``.
UPSTREAM_TESTS_DIR = Path(__file__).parents[1] / "data" / "upstream_tests"
ALTERNATIVES_FILE = "alternatives.md"
TEST_PLAN_FILE = "test_plan.md"
#: Directories of the project searched for e2e / benchmark ``report.json`` files.
REPORT_DIRS = ("reports", "benchmarks")
VERIFY_FILE = "verify.json"
#: What export-pr wrote into a PR directory (path -> sha256), so that it replaces
#: only its own work there.
MANIFEST = ".hybridpd-export-pr.json"


class ExportPrError(HybridpdError):
    """A patch cannot be exported as a pull request."""


# Versions ---------------------------------------------------------------------------


def version_key(version: str) -> tuple[int, ...]:
    """A sortable key for release versions such as ``0.23.0`` (numeric parts only)."""
    return tuple(int(part) for part in re.findall(r"\d+", version))


def newest_pin(series: Series) -> Pin:
    """The ported pin with the highest version."""
    ported = [p for p in series.pins if p.ported]
    if not ported:
        raise ExportPrError("no pin is ported yet")
    return max(ported, key=lambda p: version_key(p.version))


# Upstream candidates ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Candidate:
    """Where one patch stands on its way upstream.

    ``since``: the earliest release recorded as having the change (None: no pin has
    it upstream). ``drop_from``: pins that still carry it although their version is at
    or after ``since``. ``keep_on``: pins that carry it and predate ``since``.
    """

    id: str
    title: str
    reference: str
    carried: tuple[str, ...]
    upstream: dict[str, str]
    since: str | None
    drop_from: tuple[str, ...]
    keep_on: tuple[str, ...]

    @property
    def status(self) -> str:
        """``candidate`` (carried, upstream nowhere yet: to be proposed), ``drop``
        (some pin carries it past its upstream release) or ``upstream``."""
        if self.since is None:
            return "candidate"
        return "drop" if self.drop_from else "upstream"

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "status": self.status,
            "reference": self.reference,
            "carried": list(self.carried),
            "upstream": dict(self.upstream),
            "since": self.since,
            "drop_from": list(self.drop_from),
            "keep_on": list(self.keep_on),
        }


def upstream_candidates(series: Series) -> list[Candidate]:
    """Every patch's upstream standing, from the records' states (reads nothing else).
    A patch no pin carries or has upstream (dropped everywhere) is left out."""
    result = []
    for patch in series.patches:
        if patch.pins and all(s.state == "dropped" for s in patch.pins.values()):
            continue
        carried = tuple(v for v, s in patch.pins.items() if s.state == "carried")
        upstream = {
            v: s.release or "?" for v, s in patch.pins.items() if s.state == "upstream"
        }
        since = min(upstream.values(), key=version_key) if upstream else None
        drop, keep = [], []
        for version in carried:
            if since is not None and version_key(version) >= version_key(since):
                drop.append(version)
            else:
                keep.append(version)
        result.append(
            Candidate(
                patch.id,
                patch.title,
                patch.upstream,
                carried,
                upstream,
                since,
                tuple(drop),
                tuple(keep) if since is not None else (),
            )
        )
    return result


def format_candidates(candidates: Sequence[Candidate]) -> list[str]:
    """Human lines for ``hybridpd list --upstream-candidates``."""
    lines = []
    for c in candidates:
        if c.since is None:
            lines.append(
                f"candidate  {c.id}: carried on {', '.join(c.carried) or '(no pin)'}; "
                f"no upstream release yet (reference: {c.reference})"
            )
            continue
        where = ", ".join(c.upstream)
        line = f"upstream   {c.id}: upstream since {c.since} (on {where})"
        if c.keep_on:
            line += f"; still needed on {', '.join(c.keep_on)} (older than {c.since})"
        lines.append(line)
        if c.drop_from:
            lines.append(
                f"drop       {c.id}: carried on {', '.join(c.drop_from)}, upstream since "
                f"{c.since} on {where}: drop from pins >= {c.since}"
            )
    return lines


# Upstream-style material ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Material:
    """The upstream-style material of one patch on one pin."""

    tests: dict[str, bytes]  # path in the project's tree -> content
    alternatives: str | None
    test_plan: str | None = None


def material(key: str, patch_id: str, root: Path | None = None) -> Material:
    """The tests (files under ``tests/``), alternatives and test plan of ``patch_id``
    on the pin whose series slug is ``key``."""
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

    return Material(tests, text(ALTERNATIVES_FILE), text(TEST_PLAN_FILE))


# Building the commits ---------------------------------------------------------------


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
    pin: str
    dir: Path
    commits: list[PrCommit]
    prerequisites: list[str]
    warnings: list[str] = dataclasses.field(default_factory=list)
    verification: dict[str, Any] | None = None
    #: Where the upstream-style material comes from (None: UPSTREAM_TESTS_DIR).
    material_root: Path | None = None

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
            "pin": self.pin,
            "dir": str(self.dir),
            "files": [c.filename for c in self.commits] + ["PR.md"]
            + ([VERIFY_FILE] if self.verification else []),
            "prerequisites": self.prerequisites,
            "tests": self.tests,
            "warnings": self.warnings,
            "verification": self.verification,
        }


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
) -> list[tuple[PrCommit, bytes]]:
    """Apply ``patch_ids`` onto ``base``, each as one commit without its trailer and
    with its upstream-style tests; return each commit and its format-patch bytes."""
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
            sha = gitops.amend_message(repo, message)
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


# Measurements -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Report:
    """A committed ``report.json`` of ``hybridpd e2e``; ``date`` is its commit date."""

    path: str  # relative to the project root
    date: datetime
    e2e: e2e_report.E2EReport

    @property
    def pin(self) -> str:
        return self.e2e.pin

    @property
    def scenario(self) -> str:
        return self.e2e.scenario


def _git_date(project: Path, rel: str) -> datetime | None:
    """Commit date of the last commit touching ``rel``; now when the file has
    uncommitted changes; None when ``project`` is not a repository or it is untracked."""
    if not gitops.is_repo(project):
        return None
    if not gitops.is_tracked(project, rel):
        return None
    if gitops.has_changes(project, rel):
        return datetime.now(timezone.utc)
    out = gitops.last_commit_date(project, rel)
    return datetime.fromisoformat(out) if out else None


def find_reports(project: Path, log: Log = quiet) -> list[Report]:
    """The committed e2e / benchmark reports of the project, newest first."""
    reports = []
    for directory in REPORT_DIRS:
        for path in sorted((project / directory).rglob("report.json")):
            rel = path.relative_to(project).as_posix()
            date = _git_date(project, rel)
            if date is None:
                log(f"export-pr: {rel} is not committed; not used (commit it to use it)")
                continue
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                log(f"export-pr: {rel} is not valid JSON ({exc}); not used")
                continue
            if not (isinstance(data, dict) and isinstance(data.get("runs"), list)):
                continue
            try:
                reports.append(Report(rel, date, e2e_report.E2EReport.from_json(data)))
            except (KeyError, TypeError, ValueError) as exc:
                log(f"export-pr: {rel} is not an e2e report ({exc!r}); not used")
    return sorted(reports, key=lambda r: r.date, reverse=True)


def latest_reports(reports: Sequence[Report], pin: str) -> list[Report]:
    """The newest report per scenario, preferring ``pin``'s own reports."""
    chosen: dict[str, Report] = {}
    for report in sorted(reports, key=lambda r: (r.pin == pin, r.date), reverse=True):
        chosen.setdefault(report.scenario, report)
    return list(chosen.values())


def e2e_command(report: Report) -> str:
    """The ``hybridpd e2e`` command line that produced the report: the one it records,
    else (a report older than that field) one rebuilt from its fields, and said so."""
    if report.e2e.command:
        return shlex.join(str(a) for a in report.e2e.command)
    return _rebuilt_command(report) + "  # rebuilt: the report does not record its command"


def _rebuilt_command(report: Report) -> str:
    e2e = report.e2e
    args = ["hybridpd", "e2e", "--pin", report.pin, "--device", e2e.device]
    model = e2e.model
    args += ["--tiny"] if "tiny" in model or "hybridpd-tiny" in model else ["--model", model]
    args += ["--scenario", report.scenario]
    for connector in dict.fromkeys(r.connector for r in e2e.runs):
        if connector:
            args += ["--connector", str(connector)]
    if {r.build for r in e2e.runs} >= {"stock", "patched"}:
        args += ["--compare", "stock"]
    return shlex.join(args)


def _report_table(report: Report) -> list[str]:
    try:
        return e2e_report.table(report.e2e)
    except (KeyError, TypeError, ValueError, AttributeError):
        # An older or partial report: show the request fields we know.
        lines = [
            "| build | connector | prompt tokens | decode local hit | KV bytes | TTFT (ms) |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for run in report.e2e.runs:
            for r in run.requests:
                lines.append(
                    f"| {run.build} | {run.connector} | {r.get('prompt_tokens')} "
                    f"| {r.get('decode_local_hit_tokens')} | {r.get('kv_bytes_transferred')} "
                    f"| {r.get('ttft_ms')} |"
                )
        return lines


# PR.md ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Upstream:
    """What PR.md says that depends on the project the PR goes to: the rules its
    contributing guide sets, its test plan beyond the added tests, and whether
    hybridpd's e2e reports measure it."""

    name: str
    #: The project's name in PR.md, linked to its repository where that is set.
    link: str
    #: A subject prefix its commit messages use (what ``--keep-non-patch`` keeps).
    prefix: str
    #: Quoted notes to the submitter after the DCO one.
    notes: tuple[str, ...]
    #: The "AI assistance" section.
    ai: str
    #: Whether the test plan carries vLLM's GPU plan and PR.md cites ``hybridpd e2e``
    #: reports (runs of vLLM's series).
    vllm_e2e: bool
    #: The Results section when no measurement is cited.
    no_results: str


VLLM = Upstream(
    name="vLLM",
    link="vLLM",
    prefix="[Core]",
    notes=(
        "> **AI attribution:** each commit ends with an `Assisted-by:` trailer placeholder; "
        "name the assisting tool there (or use `Co-authored-by:`, as vLLM's contributing "
        "guide shows) and tick \"AI assistance was used\" in the PR template.",
        "> **Before submitting:** a person must review every changed line, run the test "
        "plan below (GPU plan included) and be able to defend the change; vLLM does not "
        "accept pure agent PRs. Delete these quoted notes from the PR text.",
    ),
    ai=(
        "AI assistance was used to prepare this change, its tests and this description "
        "(vLLM's contributing guide, \"AI Assisted Contributions\"). The commits carry "
        "an `Assisted-by:` trailer. The submitter has reviewed every changed line and run "
        "the test plan above."
    ),
    vllm_e2e=True,
    no_results=(
        "No GPU measurement of this change is committed in the hybridpd repository "
        "yet, so this PR states none. Run the GPU plan above on `main` and on this "
        "branch and paste `vllm bench serve`'s summaries here."
    ),
)

LMCACHE = Upstream(
    name="LMCache",
    link="[LMCache](https://github.com/LMCache/LMCache)",
    prefix="[MP]",
    notes=(
        "> **Base branch:** LMCache takes pull requests against `dev` (its contributing "
        "guide); these commits apply to the release named above: rebase them onto `dev` "
        "and run the test plan there before opening the PR.",
        "> **AI attribution:** each commit ends with an `Assisted-by:` trailer placeholder; "
        "name the assisting tool there (or use `Co-authored-by:`). LMCache's contributing "
        "guide sets no attribution rule; the \"AI assistance\" section below discloses it.",
        "> **Before submitting:** a person must review every changed line, run the test "
        "plan below and be able to defend the change. Delete these quoted notes from the "
        "PR text.",
    ),
    ai=(
        "AI assistance was used to prepare this change, its tests and this description. "
        "The commits carry an `Assisted-by:` trailer. The submitter has reviewed every "
        "changed line and run the test plan above."
    ),
    vllm_e2e=False,
    no_results=(
        "No end-to-end measurement of this change is committed in the hybridpd "
        "repository as a report (its e2e serves vLLM through `LMCacheMPConnector` and "
        "an `lmcache server`, `hybridpd e2e --connector lmcache+nixl`, but no such run "
        "is committed), so this PR states no numbers; the Why section says what was "
        "observed. Besides the tests above, "
        "hybridpd's patch tests run a vLLM release's own KV cache allocation and layer "
        "binding against a real `lmcache server` (`tests/lmcache_patches/` in hybridpd): "
        "red on the stock release, green with its series."
    ),
)


def upstream_of(series: Series) -> Upstream:
    """The conventions of ``series``' project: LMCache's for its series, else vLLM's
    (the project hybridpd was made for, and the tool tests' fixture project)."""
    return LMCACHE if series.package == "lmcache" else VLLM


def series_option(series: Series) -> str:
    """``--series <dir> `` for hybridpd commands on ``series``, relative to the
    project that holds it; empty for the project's default series
    (``patches/series.toml``)."""
    for root in series.dir.parents:
        if (root / "patches" / SERIES_FILE).is_file():
            if series.path == root / "patches" / SERIES_FILE:
                return ""
            return f"--series {series.dir.relative_to(root).as_posix()} "
    return ""


def _checkout_hint(pin: str, patch_id: str, series: Series) -> str:
    tree = f"{series.package}-{pin}"
    return (
        f"hybridpd {series_option(series)}checkout {pin} --dir {tree} && cd {tree} && "
        f"git am --keep-non-patch ../{patch_id}/0*.patch"
    )


def render_pr(
    export: PrExport,
    patch: Patch,
    reports: Sequence[Report],
    stale: Sequence[str],
    series: Series,
) -> str:
    """The PR body of ``export`` (Markdown), for ``series``' project."""
    pin, own = export.pin, export.own
    upstream, option = upstream_of(series), series_option(series)
    out = [f"# {own.subject}", ""]
    out += [
        f"> Exported by `hybridpd export-pr` from the hybridpd series (patch `{export.patch_id}`, "
        f"{upstream.link} v{pin}). Apply: `{_checkout_hint(pin, export.patch_id, series)}` "
        f"(`--keep-non-patch` keeps the `{upstream.prefix}`-style subject prefixes). Re-check the "
        f"directory: `hybridpd {option}export-pr {export.patch_id} --pin {pin} --to DIR "
        "--verify`.",
        "> **DCO:** the commits carry no `Signed-off-by`; sign them off yourself before "
        "opening the PR (`git am --signoff ...`, or `git rebase --signoff` afterwards). "
        "The sign-off certifies the person who submits.",
        *upstream.notes,
    ]
    if export.prerequisites:
        deps = ", ".join(f"`{i}`" for i in export.prerequisites)
        out.append(
            f"> **Depends on** the PR of {deps}: its commit(s) come first in this directory "
            f"({', '.join(c.filename for c in export.commits[:-1])}) so that it applies to "
            f"stock v{pin}; open this PR on top of that one (or after it merges) and drop "
            "them from this branch."
        )
    for line in stale:
        out.append(f"> **Warning:** {line}")
    body, overlap = _split_overlap(strip_trailer(own.body, "Assisted-by"))
    out += ["", "## What", ""]
    out += [body or patch.title + ".", ""]
    changed = [f for f in own.files if f not in own.tests]
    out += ["Changed: " + ", ".join(f"`{f}`" for f in changed) + "."]
    added = [t for t in own.tests if t not in own.edited]
    if added:
        out += ["Tests added: " + ", ".join(f"`{t}`" for t in added) + "."]
    if own.edited:
        out += ["Tests edited: " + ", ".join(f"`{t}`" for t in own.edited) + "."]
    out += ["", "## Why", "", _text(patch.why), "", "## Design", "", _text(patch.design), ""]
    out += ["## Alternatives considered", ""]
    kept = material(series.slug(series.pin(pin)), export.patch_id, export.material_root)
    out += [kept.alternatives or "(none recorded for this patch yet)", ""]
    out += ["## Related", "", f"- Upstream reference: {patch.upstream}"]
    out += [f"- {paragraph}" for paragraph in overlap]
    out += [f"- Carried downstream (hybridpd) until: {_text(patch.removal)}", ""]
    out += _test_plan(export, upstream, kept.test_plan)
    out += _results(export, reports, upstream)
    out += ["## AI assistance", "", upstream.ai, ""]
    return "\n".join(out).rstrip() + "\n"


def _text(paragraph: str) -> str:
    """A series.toml paragraph (hard-wrapped) as one Markdown paragraph."""
    return " ".join(paragraph.split())


def _split_overlap(body: str) -> tuple[str, list[str]]:
    """``body`` without its ``Overlap:`` paragraphs, and those paragraphs (unwrapped):
    the PR's statement of what it shares with other open PRs, shown under Related."""
    kept, overlap = [], []
    for paragraph in body.strip().split("\n\n"):
        if paragraph.startswith("Overlap:"):
            overlap.append(_text(paragraph))
        else:
            kept.append(paragraph)
    return "\n\n".join(kept), overlap


#: The served model, flags and workload of the GPU plan: seed 000's measurement.
GPU_MODEL = "Qwen/Qwen3.5-35B-A3B"
GPU_SERVE_FLAGS = (
    "--enforce-eager --enable-prefix-caching --mamba-cache-mode align --block-size 128 "
    "--no-disable-hybrid-kv-cache-manager --async-scheduling"
)
GPU_KV_CONFIG = (
    '{"kv_connector":"MultiConnector","kv_role":"kv_both","kv_connector_extra_config":'
    '{"connectors":[{"kv_connector":"NixlConnector","kv_role":"kv_both"},'
    '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
    '"kv_connector_extra_config":{"cpu_bytes_to_use":100000000000}}]}}'
)
GPU_BENCH = (
    f"vllm bench serve --model {GPU_MODEL} --port 8192 --dataset-name prefix_repetition \\\n"
    "  --prefix-repetition-prefix-len 16384 --prefix-repetition-suffix-len 1024 \\\n"
    "  --prefix-repetition-num-prefixes 2 --prefix-repetition-output-len 1024 \\\n"
    "  --num-prompts 512 --max-concurrency 256"
)


def _gpu_plan() -> list[str]:
    """Commands of vLLM's tree for the GPU half of the test plan."""
    return [
        "GPU (2 GPUs, 1 prefill + 1 decode), from the vLLM tree root. vLLM's own hybrid "
        "PD prefix-cache test, and the NIXL + offloading gsm8k accuracy test on a small "
        "Qwen3.5 model (one with an expected value in `test_accuracy.py`):",
        "",
        "```bash",
        "bash tests/v1/kv_connector/nixl_integration/run_mamba_prefix_cache_test.sh",
        "MODEL_NAMES=Qwen/Qwen3.5-0.8B BLOCK_SIZE=128 "
        "VLLM_SERVE_EXTRA_ARGS=--enable-prefix-caching,--mamba-cache-mode,align \\",
        "  bash tests/v1/kv_connector/nixl_integration/run_multi_connector_accuracy_test.sh",
        "```",
        "",
        f"Performance, as the original report measured it ({GPU_MODEL}, prefix_repetition "
        "prefix 16 384, suffix 1 024, 512 prompts, concurrency 256), with "
        "MultiConnector[NixlConnector, OffloadingConnector] on both instances (for "
        "NIXL + LMCache MP, use `LMCacheMPConnector` as the second child, with "
        "lmcache installed and its server running). Run it on `main` and on this "
        "branch; compare TTFT, output throughput and the decode instance's prefix-cache "
        "hits (`vllm:prefix_cache_hits` on port 8200's `/metrics`):",
        "",
        "```bash",
        f"KV='{GPU_KV_CONFIG}'",
        f"CUDA_VISIBLE_DEVICES=0 VLLM_NIXL_SIDE_CHANNEL_PORT=5559 vllm serve {GPU_MODEL} "
        f"--port 8100 {GPU_SERVE_FLAGS} --kv-transfer-config \"$KV\" &",
        f"CUDA_VISIBLE_DEVICES=1 VLLM_NIXL_SIDE_CHANNEL_PORT=5659 vllm serve {GPU_MODEL} "
        f"--port 8200 {GPU_SERVE_FLAGS} --kv-transfer-config \"$KV\" &",
        "python3 tests/v1/kv_connector/nixl_integration/toy_proxy_server.py --port 8192 "
        "--prefiller-ports 8100 --decoder-ports 8200 &",
        GPU_BENCH,
        "```",
        "",
    ]


def _test_plan(
    export: PrExport, upstream: Upstream = VLLM, more: str | None = None
) -> list[str]:
    out = ["## Test plan", ""]
    if export.own.tests:
        files = " ".join(export.own.tests)
        out += [
            f"Unit tests {'added or edited' if export.own.edited else 'added'} by this PR "
            f"(CPU only, from the {upstream.name} tree root):",
            "",
            "```bash",
            f"pytest -v {files}",
            "```",
            "",
        ]
    else:
        out += ["No upstream-style unit test is kept for this patch on this pin yet.", ""]
    if more:
        out += [more, ""]
    if upstream.vllm_e2e:
        out += _gpu_plan()
    verification = export.verification
    if verification:
        out += [
            f"The added tests on stock and with this PR ({verification.get('date', '')}):",
            "",
        ]
        for label in ("stock", "without", "patched"):
            run = verification.get(label)
            if run:
                out.append(
                    f"- {run['tree']}: {run['passed']} passed, {run['failed']} failed, "
                    f"{run['errors']} errors, {run['skipped']} skipped"
                )
        edited = verification.get("edited")
        if edited and verification.get("stock"):
            red = [
                test for test, outcome in verification["stock"]["tests"].items()
                if outcome in ("failed", "error")
            ]
            out.append(
                "- the counts include the tests " + ", ".join(f"`{f}`" for f in edited)
                + " already had (this PR edits those files); red on stock: "
                + (", ".join(f"`{t}`" for t in red) or "none")
            )
        out += [f"- verdict: {'ok' if verification.get('ok') else 'FAILED'}", ""]
    return out


def _results(
    export: PrExport, reports: Sequence[Report], upstream: Upstream = VLLM
) -> list[str]:
    out = ["## Results", ""]
    if not reports:
        return out + [upstream.no_results, ""]
    for report in reports:
        other = "" if report.pin == export.pin else f" (measured on v{report.pin})"
        out += [
            f"`{report.path}`: scenario {report.scenario}, device "
            f"{report.e2e.device}, model `{report.e2e.model}`"
            f"{other}, committed {report.date.date().isoformat()}. OFF = stock "
            "(upstream's behaviour), ON = patched (the whole hybridpd series of that pin).",
            "",
            *_report_table(report),
            "",
            "Produced by:",
            "",
            "```bash",
            e2e_command(report),
            "```",
            "",
        ]
    return out


def stale_warnings(
    project: Path, series: Series, pin: Pin, export: PrExport, reports: Sequence[Report]
) -> list[str]:
    """One line per report older than the newest patch file of ``export``."""
    dates = []
    for commit in export.commits:
        rel = series.relative(series.patch_path(pin, commit.patch_id))
        date = _git_date(project, rel)
        if date is not None:
            dates.append((date, rel))
    if not dates:
        return []
    newest, rel = max(dates)
    return [
        f"the numbers in {r.path} ({r.date.date().isoformat()}) are older than {rel} "
        f"({newest.date().isoformat()}): re-run `{e2e_command(r)}`"
        for r in reports
        if r.date < newest
    ]


# Export -----------------------------------------------------------------------------


def export_prs(
    series: Series,
    pin: Pin,
    patch_ids: Sequence[str],
    stock: Path,
    out_dir: Path,
    log: Log = quiet,
    tests_root: Path | None = None,
    force: bool = False,
) -> list[PrExport]:
    """Write one PR directory per patch of ``patch_ids`` into ``out_dir``.

    ``stock`` is a checkout of ``pin`` (``hybridpd checkout``); it is left as it was
    (the work happens in a detached worktree of it). A directory is replaced only
    when export-pr wrote all of it (its :data:`MANIFEST` says so) or with ``force``;
    otherwise nothing is written (see :func:`refuse_foreign`).
    """
    out_dir = out_dir.absolute()
    carried = [p.id for p in series.carried(pin)]
    if not force:
        for patch_id in patch_ids:
            refuse_foreign(out_dir / patch_id)
    for patch_id in patch_ids:
        if patch_id not in carried:
            state = series.patch(patch_id)
            if state is None:
                raise ExportPrError(f"{patch_id} has no record in series.toml")
            pin_state = state.pins.get(pin.version)
            why = (
                f"upstream since {pin_state.release}" if pin_state and pin_state.release
                else "not carried"
            )
            raise ExportPrError(f"{patch_id} is {why} on {pin.version}: nothing to export")
    exports = []
    with tempfile.TemporaryDirectory(prefix="hybridpd-export-pr-") as tmp:
        work = Path(tmp) / "work"
        base = gitops.resolve(stock, pin.tag) or gitops.head(stock)
        with gitops.worktree(stock, base, work):
            for patch_id in patch_ids:
                deps = prerequisites(work, base, series, pin, patch_id)
                if deps:
                    log(f"export-pr: {patch_id} needs {', '.join(deps)} to apply on stock")
                built = build_commits(work, base, series, pin, [*deps, patch_id], tests_root)
                target = out_dir / patch_id
                if target.exists():
                    shutil.rmtree(target)
                target.mkdir(parents=True)
                for commit, content in built:
                    (target / commit.filename).write_bytes(content)
                export = PrExport(
                    patch_id,
                    pin.version,
                    target,
                    [c for c, _ in built],
                    deps,
                    material_root=tests_root,
                )
                if not export.own.tests:
                    export.warnings.append(
                        f"no upstream-style test kept for {patch_id} on {pin.version} "
                        f"(data/upstream_tests/{series.slug(pin)}/{patch_id}/tests/)"
                    )
                chosen, stale = pr_evidence(series, pin, export, log)
                export.warnings += stale
                for line in export.warnings:
                    log(f"warning: {patch_id}: {line}")
                write_pr(export, series, chosen, stale)
                seal(target)
                exports.append(export)
    return exports


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


def pr_evidence(
    series: Series, pin: Pin, export: PrExport, log: Log = quiet
) -> tuple[list[Report], list[str]]:
    """The reports ``export``'s PR.md shows, and the warnings about their age."""
    if not upstream_of(series).vllm_e2e:
        return [], []  # hybridpd e2e reports are runs of vLLM's series
    project = series.dir.parent
    found = []
    for report in find_reports(project, log):
        if report.e2e.device == "cpu":
            log(f"export-pr: {report.path} is a CPU run (timings of a tiny model are "
                "noise); not cited in PR.md")
        else:
            found.append(report)
    chosen = latest_reports(found, pin.version)
    return chosen, stale_warnings(project, series, pin, export, chosen)


def write_pr(
    export: PrExport, series: Series, reports: Sequence[Report], stale: Sequence[str]
) -> None:
    """(Re)write ``PR.md`` of ``export``."""
    patch = series.patch(export.patch_id)
    assert patch is not None
    (export.dir / "PR.md").write_text(
        render_pr(export, patch, reports, stale, series), encoding="utf-8"
    )


# Verification -----------------------------------------------------------------------

class SuiteLike(Protocol):
    """What verification reads of a test run (:class:`hybridpd.proof.pytestrun.SuiteResult`)."""

    outcomes: dict[str, str]
    status: str
    reason: str | None
    log_path: Path | None


#: Runs test files (paths relative to the tree) in a tree; ``label`` names the run.
Runner = Callable[[Path, Sequence[str], str], SuiteLike]


def _counts(outcomes: dict[str, str], files: Sequence[str]) -> dict[str, int]:
    return Counts.of(o for test_id, o in outcomes.items()
                     if test_id.split("::", 1)[0] in files).to_json()


def _run(
    runner: Runner, tree: Path, files: Sequence[str], label: str, name: str, logs: Path
) -> dict:
    """Run ``files`` in ``tree``; the counts, outcomes and log (copied into ``logs``)."""
    result = runner(tree, files, label)
    log_name = None
    if result.log_path and Path(result.log_path).is_file():
        logs.mkdir(parents=True, exist_ok=True)
        log_name = f"{logs.name}/{label}.log"
        shutil.copyfile(result.log_path, logs / f"{label}.log")
    if result.status not in FINISHED:
        raise ExportPrError(
            f"{label}: pytest did not finish ({result.status}): {result.reason}; log {log_name}"
        )
    return {
        "tree": name,
        **_counts(result.outcomes, files),
        "tests": {
            k: v for k, v in sorted(result.outcomes.items()) if k.split("::", 1)[0] in files
        },
        "log": log_name,
    }


def verify(
    export: PrExport,
    stock: Path,
    runner: Runner,
    series: Series,
    pin: Pin,
    log: Log = quiet,
) -> dict[str, Any]:
    """Prove ``export``'s directory on a stock tree; write and return ``verify.json``.

    Three runs in a detached worktree of ``stock`` at the pin: the directory's added
    tests on stock (at least one must fail); for a directory with prerequisites, the
    patch's own tests with only the prerequisites applied (at least one must fail);
    after ``git am`` of every file, all of them (all must pass). A test file the stock
    tree already has (the PR edits it) runs with its existing tests: ``edited`` lists
    those files.
    """
    started = datetime.now(timezone.utc)
    base = gitops.resolve(stock, pin.tag) or gitops.head(stock)
    tests = {}
    for commit in export.commits:
        tests.update(material(series.slug(pin), commit.patch_id, export.material_root).tests)
    files = list(tests)
    own = list(export.own.tests)
    report: dict[str, Any] = {
        "pin": pin.version,
        "patch": export.patch_id,
        "base": base,
        "tests": files,
        "date": started.isoformat(timespec="seconds"),
    }
    problems = []
    logs = export.dir / "verify-logs"
    if logs.exists():
        shutil.rmtree(logs)
    with tempfile.TemporaryDirectory(prefix="hybridpd-verify-") as tmp:
        tree = Path(tmp) / series.package
        with gitops.worktree(stock, base, tree):

            def place(paths: Sequence[str]) -> None:
                for rel in paths:
                    (tree / rel).parent.mkdir(parents=True, exist_ok=True)
                    (tree / rel).write_bytes(tests[rel])

            def reset() -> None:
                gitops.am_abort(tree)
                gitops.reset_hard(tree, base)
                gitops.clean(tree, "tests")

            if not files:
                problems.append("the directory adds no test")
            else:
                edited = [rel for rel in files if (tree / rel).exists()]
                if edited:
                    report["edited"] = edited
                place(files)
                log(f"verify {export.patch_id}: added tests on stock {pin.version}")
                report["stock"] = _run(
                    runner, tree, files, "stock", f"stock v{pin.version}", logs
                )
                if report["stock"]["failed"] + report["stock"]["errors"] == 0:
                    problems.append("no added test fails on stock")
                reset()
                if export.prerequisites and own:
                    firsts = [export.dir / c.filename for c in export.commits[:-1]]
                    result = gitops.am(tree, firsts, three_way=False)
                    if not result.ok:
                        problems.append(
                            "the prerequisites do not apply on stock: "
                            + gitops.first_error_line(result.stderr)
                        )
                    else:
                        place(own)
                        log(f"verify {export.patch_id}: own tests with only "
                            f"{', '.join(export.prerequisites)} applied")
                        report["without"] = _run(
                            runner, tree, own, "without",
                            f"v{pin.version} + {', '.join(export.prerequisites)}", logs,
                        )
                        without = report["without"]
                        if without["failed"] + without["errors"] == 0:
                            problems.append(
                                "no test of the patch fails with only its prerequisites"
                            )
                    reset()
            patches = [export.dir / c.filename for c in export.commits]
            result = gitops.am(tree, patches, three_way=False)
            report["applies"] = result.ok
            if not result.ok:
                problems.append(
                    f"git am failed on stock: {gitops.first_error_line(result.stderr)}"
                )
            elif files:
                log(f"verify {export.patch_id}: added tests after git am")
                report["patched"] = _run(
                    runner, tree, files, "patched",
                    f"v{pin.version} + {export.dir.name}/*.patch", logs,
                )
                patched = report["patched"]
                if patched["failed"] + patched["errors"] or not patched["passed"]:
                    problems.append("the added tests do not all pass after git am")
    report["problems"] = problems
    report["ok"] = not problems
    report["seconds"] = round((datetime.now(timezone.utc) - started).total_seconds(), 1)
    (export.dir / VERIFY_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    export.verification = report
    return report


def format_verification(report: dict[str, Any]) -> str:
    """One line summing up a ``verify.json``."""
    parts = []
    for label in ("stock", "without", "patched"):
        run = report.get(label)
        if run:
            parts.append(
                f"{label}: {run['failed'] + run['errors']} failed / {run['passed']} passed"
            )
    if report.get("applies") is False:
        parts.append("git am failed")
    verdict = "ok" if report.get("ok") else "FAILED: " + "; ".join(report.get("problems", []))
    return f"verify ({report.get('seconds')} s): {', '.join(parts)} -> {verdict}"


def pytest_runner(
    series: Series, pin: Pin, stock: Path, work: Path, log: Log = quiet
) -> Runner:
    """A :data:`Runner` on the CPU test environment ``hybridpd test`` runs ``series``
    on ``pin`` in (built or reused). A project tested inside a vLLM pin (LMCache) gets
    that pin's environment, its stock vLLM tree and the layers after the tree on
    ``PYTHONPATH`` (its own dependencies live there), and its compiled modules from the
    layer's release build (:func:`link_compiled`)."""
    from hybridpd.proof import hfsnap, pytestrun, testrun

    hosted = series.tests.host_series is not None
    venv, layers = testrun.pin_environment(series, pin, stock, work, log, with_layers=hosted)
    hf_home = work / "hf"
    hfsnap.write_snapshots(hf_home)

    def run(tree: Path, files: Sequence[str], label: str):
        if hosted:
            link_compiled(tree, series.package, pin.version, layers)
        out = work / "runs" / tree.parent.name
        return pytestrun.run_pytest(
            venv, tree, files, out, hf_home=hf_home, label=label, layers=layers, log=log
        )

    return run


def link_compiled(tree: Path, package: str, version: str, layers: Sequence[Path]) -> list[Path]:
    """Link into ``tree``'s ``package`` the compiled modules of the first layer that
    installs ``package``; return the links made.

    A source tree has no compiled modules (``pip install -e .`` builds them in place).
    The series' patches change Python files only, so the release's own build of the
    same version stands in: ExportPrError when the layer holds another version, or no
    layer holds a build with compiled modules.
    """
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    for layer in layers:
        modules = sorted(
            p for p in (Path(layer) / package).glob("*")
            if p.is_file() and p.name.endswith(suffixes)
        )
        if not modules:
            continue
        found = sorted(Path(layer).glob(f"{package}-*.dist-info"))
        built = found[0].name[len(package) + 1: -len(".dist-info")] if found else None
        if built != version:
            raise ExportPrError(
                f"{layer} holds {package} {built or '(no version)'}, not {version}: "
                "its compiled modules cannot stand in for the tree's"
            )
        links = []
        for module in modules:
            link = Path(tree) / package / module.name
            if not link.exists():
                link.symlink_to(module)
                links.append(link)
        return links
    raise ExportPrError(
        f"no layer of the test environment holds a {package} {version} build with "
        "compiled modules"
    )


# The command ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExportPrResult:
    """What ``hybridpd export-pr`` wrote (the ``--json`` contract)."""

    pin: str
    exports: tuple[PrExport, ...]

    @property
    def failed(self) -> list[str]:
        """The patches whose ``--verify`` failed."""
        return [e.patch_id for e in self.exports if e.verification and not e.verification["ok"]]

    def to_json(self) -> dict[str, Any]:
        return {"pin": self.pin, "exports": [e.to_json() for e in self.exports]}


def run(
    series: Series,
    version: str | None,
    patch_id: str | None,
    out_dir: Path,
    verify_them: bool = False,
    log: Log = quiet,
    force: bool = False,
) -> ExportPrResult:
    """Export ``patch_id`` (None: every patch carried on the pin) of ``version`` (None:
    the newest pin) into ``out_dir``, from a fresh stock checkout, and with
    ``verify_them`` prove each directory on it (see :func:`verify`)."""
    pin = series.pin(version) if version else newest_pin(series)
    ids = [patch_id] if patch_id else [p.id for p in series.carried(pin)]
    with tempfile.TemporaryDirectory(prefix="hybridpd-export-pr-") as tmp:
        stock = Path(tmp) / "stock"
        log(f"export-pr: checking out stock {pin.version}")
        checkout(series, pin.version, stock, source="sdist")
        exports = export_prs(series, pin, ids, stock, out_dir, log=log, force=force)
        if verify_them:
            runner = pytest_runner(series, pin, stock, Path(tmp), log=log)
            for export in exports:
                verify(export, stock, runner, series, pin, log=log)
                write_pr(export, series, *pr_evidence(series, pin, export))
                seal(export.dir)
    return ExportPrResult(pin.version, tuple(exports))
