"""Progress of long steps: a line rewritten on a terminal, nothing extra in CI logs."""

from __future__ import annotations

import io
import time
from pathlib import Path

from hybridpd import progress
from hybridpd.envs.build import pip_args
from hybridpd.proof.pytestrun import pytest_progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_ticker_rewrites_one_line_on_a_terminal_and_clears_it() -> None:
    out = Terminal()
    with progress.ticker("pytest[patched]", lambda: "40%", stream=out, interval=0.05):
        time.sleep(0.3)
    text = out.getvalue()
    assert text.startswith(progress.CLEAR + "pytest[patched]: 40% (0 s)")
    assert "\n" not in text
    assert text.endswith(progress.CLEAR)


def test_ticker_is_silent_in_a_log_and_survives_a_failing_status() -> None:
    log = io.StringIO()
    with progress.ticker("pytest[patched]", lambda: "40%", stream=log, interval=0.01):
        time.sleep(0.05)
    assert log.getvalue() == ""

    def broken() -> str:
        raise OSError("log gone")

    out = Terminal()
    with progress.ticker("step", broken, stream=out, interval=0.01):
        time.sleep(0.05)
    assert progress.CLEAR + "step (0 s)" in out.getvalue()


def test_printer_prints_every_ten_seconds_in_a_log() -> None:
    log = io.StringIO()
    show, done = progress.printer(log)
    show("[   0 s] prefill starting")
    show("[   1 s] prefill starting")  # within 10 s: not printed
    show("[   2 s] prefill ready (2 s)")  # a state change is always printed
    done()
    assert log.getvalue() == "[   0 s] prefill starting\n[   2 s] prefill ready (2 s)\n"


def test_pytest_progress_reads_the_quiet_progress_lines(tmp_path: Path) -> None:
    log = tmp_path / "patched.log"
    log.write_text("$ cd tree && pytest -q\n")
    assert pytest_progress(log) == "collecting"
    log.write_text("$ cd tree\n" + "." * 40 + "F.E" + " " * 10 + "[ 21%]\n" + "..s" + " [ 23%]\n")
    assert pytest_progress(log) == "23%, 2 failed"


def test_pip_is_quiet_when_its_output_goes_to_a_log() -> None:
    assert pip_args(["install", "-r", "reqs.txt"], tty=False) == [
        "install", "-q", "--progress-bar", "off", "-r", "reqs.txt"
    ]
    assert pip_args(["install", "-q", "x"], tty=False) == [
        "install", "--progress-bar", "off", "-q", "x"
    ]
    assert pip_args(["install", "-r", "reqs.txt"], tty=True) == ["install", "-r", "reqs.txt"]
    assert pip_args(["index", "versions", "torch"], tty=False) == ["index", "versions", "torch"]


def test_bar_rewrites_a_line_on_a_terminal_and_says_the_size_once_in_a_log() -> None:
    out = Terminal()
    with progress.bar("downloading x.tar.gz", 2_000_000, stream=out) as advance:
        advance(1_000_000)
        advance(1_000_000)
    assert out.getvalue() == (
        progress.CLEAR + "downloading x.tar.gz   50% (1.0/2.0 MB)"
        + progress.CLEAR + "downloading x.tar.gz  100% (2.0/2.0 MB)\n"
    )
    log = io.StringIO()
    with progress.bar("downloading x.tar.gz", 2_000_000, stream=log) as advance:
        advance(2_000_000)
    assert log.getvalue() == "downloading x.tar.gz (2.0 MB)\n"


def test_the_library_does_not_import_click() -> None:
    import subprocess
    import sys

    code = ("import sys, hybridpd.envs.install, hybridpd.envs.installed, hybridpd.proof.testrun, "
            "hybridpd.porting.port, hybridpd.upstreaming.export, hybridpd.envs.doctor; print('click' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr
