"""Verification (``--verify``): a PR directory's upstream-style tests run on a stock
tree (red), with only its prerequisites (red), and after ``git am`` (green), in the test
environment ``hybridpd test`` gives the series; ``verify.json``."""

from __future__ import annotations

import importlib.machinery
import json
import shutil
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from hybridpd import gitops, scratch
from hybridpd.progress import Log, quiet
from hybridpd.proof.pytestrun import FINISHED, Counts
from hybridpd.series.model import Pin, Series
from hybridpd.upstreaming.layout import (
    VERIFY_FILE,
    ExportPrError,
    PrExport,
    material,
    pytest_command,
)


class SuiteLike(Protocol):
    """What verification reads of a test run (:class:`hybridpd.proof.pytestrun.SuiteResult`)."""

    outcomes: dict[str, str]
    status: str
    reason: str | None
    log_path: Path | None


#: Runs test files (paths relative to the tree) in a tree; ``label`` names the run.
Runner = Callable[[Path, Sequence[str], str], SuiteLike]

#: Runs the project's own checks (:func:`hybridpd.upstreaming.checks.run_checks`) in a
#: tree on the files (relative to it) the exported commits touch.
Checker = Callable[[Path, Sequence[str]], dict]


def _counts(outcomes: dict[str, str], files: Sequence[str]) -> dict[str, int]:
    return Counts.of(o for test_id, o in outcomes.items()
                     if test_id.split("::", 1)[0] in files).to_json()


def _run(
    runner: Runner, tree: Path, files: Sequence[str], label: str, name: str, logs: Path,
    red: bool = False,
) -> dict:
    """Run ``files`` in ``tree``; the counts, outcomes and log (copied into ``logs``).

    A run that must fail (``red``: the tests on a tree without the patch) may end in a
    collection error: a test module importing what the patch adds cannot import on
    stock, which is a failure of the tests (counted as errors), not an unfinished run.
    """
    result = runner(tree, files, label)
    log_name = None
    if result.log_path and Path(result.log_path).is_file():
        logs.mkdir(parents=True, exist_ok=True)
        log_name = f"{logs.name}/{label}.log"
        shutil.copyfile(result.log_path, logs / f"{label}.log")
    collection_error = (
        red and result.status == "interrupted"
        and any(o == "error" for k, o in result.outcomes.items()
                if k.split("::", 1)[0] in files)
    )
    if result.status not in FINISHED and not collection_error:
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
    checks: Checker | None = None,
) -> dict[str, Any]:
    """Prove ``export``'s directory on a stock tree; write and return ``verify.json``.

    Three runs in a detached worktree of ``stock`` at the pin: the directory's added
    tests on stock (at least one must fail); for a directory with prerequisites, the
    patch's own tests with only the prerequisites applied (at least one must fail);
    after ``git am`` of every file, all of them (all must pass). A test file the stock
    tree already has (the PR edits it) runs with its existing tests: ``edited`` lists
    those files. With ``checks``, the project's own checks then run on the files the
    commits touch (``checks`` in the report); each finding is a problem of its own.
    The test plan's command is recorded as ``command``.
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
        "command": pytest_command(files),
        "date": started.isoformat(timespec="seconds"),
    }
    problems = []
    logs = export.dir / "verify-logs"
    if logs.exists():
        shutil.rmtree(logs)
    with scratch.tree("verify-") as tmp:
        tree = tmp / series.package
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
                    runner, tree, files, "stock", f"stock v{pin.version}", logs, red=True
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
                            red=True,
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
            if result.ok and checks is not None:
                touched = list(dict.fromkeys(f for c in export.commits for f in c.files))
                log(f"verify {export.patch_id}: the project's own checks on "
                    f"{len(touched)} touched files")
                report["checks"] = checks(tree, touched)
                problems += report["checks"]["findings"]
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
    checks = report.get("checks")
    if checks:
        parts.append(f"{len(checks['checks'])} project checks: "
                     f"{len(checks['findings'])} findings")
    problems = report.get("problems", [])
    findings = set(checks["findings"]) if checks else set()
    other = [p for p in problems if p not in findings]
    verdict = "ok" if report.get("ok") else "FAILED" + (": " + "; ".join(other) if other else "")
    return f"verify ({report.get('seconds')} s): {', '.join(parts)} -> {verdict}"


def finding_lines(report: dict[str, Any]) -> list[str]:
    """The project checks' findings of a ``verify.json``, one line each."""
    return list((report.get("checks") or {}).get("findings", []))


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
            link_compiled(tree, series.package, pin, layers)
        out = work / "runs" / tree.parent.name
        return pytestrun.run_pytest(
            venv, tree, files, out, hf_home=hf_home, label=label, layers=layers, log=log
        )

    return run


def link_compiled(tree: Path, package: str, pin: Pin, layers: Sequence[Path]) -> list[Path]:
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
        if built != pin.version:
            raise ExportPrError(
                f"{layer} holds {package} {built or '(no version)'}, not {pin.version}: "
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
        f"no layer of the test environment holds a {package} {pin.version} build with "
        "compiled modules"
    )
