"""pytestrun: JUnit parsing, exit-code handling and the CPU metadata overlay (offline, fast)."""

from __future__ import annotations

import os
import stat
import textwrap
import time
from pathlib import Path

import pytest

from hybridpd.proof.pytestrun import (
    SuiteResult,
    cpu_metadata_overlay,
    parse_junit,
    pytest_env,
    run_pytest,
)

FILES = ["tests/v1/core/test_a.py", "tests/v1/kv_connector/unit/test_b.py"]

# What pytest 8/9 writes (junit_family=xunit1) for: a pass, a failure, a pass whose
# teardown errored, a skip, an xfail, a test in a class, and a collection error.
JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="2" failures="1" skipped="2" tests="8">
 <testcase classname="tests.v1.core.test_a" name="test_ok[1-True]" time="0.5"/>
 <testcase classname="tests.v1.core.test_a" name="test_bad" time="1.0">
  <failure message="assert 1 == 2">...</failure></testcase>
 <testcase classname="tests.v1.core.test_a" name="test_teardown" time="0.25"/>
 <testcase classname="tests.v1.core.test_a" name="test_teardown" time="0.25">
  <error message="failed on teardown with RuntimeError">...</error></testcase>
 <testcase classname="tests.v1.core.test_a" name="test_skip" time="0.0">
  <skipped type="pytest.skip" message="needs a GPU">...</skipped></testcase>
 <testcase classname="tests.v1.core.test_a" name="test_xf" time="0.0">
  <skipped type="pytest.xfail" message="known">...</skipped></testcase>
 <testcase classname="tests.v1.kv_connector.unit.test_b.TestNixl" name="test_m" time="2"/>
 <testcase classname="" name="tests.v1.kv_connector.unit.test_c" time="0">
  <error message="collection failure">ImportError</error></testcase>
</testsuite></testsuites>
"""


@pytest.fixture
def junit(tmp_path: Path) -> Path:
    p = tmp_path / "r.xml"
    p.write_text(JUNIT)
    return p


def test_parse_junit_ids_and_outcomes(junit: Path) -> None:
    r = parse_junit(junit, FILES + ["tests/v1/kv_connector/unit/test_c.py"])
    assert r.outcomes == {
        "tests/v1/core/test_a.py::test_ok[1-True]": "passed",
        "tests/v1/core/test_a.py::test_bad": "failed",
        "tests/v1/core/test_a.py::test_teardown": "error",
        "tests/v1/core/test_a.py::test_skip": "skipped",
        "tests/v1/core/test_a.py::test_xf": "xfailed",
        "tests/v1/kv_connector/unit/test_b.py::TestNixl::test_m": "passed",
        "tests/v1/kv_connector/unit/test_c.py": "error",
    }
    assert r.counts() == {"passed": 2, "failed": 1, "skipped": 2, "errors": 2}
    assert r.failed_total == 3
    assert r.file_seconds["tests/v1/core/test_a.py"] == 2.0


def test_parse_junit_keeps_messages(junit: Path) -> None:
    r = parse_junit(junit, FILES)
    assert r.messages["tests/v1/core/test_a.py::test_bad"] == "assert 1 == 2"
    assert r.messages["tests/v1/core/test_a.py::test_skip"] == "needs a GPU"
    assert "tests/v1/core/test_a.py::test_ok[1-True]" not in r.messages


def test_parse_junit_per_file_counts(junit: Path) -> None:
    per_file = parse_junit(junit, FILES).per_file_counts()
    assert per_file["tests/v1/core/test_a.py"] == {
        "passed": 1, "failed": 1, "skipped": 2, "errors": 1}


def test_unknown_module_keeps_dotted_id(junit: Path) -> None:
    r = parse_junit(junit, [])
    assert "tests.v1.core.test_a::test_bad" in r.outcomes


def test_crashed_run_counts_as_failed() -> None:
    assert SuiteResult(status="crashed").failed_total == 1


def _tree(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    (tree / "vllm.egg-info").mkdir(parents=True)
    (tree / "vllm.egg-info" / "PKG-INFO").write_text(
        "Metadata-Version: 2.4\nName: vllm\nVersion: 0.20.2\nSummary: x\n")
    for f in FILES:
        (tree / f).parent.mkdir(parents=True, exist_ok=True)
        (tree / f).write_text("def test_x():\n    pass\n")
    return tree


def _fake_venv(tmp_path: Path, script: str) -> Path:
    """A venv whose bin/pytest is a shell script (no python: no pytest-timeout)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    exe = venv / "bin" / "pytest"
    exe.write_text("#!/bin/sh\n" + textwrap.dedent(script))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return venv


def _run(tmp_path: Path, script: str, files=FILES, **kw) -> SuiteResult:
    return run_pytest(_fake_venv(tmp_path, script), _tree(tmp_path), files,
                      tmp_path / "out", hf_home=tmp_path / "hf", nice=None, **kw)


def test_no_xml_is_a_crash_with_reason(tmp_path: Path) -> None:
    r = _run(tmp_path, "echo 'Fatal Python error: Segmentation fault'\nexit 139\n")
    assert r.status == "crashed"
    assert "Segmentation fault" in r.reason and r.exit_code == 139
    assert r.log_path.read_text().count("Segmentation fault") == 1


def test_exit_5_is_no_tests(tmp_path: Path) -> None:
    script = """\
    for a in "$@"; do case $a in --junitxml=*) x=${a#--junitxml=};; esac; done
    echo '<testsuites><testsuite tests="0"/></testsuites>' > "$x"
    exit 5
    """
    r = _run(tmp_path, script)
    assert r.status == "no-tests" and r.counts()["passed"] == 0


def test_results_env_and_stale_xml(tmp_path: Path) -> None:
    # The script writes the XML only when the environment is what pytestrun promises,
    # and checks that a stale XML was removed before the run.
    script = f"""\
    for a in "$@"; do case $a in --junitxml=*) x=${{a#--junitxml=}};; esac; done
    [ -e "$x" ] && exit 3
    [ "$HF_HUB_OFFLINE" = 1 ] && [ "$VLLM_TARGET_DEVICE" = cpu ] || exit 4
    case "$PYTHONPATH" in *vllm-meta:*/tree) ;; *) exit 4;; esac
    [ "$(pwd)" = "{tmp_path / 'tree'}" ] || exit 4
    cat > "$x" <<'EOF'
{JUNIT}
EOF
    exit 1
    """
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "pytest.junit.xml").write_text("stale")
    r = _run(tmp_path, script)
    assert r.status == "failures", r.reason
    assert r.counts() == {"passed": 2, "failed": 1, "skipped": 2, "errors": 2}


def test_missing_files_are_dropped_and_none_left_is_no_tests(tmp_path: Path) -> None:
    r = _run(tmp_path, "exit 0\n", files=["tests/nope.py"])
    assert r.status == "no-tests" and "none of the files" in r.reason


def test_session_timeout_kills(tmp_path: Path) -> None:
    r = _run(tmp_path, "sleep 30\n", session_timeout=0.5)
    assert r.status == "timeout" and r.failed_total == 1


def test_an_interrupted_run_stops_its_pytest(tmp_path: Path, monkeypatch) -> None:
    # The child writes its pid, then sleeps; Ctrl-C (here: the ticker raising it as the
    # wait starts) must stop the child's whole process group before it propagates.
    import contextlib

    from hybridpd import progress

    pidfile = tmp_path / "pid"

    @contextlib.contextmanager
    def interrupt(*_args, **_kw):
        for _ in range(100):
            if pidfile.exists() and pidfile.read_text().strip():
                break
            time.sleep(0.05)
        raise KeyboardInterrupt
        yield

    monkeypatch.setattr(progress, "ticker", interrupt)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, f"sleep 60 & echo $! > {pidfile}\nwait\n")
    status = Path(f"/proc/{int(pidfile.read_text())}/status")
    for _ in range(50):  # gone, or a zombie waiting for init to reap it
        if not status.exists() or "State:\tZ" in status.read_text():
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the interrupted run's pytest is still running")


def test_cpu_metadata_overlay(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    dest = cpu_metadata_overlay(tree, tmp_path / "meta")
    assert "Version: 0.20.2+cpu\n" in (dest / "vllm.egg-info" / "PKG-INFO").read_text()
    # The tree itself is untouched; a version already naming cpu is kept.
    assert "Version: 0.20.2\n" in (tree / "vllm.egg-info" / "PKG-INFO").read_text()
    (tree / "vllm.egg-info" / "PKG-INFO").write_text("Name: vllm\nVersion: 0.9+cpu\n")
    dest = cpu_metadata_overlay(tree, tmp_path / "meta")
    assert "Version: 0.9+cpu\n" in (dest / "vllm.egg-info" / "PKG-INFO").read_text()


def test_pytest_env_does_not_inherit_pythonpath(tmp_path: Path) -> None:
    env = pytest_env(tmp_path / "v", tmp_path / "t", tmp_path / "hf",
                     base={"PYTHONPATH": "/elsewhere", "PATH": "/usr/bin"},
                     overlay=tmp_path / "m")
    assert env["PYTHONPATH"] == os.pathsep.join([str(tmp_path / "m"), str(tmp_path / "t")])
    assert env["PATH"].startswith(str(tmp_path / "v" / "bin"))
    assert env["HF_HOME"] == str(tmp_path / "hf")


def test_another_projects_tree_takes_vllms_metadata_from_the_host_tree(tmp_path: Path) -> None:
    from hybridpd.proof.pytestrun import vllm_tree

    lmcache, layer, host = (tmp_path / n for n in ("lmcache", "layer", "vllm"))
    for d in (lmcache, layer, host / "vllm.egg-info"):
        d.mkdir(parents=True)
    assert vllm_tree(host, [layer]) == host
    assert vllm_tree(lmcache, [layer, host]) == host
    assert vllm_tree(lmcache, [layer]) == lmcache  # none: cpu_metadata_overlay says so


def test_a_set_stop_event_ends_the_run_and_its_process(tmp_path: Path) -> None:
    """A run side by side with others (hybridpd test's trees) ends within a second
    when its caller is interrupted, and leaves no pytest process behind."""
    import threading

    from hybridpd.proof.pytestrun import Stopped

    pid_file = tmp_path / "pid"
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    start = time.monotonic()
    with pytest.raises(Stopped):
        _run(tmp_path, f"echo $$ > {pid_file}\nexec sleep 60\n", stop=stop)
    assert time.monotonic() - start < 10
    pid = int(pid_file.read_text())
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
