"""The red/green table of ``hybridpd test`` from per-tree outcomes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from builders import Project, stub_pin
from hybridpd.proof.testrun import PatchRow, _case_outcomes, patch_properties, red_green

pytestmark = pytest.mark.usefixtures("isolated")

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.patches.a.test_a" name="test_red_green">
  <properties><property name="patch" value="fix-add"/></properties>
</testcase>
<testcase classname="tests.patches.a.test_a" name="test_guard">
  <properties><property name="patch" value="fix-add"/></properties>
  <failure message="boom"/>
</testcase>
<testcase classname="tests.patches.b.test_b" name="test_skipped">
  <properties><property name="patch" value="feature"/></properties>
  <skipped message="covers vLLM &lt;0.23"/>
</testcase>
</testsuite></testsuites>
"""


@pytest.fixture
def series(tmp_path: Path):
    project = Project(tmp_path)
    project.release("1.0")
    project.record("fix-add", {"1.0": "carried"})
    project.record("feature", {"1.0": "carried"})
    project.record("landed", {"1.0": "upstream:0.9"})
    project.record("dropped-one", {"1.0": "dropped"})
    return project.write()


def test_junit_properties_and_outcomes(tmp_path: Path) -> None:
    junit = tmp_path / "x.xml"
    junit.write_text(JUNIT)
    assert patch_properties(junit) == {
        "tests.patches.a.test_a::test_red_green": "fix-add",
        "tests.patches.a.test_a::test_guard": "fix-add",
        "tests.patches.b.test_b::test_skipped": "feature",
    }
    assert _case_outcomes(junit) == {
        "tests.patches.a.test_a::test_red_green": "passed",
        "tests.patches.a.test_a::test_guard": "failed",
        "tests.patches.b.test_b::test_skipped": "skipped",
    }


def _rows(series, stock, without, patched, mapping):
    rows, problems = red_green(series, series.pin("1.0"), mapping, stock, without, patched)
    return {row.id: row for row in rows}, problems


def test_patch_is_proven_only_when_red_without_it(series) -> None:
    mapping = {"t1": "fix-add", "t2": "feature", "t3": "landed"}
    stock = {"t1": "failed", "t2": "failed", "t3": "passed"}
    without = {"fix-add": stock, "feature": {"t1": "passed", "t2": "passed"}}
    patched = {"t1": "passed", "t2": "passed", "t3": "passed"}

    rows, problems = _rows(series, stock, without, patched, mapping)

    assert rows["fix-add"].proven and rows["fix-add"].ok
    # t2 already passes without "feature": red on stock only proves nothing.
    assert not rows["feature"].proven
    assert problems == [
        "feature: no test is red on stock and without the patch, and green patched"
    ]
    # An upstream patch's tests only have to pass.
    assert rows["landed"].state == "upstream" and rows["landed"].ok
    assert rows["landed"].without is None
    # A dropped patch needs no test and is not a problem.
    assert rows["dropped-one"].state == "dropped" and rows["dropped-one"].ok
    assert rows["dropped-one"].tests == [] and rows["dropped-one"].without is None


def test_the_table_names_the_state_of_an_unproven_patch(series) -> None:
    from hybridpd.proof.testrun import TestReport, format_table

    mapping = {"t1": "fix-add", "t3": "landed"}
    stock = {"t1": "failed", "t3": "passed"}
    patched = {"t1": "passed", "t3": "passed"}
    rows, _ = _rows(series, stock, {"fix-add": stock, "feature": {}}, patched, mapping)
    table = format_table(TestReport("1.0", "patches", list(rows.values())))
    verdicts = {line.split()[0]: line.split()[-1] for line in table.splitlines()[2:6]}
    assert verdicts == {
        "fix-add": "yes", "feature": "NO", "landed": "upstream", "dropped-one": "dropped"
    }


def test_a_test_that_names_no_patch_must_pass_patched(series) -> None:
    mapping = {"t1": "fix-add", "t2": "feature", "t3": "landed"}
    stock = {
        "t1": "failed", "t2": "failed", "t3": "passed", "guard": "passed", "kept": "passed",
        "skipped-both": "skipped", "now-skipped": "passed", "gone": "passed",
        "xfail-fixed": "skipped",
    }
    without = {"fix-add": stock, "feature": stock}
    patched = {
        "t1": "passed", "t2": "passed", "t3": "passed", "guard": "failed", "kept": "passed",
        "skipped-both": "skipped", "now-skipped": "skipped",
        "xfail-fixed": "failed",  # XPASS(strict) is a failure in JUnit
    }

    _, problems = _rows(series, stock, without, patched, mapping)

    assert problems == [
        "4 test(s) that name no patch do not pass patched (each fails patched, or passes "
        "on stock and not patched; a strict xfail of a known upstream issue that passes "
        "means the pin fixed it): gone, guard, now-skipped, xfail-fixed"
    ]


def test_skipped_or_failing_tests_do_not_prove(series) -> None:
    mapping = {"t1": "fix-add", "t2": "feature", "t9": "ghost"}
    stock = {"t1": "failed", "t2": "failed"}
    without = {"fix-add": stock, "feature": stock}
    patched = {"t1": "failed", "t2": "skipped"}

    rows, problems = _rows(series, stock, without, patched, mapping)

    assert isinstance(rows["fix-add"], PatchRow) and not rows["fix-add"].ok
    assert rows["feature"].patched.skipped == 1 and not rows["feature"].proven
    assert "fix-add: 1 test(s) fail patched" in problems
    assert "tests name ghost, which has no record in series.toml" in problems
    # An upstream record is proven by the release: a patch no test names is not.
    assert "landed: recorded upstream in 1.0 (since 0.9), but no test names it" in problems
    assert not rows["landed"].ok


def test_an_upstream_record_is_proven_only_by_its_tests_passing_on_stock(series) -> None:
    """0.33.0 listed coordinator-consumer-skips-mamba-hit as upstream while 7 tests
    marked for it failed on stock, and nothing went red."""
    mapping = {"t1": "fix-add", "t2": "feature", "u1": "landed", "u2": "landed", "u3": "landed"}
    stock = {"t1": "failed", "t2": "failed", "u1": "passed", "u2": "failed", "u3": "skipped"}
    without = {"fix-add": stock, "feature": stock}
    patched = {"t1": "passed", "t2": "passed", "u1": "passed", "u2": "passed", "u3": "skipped"}

    rows, problems = _rows(series, stock, without, patched, mapping)
    assert problems == [
        "landed: recorded upstream in 1.0 (since 0.9), but 1 of its tests do not pass on "
        "stock 1.0: u2"
    ]
    assert not rows["landed"].ok

    stock["u2"] = "passed"
    rows, problems = _rows(series, stock, without, patched, mapping)
    assert problems == [] and rows["landed"].ok
    # Only skipped there (tests of other releases): nothing proves the record.
    stock |= {"u1": "skipped", "u2": "skipped"}
    patched |= {"u1": "skipped", "u2": "skipped"}
    rows, problems = _rows(series, stock, without, patched, mapping)
    assert problems == ["landed: recorded upstream in 1.0 (since 0.9), but none of its "
                        "tests runs on 1.0"]
    assert not rows["landed"].ok


def test_a_test_stock_skips_for_want_of_a_carried_patch_proves_upstream_patched(
    series,
) -> None:
    """0.21.0: NIXL's worker test of nixl-mamba-prefix-cache-read (upstream there)
    cannot reach the worker on stock, whose scheduler refuses external KV before
    scheduler-mamba-external-kv (carried): it skips on stock and passes on the
    release with every carried patch, which proves the record."""
    mapping = {"t1": "fix-add", "t2": "feature", "u1": "landed"}
    stock = {"t1": "failed", "t2": "failed", "u1": "skipped"}
    without = {"fix-add": stock, "feature": stock}
    patched = {"t1": "passed", "t2": "passed", "u1": "passed"}
    rows, problems = _rows(series, stock, without, patched, mapping)
    assert problems == [] and rows["landed"].ok
    # A failure on stock is never excused by the carried patches.
    rows, problems = _rows(series, stock | {"u1": "failed"}, without, patched, mapping)
    assert not rows["landed"].ok
    assert problems == ["landed: recorded upstream in 1.0 (since 0.9), but 1 of its tests "
                        "do not pass on stock 1.0: u1"]


def test_a_baseline_is_used_only_when_it_covers_the_files(monkeypatch, tmp_path: Path) -> None:
    from hybridpd.proof import testrun, upstream

    baseline = tmp_path / "9.9.9-stock.json"
    baseline.write_text('{"files": ["a.py", "b.py"], "outcomes": {}}')
    monkeypatch.setattr(upstream, "baseline_path", lambda pin: baseline)
    monkeypatch.setattr(
        upstream, "load_baseline", lambda pin, path: json.loads(path.read_text())
    )
    assert testrun._baseline_covers(stub_pin("9.9.9"), ["a.py"])
    assert not testrun._baseline_covers(stub_pin("9.9.9"), ["a.py", "c.py"])
    baseline.unlink()
    assert not testrun._baseline_covers(stub_pin("9.9.9"), ["a.py"])


def test_a_second_run_of_a_pin_waits_for_the_first(tmp_path: Path, monkeypatch) -> None:
    import threading
    import time

    from builders import standard_project
    from hybridpd import cache
    from hybridpd.proof import testrun

    _, series = standard_project(tmp_path)
    monkeypatch.setattr(testrun, "_run_locked", lambda *args: "ran")
    root = cache.cache_dir() / "trees" / series.slug(series.pin("1.0"))
    root.parent.mkdir(parents=True, exist_ok=True)
    logs: list[str] = []
    results: list[str] = []
    with cache.lock(root, print):  # a first `hybridpd test --pin 1.0` is running
        second = threading.Thread(target=lambda: results.append(
            testrun.run(series, series.pin("1.0"), log=logs.append)))
        second.start()
        for _ in range(200):  # until it says it waits (no fixed sleep: CI may be loaded)
            if logs:
                break
            time.sleep(0.05)
        assert logs == [f"waiting for another hybridpd process that is writing {root}"]
        assert second.is_alive() and results == []
    second.join(10)
    assert results == ["ran"]


def test_a_failing_upstream_record_names_the_port_that_carries_the_patch_again(
    tmp_path: Path,
) -> None:
    project = Project(tmp_path)
    for version in ("1.0", "2.0", "3.0"):
        project.release(version)
    project.record("landed", {"1.0": "carried", "2.0": "upstream:2.0", "3.0": "carried"})
    series = project.write()
    stock = {"u": "failed"}
    _, problems = red_green(series, series.pin("2.0"), {"u": "landed"}, stock, {}, {"u": "passed"})
    # 3.0 carries it too, but a port onto a ported pin goes forward only.
    assert problems == [
        "landed: recorded upstream in 2.0 (since 2.0), but 1 of its tests do not pass on "
        "stock 2.0: u; if 2.0 has the fix only in part, carry the patch again: "
        "`hybridpd port --from 1.0 --to 2.0 --replace`, resolving it instead of skipping it"
    ]


def test_a_tree_without_a_patch_runs_only_that_patchs_tests(series, tmp_path, monkeypatch) -> None:
    """red_green reads nothing else of that run: the other tests are deselected there
    (HYBRIDPD_PATCH_TESTS_OF, read by the patch tests' conftest); a patch without a test
    of its own gets no run; the first carried patch's tree is the stock one, run once."""
    from hybridpd.proof import testrun
    from hybridpd.proof.pytestrun import SuiteResult

    calls = []

    def fake_run_pytest(venv, tree, files, out_dir, *, label, env_overrides=None, **_):
        calls.append((label, Path(tree).name, dict(env_overrides or {})))
        (Path(out_dir) / f"{label}.junit.xml").write_text(JUNIT)
        return SuiteResult(status="ok")

    monkeypatch.setattr(testrun, "run_pytest", fake_run_pytest)
    trees = {"stock": tmp_path / "stock", "patched": tmp_path / "patched",
             "without": {"fix-add": tmp_path / "stock", "feature": tmp_path / "w-feature"}}
    testrun.run_patch_suite(series, series.pin("1.0"), tmp_path / "venv", trees, tmp_path,
                            tmp_path / "hf", lambda _: None)
    # Stock and patched run side by side (either may start first), then the trees
    # without a patch; where a patch's tests must fail, nothing is shrunk.
    assert sorted(calls[:2]) == [
        ("patches-patched", "patched", {}),
        ("patches-stock", "stock", {"HYBRIDPD_HYPOTHESIS_SHRINK": "0"}),
    ]
    assert calls[2:] == [
        ("patches-without-feature", "w-feature",
         {"HYBRIDPD_PATCH_TESTS_OF": "feature", "HYBRIDPD_HYPOTHESIS_SHRINK": "0"}),
    ]


def test_side_by_side_returns_results_in_order_and_stops_the_others_on_a_failure() -> None:
    import threading

    from hybridpd.proof.testrun import side_by_side

    started = threading.Barrier(2, timeout=10)

    def slow(result):
        def call(stop):
            started.wait()
            stop.wait(0.2)
            return result
        return call

    assert side_by_side([slow("a"), slow("b")]) == ["a", "b"]

    stopped = []

    def waits_for_stop(stop):
        stopped.append(stop.wait(10))  # a pytest run polls its stop event the same way

    def fails(stop):
        raise RuntimeError("crashed")

    with pytest.raises(RuntimeError, match="crashed"):
        side_by_side([waits_for_stop, fails])
    assert stopped == [True]
