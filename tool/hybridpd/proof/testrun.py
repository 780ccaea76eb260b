"""``hybridpd test``: prove a pin's series on real vLLM code, stock beside patched.

Trees. For a pin the run uses scratch git trees under ``<cache>/trees/<version>/``:
``stock`` (the release as checked out from its sdist) and ``patched`` (the same plus
the carried series, applied by :func:`hybridpd.series.apply.apply`). For the patch suite it
also checks out, for every carried patch, the tree *without* it (the series up to the
patch before it), so each patch's tests are shown red because that patch is missing,
not because an earlier one is. Trees are rebuilt on every run: tests write into their
working directory, and a fresh apply is part of what is proven.

Environment. One CPU test environment per pin (:mod:`hybridpd.proof.testenv`) serves every
tree: vLLM is never installed in it, ``PYTHONPATH`` selects the tree
(:mod:`hybridpd.proof.pytestrun`). The same interpreter and dependencies run stock and
patched, so a difference in outcome comes from the vLLM source alone.

Suites.
- ``patches``: the project's ``tests/patches`` on every tree. Each test names its patch
  (``@pytest.mark.patch(id)``, recorded as a JUnit property). A carried patch is
  *proven* when at least one of its tests fails on stock and on the tree without it, and
  passes patched; the suite passes when every carried patch is proven and no test fails
  patched (a test that names no patch holds the patched build to a behaviour the series
  keeps: it must also pass patched wherever it passes on stock).
- ``upstream``: vLLM's own tests for the touched modules (:mod:`hybridpd.proof.upstream`), on
  stock (or its committed baseline) and patched: the patched run must pass every test
  the stock run passes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import shutil
import threading
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

from hybridpd import cache, gitops
from hybridpd.errors import HybridpdError
from hybridpd.progress import Log, quiet
from hybridpd.proof import hfsnap, testenv, upstream
from hybridpd.proof.pytestrun import Counts, SuiteResult, parse_junit, run_pytest
from hybridpd.series.apply import apply, patch_commits
from hybridpd.series.checkout import checkout
from hybridpd.series.model import Pin, Series, release_key
from hybridpd.series.model import load as load_series

SUITES = ("patches", "upstream", "all")
PATCH_PROPERTY = "patch"


class TestRunError(HybridpdError):
    """A suite could not run to the end (environment, crash, timeout)."""


@dataclasses.dataclass
class PatchRow:
    """One patch in the red/green table.

    A carried patch is ``proven`` when one of its tests fails on stock and on
    the tree without it, and passes patched. A patch upstream on the pin has
    no tree without it (``without`` is None): its tests must pass on stock
    (the release itself proves the record), at least one of them; a test that
    stock skips because it needs a patch the pin carries (a scheduler that
    refuses the request before the code under test is reached) proves it by
    passing patched, the release with every other patch (``release_proves``).
    """

    id: str
    state: str
    tests: list[str]
    stock: Counts
    without: Counts | None
    patched: Counts
    proven: bool
    release_proves: bool = False

    @property
    def ok(self) -> bool:
        if self.patched.failed:
            return False
        if self.state == "upstream":
            return self.release_proves
        return self.proven or self.state == "dropped"

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "state": self.state,
            "tests": self.tests,
            # The table counts an error as a failure (_TABLE_OUTCOME).
            "stock": self.stock.to_json(errors=False),
            "without": self.without.to_json(errors=False) if self.without else None,
            "patched": self.patched.to_json(errors=False),
            "red_green": self.proven,
        }


@dataclasses.dataclass
class TestReport:
    """What ``hybridpd test`` found for one pin."""

    pin: str
    suite: str
    patches: list[PatchRow] = dataclasses.field(default_factory=list)
    upstream: upstream.UpstreamReport | None = None
    problems: list[str] = dataclasses.field(default_factory=list)
    project: str = "vLLM"

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        data: dict = {
            "project": self.project,
            "pin": self.pin,
            "suite": self.suite,
            "ok": self.ok,
            "problems": self.problems,
            "patches": [row.to_json() for row in self.patches],
        }
        if self.upstream is not None:
            data["upstream"] = upstream_json(self.upstream)
        return data


def upstream_json(report: upstream.UpstreamReport) -> dict:
    """``{"stock": {passed, failed, skipped}, "patched": {...}, ...}``; a committed
    baseline stands in for stock when no stock run was made."""

    def counts(result: SuiteResult) -> dict[str, int]:
        return {
            "passed": result.passed,
            "failed": result.failed_total,
            "skipped": result.skipped,
        }

    if report.stock is not None:
        stock = counts(report.stock)
    else:
        stock = dict(upstream.read_baseline(report.baseline)["counts"])
        stock["failed"] = stock.get("failed", 0) + stock.pop("errors", 0)
    return {
        "stock": stock,
        "patched": counts(report.patched),
        "stock_source": "run" if report.stock is not None else "baseline",
        "files": report.files,
        "regressions": sorted(report.comparison.regressions),
    }


#: Set for a run on a tree without one patch: the patch tests' conftest keeps only the
#: tests of that patch (``tests/patches/conftest.py``, ``tests/lmcache_patches``).
ONLY_PATCH_ENV = "HYBRIDPD_PATCH_TESTS_OF"
#: Set to "0" on the trees where a patch's tests must fail (stock, without the patch):
#: a failing property example is printed as found, not shrunk. Only the outcome counts
#: there; shrinking the counterexamples a missing patch produces cost ~1 min per pin.
NO_SHRINK_ENV = "HYBRIDPD_HYPOTHESIS_SHRINK"
#: pytest runs of one suite side by side (one per core of a 2-core CI machine; each
#: run is one single-threaded process over its own tree).
TREE_JOBS = 2


def side_by_side(calls: Sequence, jobs: int = TREE_JOBS) -> list:
    """``call(stop)`` for each of ``calls`` on ``jobs`` threads, results in order.

    ``stop`` is a :class:`threading.Event` for :func:`run_pytest`: when one call
    raises, or this thread is interrupted (Ctrl-C, SIGTERM), the others' pytest
    processes are ended before the exception goes on.
    """
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(call, stop) for call in calls]
        try:
            concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
            for future in futures:
                if future.done() and future.exception() is not None:
                    raise future.exception()
            return [future.result() for future in futures]
        except BaseException:
            stop.set()
            for future in futures:
                future.cancel()
            raise


def patch_tests_dir(series: Series) -> Path:
    """The series' patch tests (``tests/patches`` for vLLM; see ``[test]``)."""
    return series.tests.patch_tests


def prepare_trees(series: Series, pin: Pin, root: Path, log: Log) -> dict:
    """Fresh ``stock`` and ``patched`` trees of ``pin`` under ``root``, plus one tree
    per carried patch without it. Returns ``{"stock", "patched", "without": {id: path}}``."""
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    stock = root / "stock"
    log(f"test: checking out {pin.version} (stock) in {stock}")
    checkout(series, pin, stock, source="sdist")
    patched = root / "patched"
    gitops.clone_local(stock, patched, "hybridpd")
    log(f"test: applying the {pin.version} series in {patched}")
    apply(series, patched, pin)
    commits = {patch_id: c.sha for patch_id, c in patch_commits(patched, pin)}
    without: dict[str, Path] = {}
    previous = pin.tag
    for patch in series.carried(pin):
        if previous == pin.tag:
            without[patch.id] = stock
        else:
            path = root / f"without-{patch.id}"
            gitops.add_worktree(patched, path, previous)
            without[patch.id] = path
        previous = commits[patch.id]
    return {"stock": stock, "patched": patched, "without": without}


def patch_properties(junit: Path) -> dict[str, str]:
    """Test id -> patch id, from the ``patch`` JUnit property of each test case."""
    mapping: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        for prop in case.iter("property"):
            if prop.get("name") == PATCH_PROPERTY:
                name = f"{case.get('classname')}::{case.get('name')}"
                mapping[name] = prop.get("value", "")
    return mapping


#: pytestrun's outcome vocabulary folded into the table's: an error (setup,
#: teardown) did not pass, an xfail counts as a skip.
_TABLE_OUTCOME = {"error": "failed", "xfailed": "skipped"}


def _case_outcomes(junit: Path) -> dict[str, str]:
    """Test id (``classname::name``, the key of :func:`patch_properties`) ->
    passed|failed|skipped. With no files to match, ``parse_junit`` keeps the
    JUnit ``classname::name`` as the id."""
    outcomes = parse_junit(junit).outcomes
    return {test: _TABLE_OUTCOME.get(o, o) for test, o in outcomes.items()}


def _counts(outcomes: dict[str, str], tests: Sequence[str]) -> Counts:
    # A test missing from a run (its module failed to import) did not pass.
    return Counts.of(outcomes.get(test, "failed") for test in tests)


def run_patch_suite(
    series: Series,
    pin: Pin,
    venv: Path,
    trees: dict,
    out_dir: Path,
    hf_home: Path,
    log: Log,
    layers: Sequence[Path] = (),
) -> tuple[list[PatchRow], list[str]]:
    """Run ``tests/patches`` on every tree and build the red/green table (with the
    pin's :data:`~hybridpd.proof.testenv.LAYERS` on ``PYTHONPATH``)."""
    tests_dir = patch_tests_dir(series)
    targets = [str(tests_dir)]

    def run(tree: Path, label: str, only: str | None = None, shrink: bool = True):
        env = {ONLY_PATCH_ENV: only} if only else {}
        if not shrink:
            env[NO_SHRINK_ENV] = "0"

        def call(stop: threading.Event) -> dict[str, str]:
            result = run_pytest(
                venv, tree, targets, out_dir, hf_home=hf_home, label=label, layers=layers,
                env_overrides=env, log=log, stop=stop,
            )
            junit = out_dir / f"{label}.junit.xml"
            if not result.finished or not junit.is_file():
                raise TestRunError(
                    f"patch tests on {label} did not finish ({result.status}): "
                    f"{result.reason}; log {result.log_path}"
                )
            return _case_outcomes(junit)

        return call

    stock, patched = side_by_side([
        run(trees["stock"], "patches-stock", shrink=False),
        run(trees["patched"], "patches-patched"),
    ])
    mapping = patch_properties(out_dir / "patches-patched.junit.xml")
    without: dict[str, dict[str, str]] = {}
    runs = {}
    for patch in series.carried(pin):
        tree = trees["without"][patch.id]
        if tree == trees["stock"]:
            without[patch.id] = stock
        elif patch.id not in mapping.values():
            without[patch.id] = {}  # no test of its own: nothing to decide there
        else:
            # Only the patch's own tests decide on the tree without it (red_green reads
            # no other outcome of that run): the others are deselected.
            runs[patch.id] = run(
                tree, f"patches-without-{patch.id}", only=patch.id, shrink=False
            )
    without.update(zip(runs, side_by_side(list(runs.values()))))
    return red_green(series, pin, mapping, stock, without, patched)


def _release_proves(tests: list[str], stock: dict[str, str], patched: dict[str, str]) -> bool:
    """No test of an upstream patch fails on stock, and one passes there, or one that
    stock skips passes on the release with every other patch (see :class:`PatchRow`)."""
    return bool(tests) and all(stock.get(t) in ("passed", "skipped") for t in tests) and any(
        stock.get(t) == "passed" or (stock.get(t) == "skipped" and patched.get(t) == "passed")
        for t in tests)


def _upstream_claim_problems(
    patch_id: str, pin: Pin, release: str | None, tests: list[str],
    stock: dict[str, str], release_proves: bool, carriers: Sequence[str] = (),
) -> list[str]:
    """A patch recorded upstream on a pin is proven there only by its own tests passing
    on the stock release: one that fails (or does not run) there, or none that passes,
    makes the record a claim nobody checked. ``release_proves``: the row's verdict
    (:func:`_release_proves`: a test stock skips for want of a carried patch it needs
    counts where it passes patched).
    ``carriers``: the ported pins that carry the patch, for the port that carries it
    again where the release has it only partly."""
    claim = f"{patch_id}: recorded upstream in {pin.version} (since {release})"
    if not tests:
        return [f"{claim}, but no test names it"]
    # A test a release does not cover is skipped (vllm_versions): neither proof nor failure.
    failing = [t for t in tests if stock.get(t) not in ("passed", "skipped")]
    if failing:
        # A port onto a ported pin goes forward only (port.start refuses the other way).
        older = sorted((c for c in carriers if release_key(c) < release_key(pin.version)),
                       key=release_key)
        again = (f"; if {pin.version} has the fix only in part, carry the patch again: "
                 f"`hybridpd port --from {older[-1]} --to {pin.version} --replace`, resolving "
                 "it instead of skipping it" if older else "")
        return [f"{claim}, but {len(failing)} of its tests do not pass on stock "
                f"{pin.version}: {', '.join(failing)}{again}"]
    if not release_proves:
        return [f"{claim}, but none of its tests runs on {pin.version}"]
    return []


def red_green(
    series: Series,
    pin: Pin,
    mapping: dict[str, str],
    stock: dict[str, str],
    without: dict[str, dict[str, str]],
    patched: dict[str, str],
) -> tuple[list[PatchRow], list[str]]:
    """The red/green table from per-tree outcomes (test id -> outcome);
    ``mapping`` names each test's patch, ``without`` holds, per carried patch,
    the outcomes on the tree without it. Returns the rows and the problems."""
    problems: list[str] = []
    rows: list[PatchRow] = []
    for patch, state in series.records(pin):
        tests = sorted(t for t, p in mapping.items() if p == patch.id)
        before = without.get(patch.id) if state.state == "carried" else None
        proven = before is not None and any(
            stock.get(t) != "passed"
            and before.get(t) != "passed"
            and patched.get(t) == "passed"
            for t in tests
        )
        row = PatchRow(
            patch.id,
            state.state,
            tests,
            _counts(stock, tests),
            None if before is None else _counts(before, tests),
            _counts(patched, tests),
            proven,
            state.state == "upstream" and _release_proves(tests, stock, patched),
        )
        rows.append(row)
        if state.state == "carried" and not proven:
            problems.append(
                f"{patch.id}: no test is red on stock and without the patch, "
                "and green patched"
                if tests
                else f"{patch.id}: no test names this patch"
            )
        if row.patched.failed:
            problems.append(f"{patch.id}: {row.patched.failed} test(s) fail patched")
        if state.state == "upstream":
            carriers = [p.version for p in series.pins
                        if p.ported and patch.pins.get(p.version) is not None
                        and patch.pins[p.version].state == "carried"]
            problems += _upstream_claim_problems(patch.id, pin, state.release,
                                                 tests, stock, row.release_proves,
                                                 carriers)
    unknown = sorted(set(mapping.values()) - {p.id for p in series.patches})
    problems += [f"tests name {p}, which has no record in series.toml" for p in unknown]
    # A test that names no patch holds the patched build to a behaviour the series
    # keeps (e.g. stock's refusal of what a dropped patch got wrong): it never fails
    # patched, and passes patched wherever it passes on stock (missing is not passing).
    guards = sorted((set(stock) | set(patched)) - set(mapping))
    broken = [
        t for t in guards
        if patched.get(t) == "failed"
        or (stock.get(t) == "passed" and patched.get(t) != "passed")
    ]
    if broken:
        problems.append(
            f"{len(broken)} test(s) that name no patch do not pass patched "
            "(each fails patched, or passes on stock and not patched; a strict xfail of a "
            f"known upstream issue that passes means the pin fixed it): {', '.join(broken)}"
        )
    return rows, problems


def run(
    series: Series,
    pin: Pin,
    suite: str = "all",
    *,
    full_upstream: bool = False,
    stock_baseline: bool = False,
    torch_spec: str | None = None,
    log: Log = quiet,
) -> TestReport:
    """Prepare trees and the test environment of ``pin`` and run ``suite``.

    ``full_upstream`` runs vLLM's whole selection instead of the reduced one;
    ``stock_baseline`` compares the patched upstream run with the committed stock
    baseline instead of running stock again (stock runs when the pin has none).
    """
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite}")
    if series.tests.host_series is not None and suite == "upstream":
        raise TestRunError(
            f"{series.project} has no upstream suite here: run --suite patches"
        )
    root = cache.cache_dir() / "trees" / series.slug(pin)
    root.parent.mkdir(parents=True, exist_ok=True)
    # The trees and the run's outputs are rebuilt from scratch: one run per pin at a
    # time (a second waits for the first instead of deleting its trees under it).
    with cache.lock(root, log):
        return _run_locked(series, pin, suite, root, full_upstream, stock_baseline,
                           torch_spec, log)


def pin_environment(
    series: Series,
    pin: Pin,
    stock: Path,
    root: Path,
    log: Log = quiet,
    torch_spec: str | None = None,
    with_layers: bool = True,
) -> tuple[Path, list[Path]]:
    """The test environment of ``pin`` (its venv, built or reused) and what goes after
    the tree under test on ``PYTHONPATH``.

    ``stock`` is the pin's stock tree. A project tested inside a vLLM pin (LMCache)
    runs in that pin's environment, with the pin's stock vLLM tree (checked out under
    ``root``) first after its own tree; ``with_layers`` adds the environment's
    :data:`~hybridpd.proof.testenv.LAYERS` after it.
    """
    env_pin, env_tree, host_tree = pin, stock, []
    if series.tests.host_series is not None:
        host = load_series(series.tests.host_series)
        env_pin = host.pin(series.tests.host_pin)
        env_tree = root / f"host-{host.slug(env_pin)}"
        log(f"test: checking out {host.project} {env_pin.version} (stock) in {env_tree}")
        checkout(host, env_pin, env_tree, source="sdist")
        host_tree = [env_tree]
    try:
        venv = testenv.ensure_test_env(env_pin, env_tree, cache.cache_dir(), torch_spec, log)
        layers = testenv.ensure_layers(venv, env_pin, log) if with_layers else []
    except testenv.TestEnvError as exc:
        raise TestRunError(f"test environment for {env_pin.version}: {exc}") from exc
    return venv, host_tree + layers


def _run_locked(
    series: Series, pin: Pin, suite: str, root: Path, full_upstream: bool,
    stock_baseline: bool, torch_spec: str | None, log: Log,
) -> TestReport:
    out_dir = cache.cache_dir() / "runs" / series.slug(pin)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    hf_home = out_dir / "hf"
    hfsnap.write_snapshots(hf_home)
    trees = prepare_trees(series, pin, root, log)
    if series.tests.host_series is not None and suite == "all":
        log(f"test: {series.project} has no upstream suite here; running the patch tests")
        suite = "patches"
    venv, layers = pin_environment(
        series, pin, trees["stock"], root, log, torch_spec, with_layers=suite != "upstream"
    )
    report = TestReport(pin.version, suite, project=series.project)
    if suite in ("patches", "all"):
        report.patches, problems = run_patch_suite(
            series, pin, venv, trees, out_dir, hf_home, log, layers
        )
        report.problems += problems
    if suite in ("upstream", "all"):
        files = upstream.selection(pin, reduced=not full_upstream)
        use_baseline = stock_baseline and _baseline_covers(pin, files)
        if stock_baseline and not use_baseline:
            log(
                f"test: no committed stock baseline of {pin.version} covers these "
                "files; running stock"
            )
        report.upstream = upstream.run_upstream(
            venv,
            None if use_baseline else trees["stock"],
            trees["patched"],
            files,
            out_dir / "upstream",
            pin=pin,
            hf_home=hf_home,
            log=log,
        )
        if not report.upstream.ok:
            regressions = report.upstream.comparison.regressions
            report.problems.append(
                f"upstream: {len(regressions)} regression(s) patched vs stock"
                + (f" ({report.upstream.patched.reason})" if report.upstream.patched.reason else "")
            )
    return report


def _baseline_covers(pin: Pin, files: Sequence[str]) -> bool:
    """Whether the committed stock baseline of ``pin`` ran every file in
    ``files`` (a test missing from the stock side would go unjudged)."""
    path = upstream.baseline_path(pin)
    if not path.is_file():
        return False
    return set(files) <= set(upstream.load_baseline(pin, path)["files"])


def format_table(report: TestReport) -> str:
    """The red/green table and the upstream counts, for people."""
    lines = [f"{report.project} {report.pin}: patch tests (passed/failed)"]
    header = f"  {'patch':<40} {'stock':>9} {'without':>9} {'patched':>9}  red->green"
    lines.append(header)
    for row in report.patches:
        cells = [
            f"{c.passed}/{c.failed}" if c else "-"
            for c in (row.stock, row.without, row.patched)
        ]
        verdict = ("yes" if row.proven else row.state) if row.ok else "NO"
        lines.append(
            f"  {row.id:<40} {cells[0]:>9} {cells[1]:>9} {cells[2]:>9}  {verdict}"
        )
    if report.upstream is not None:
        lines.append(upstream.format_report(report.upstream))
    lines += [f"  PROBLEM {p}" for p in report.problems]
    lines.append("ok" if report.ok else "FAILED")
    return "\n".join(lines)
