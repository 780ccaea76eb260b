"""The evidence a PR cites: measured results from committed e2e reports, and the
warnings about their age.

Measured numbers come only from committed ``report.json`` files of ``hybridpd e2e``
under ``reports/`` (and ``benchmarks/``) of the project; none are ever made up. A
report committed before the newest of the exported patch files is called stale. Those
reports measure vLLM's series (no run with LMCache's is committed): a PR to another
project cites none.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from hybridpd import gitops
from hybridpd.e2e import report as e2e_report
from hybridpd.progress import Log, quiet
from hybridpd.series.model import Pin, Series
from hybridpd.upstreaming.conventions import upstream_of
from hybridpd.upstreaming.layout import PrExport

#: Directories of the project searched for e2e / benchmark ``report.json`` files.
REPORT_DIRS = ("reports", "benchmarks")


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


def latest_reports(reports: Sequence[Report], pin: Pin) -> list[Report]:
    """The newest report per scenario, preferring ``pin``'s own reports."""
    chosen: dict[str, Report] = {}
    for report in sorted(reports, key=lambda r: (r.pin == pin.version, r.date), reverse=True):
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
    chosen = latest_reports(found, pin)
    return chosen, stale_warnings(project, series, pin, export, chosen)
