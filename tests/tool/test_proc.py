"""proc: the one runner. Results, errors, environments and process groups."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from hybridpd import proc


def test_run_captures_and_reports_the_last_line() -> None:
    done = proc.run([sys.executable, "-c", "import sys; print('out'); sys.exit('boom\\nlast')"])
    assert (done.returncode, done.stdout, done.ok) == (1, "out\n", False)
    assert done.tail() == "last"


def test_a_missing_program_and_a_timeout_are_results() -> None:
    missing = proc.run(["/nonexistent/tool", "x"])
    assert (missing.returncode, missing.not_started) == (proc.NOT_STARTED, True)
    assert missing.tail().startswith("cannot run /nonexistent/tool: No such file")
    slow = proc.run([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)
    assert (slow.timed_out, slow.returncode, slow.ok) == (True, None, False)


def test_check_raises_one_line_with_command_code_and_tail() -> None:
    with pytest.raises(proc.ProcessError) as err:
        proc.run([sys.executable, "-c", "raise SystemExit('no torch')"], check=True,
                 what="reading torch")
    assert err.value.message == "reading torch failed (exit 1): no torch"
    assert err.value.completed.returncode == 1
    with pytest.raises(proc.ProcessError, match="^/nonexistent could not start: cannot run"):
        proc.run(["/nonexistent"], check=True)


def test_a_killed_child_is_named_by_its_signal() -> None:
    done = proc.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"])
    assert done.tail() == "killed by SIGILL"


def test_log_file_gets_the_command_and_both_streams(tmp_path: Path) -> None:
    log = tmp_path / "step.log"
    log.write_text("earlier\n")
    done = proc.run([sys.executable, "-c", "import sys; print('o'); print('e', file=sys.stderr)"],
                    capture=False, log_file=log)
    assert done.ok and done.stdout == ""
    text = log.read_text()
    assert text.startswith("earlier\n\n$ ") and text.endswith("o\ne\n")


def test_children_do_not_inherit_pythonpath_or_git_variables(monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv("GIT_DIR", "/elsewhere/.git")
    monkeypatch.setenv("HYBRIDPD_PROC_TEST", "kept")
    code = "import os; print(os.environ.get('PYTHONPATH'), os.environ.get('GIT_DIR'), " \
           "os.environ.get('HYBRIDPD_PROC_TEST'))"
    assert proc.run([sys.executable, "-c", code]).stdout == "None None kept\n"
    assert proc.clean_env({"PYTHONPATH": "/tree"})["PYTHONPATH"] == "/tree"


def test_script_reads_the_marked_json_line() -> None:
    code = "import json; print('noise'); print('MARK ' + json.dumps({'a': 1})); raise SystemExit(3)"
    done, data = proc.script(sys.executable, code, "MARK")
    assert (done.returncode, data) == (3, None)
    done, data = proc.script(sys.executable, code, "MARK", require_ok=False)
    assert data == {"a": 1}
    done, data = proc.script(sys.executable, "print('nothing')", "MARK")
    assert data is None and done.ok


def test_start_and_stop_end_the_whole_process_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild"
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n"
    )
    log = tmp_path / "server.log"
    child = proc.start([sys.executable, "-c", code], log)
    for _ in range(100):
        if pidfile.exists() and pidfile.read_text():
            break
        time.sleep(0.05)
    assert proc.wait(child, 0.1) is None  # still running
    code = proc.stop(child, grace=2)
    assert code == -15
    status = Path(f"/proc/{int(pidfile.read_text())}/status")
    for _ in range(50):
        if not status.exists() or "State:\tZ" in status.read_text():
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the grandchild outlived stop()")
    assert log.read_text().startswith(f"$ {sys.executable} -c ")


def test_stop_kills_a_member_that_ignores_sigterm_after_the_leader_exits(tmp_path: Path) -> None:
    pidfile = tmp_path / "stubborn"
    stubborn = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    )
    leader = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', {stubborn!r}])\n"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n"
    )
    child = proc.start([sys.executable, "-c", leader], tmp_path / "log")
    for _ in range(200):
        if pidfile.exists() and pidfile.read_text():
            break
        time.sleep(0.05)
    time.sleep(0.3)  # let the member install its SIGTERM handler
    proc.stop(child, grace=1)
    assert proc.group_members(child.pid) == []


def test_a_missing_working_directory_is_named(tmp_path: Path) -> None:
    log = tmp_path / "step.log"
    done = proc.run([sys.executable, "-c", "pass"], cwd=tmp_path / "gone", capture=False,
                    log_file=log)
    assert done.not_started and str(tmp_path / "gone") in done.tail()
    assert str(tmp_path / "gone") in log.read_text()
