"""The ``--json`` contract under signals from the console script's first line on.

The installed console script runs as a real process. A spy (:data:`SPY`, the process's
first code) logs, unbuffered, when a handler is installed for a signal and when the CLI's
heavy imports begin (``click``), then runs the script as the console does. A signal is
sent at several times after the start; whatever the time, the outcome is one of: the
interruption (exit 130, ``Error: interrupted``, the failure document), the command's
own result (it finished first), or the signal's default action: only before
hybridpd's handlers exist and before any heavy import, or once the command's result is
printed whole and the interpreter exits (its finalization restores default actions).
Nothing is asserted about how long anything takes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from builders import standard_project

pytestmark = pytest.mark.usefixtures("isolated")

SCRIPT = Path(sys.executable).with_name("hybridpd")
FAILURE = {"ok": False, "error": "interrupted"}

SPY = r"""
import os, sys, _signal
log = os.open(os.environ["SPY_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
def note(line): os.write(log, (line + "\n").encode())
real = _signal.signal
def spy(signum, handler):
    note(f"handler {int(signum)}")
    return real(signum, handler)
_signal.signal = spy
def hook(event, args):
    if event == "import" and args[0] == "click":
        note("import click")
sys.addaudithook(hook)
script = sys.argv[1]
sys.argv = sys.argv[1:]
code = compile(open(script).read(), script, "exec")
note("script")
exec(code, {"__name__": "__main__", "__file__": script})
"""


def start(series: Path, log: Path, *args: str, fault: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "SPY_LOG": str(log)}
    env.pop("HYBRIDPD_FAULT", None)
    if fault:
        env["HYBRIDPD_FAULT"] = fault
    return subprocess.Popen(
        [sys.executable, "-c", SPY, str(SCRIPT), "--series", str(series), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )


@pytest.fixture
def series(tmp_path: Path) -> Path:
    assert SCRIPT.is_file(), f"no console script beside {sys.executable}: pip install -e ."
    return standard_project(tmp_path)[1].path


def test_the_handlers_exist_before_any_heavy_import(series: Path, tmp_path: Path) -> None:
    log = tmp_path / "log"
    proc = start(series, log, "list", "--json")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = log.read_text().splitlines()
    assert "import click" in lines
    first_heavy = lines.index("import click")
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        assert f"handler {int(sig)}" in lines[:first_heavy], lines


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=str)
def test_a_signal_at_any_time_is_an_interruption_or_too_early_or_too_late(
    series: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    log = tmp_path / "reference.log"
    reference = start(series, log, "list", "--json")
    finished, _ = reference.communicate(timeout=60)
    assert reference.returncode == 0
    outcomes = []
    for i, delay in enumerate((0, 0.02, 0.05, 0.1, 0.2, 0.5)):
        log = tmp_path / f"{i}.log"
        proc = start(series, log, "list", "--json")
        time.sleep(delay)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        lines = log.read_text().splitlines() if log.exists() else []
        outcome = (proc.returncode, out, err, lines)
        outcomes.append(outcome)
        if "script" not in lines:
            continue  # the interpreter itself was still starting: not hybridpd's to handle
        if proc.returncode == -sig and (out, err) == (finished, ""):
            # Too late: the command finished and printed its result; the interpreter's
            # exit had put the signal's default action back (CPython restores it at
            # finalization), so the signal ended a process whose work was done.
            pass
        elif proc.returncode == -sig:
            # Otherwise only before hybridpd's handler exists, and so before the CLI's
            # imports.
            assert (out, err) == ("", ""), outcome
            assert f"handler {int(sig)}" not in lines and "import click" not in lines, outcome
        elif proc.returncode == 130:
            assert err == "Error: interrupted\n", outcome
            assert out.count("\n") <= 3 or out == finished, outcome
            assert json.loads(out) in (FAILURE, json.loads(finished)), outcome
        else:
            assert (proc.returncode, out, err) == (0, finished, ""), outcome
    assert any(code == 130 for code, *_ in outcomes), outcomes


@pytest.mark.parametrize(
    "point,sig,as_json",
    [("startup", "TERM", True), ("startup", "HUP", False), ("startup", "INT", True),
     ("imported", "TERM", True), ("imported", "INT", False)],
)
def test_a_signal_while_the_cli_starts_is_one_line_and_exit_130(
    series: Path, tmp_path: Path, point: str, sig: str, as_json: bool
) -> None:
    # ``startup``: while the CLI imports; ``imported``: between the import and the
    # command's parsing, where the signal is held until hybridpd can handle it.
    proc = start(series, tmp_path / "log", "list", *(["--json"] if as_json else []),
                 fault=f"{point}:{sig}")
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (130, "Error: interrupted\n")
    assert (json.loads(out) if as_json else out) == (FAILURE if as_json else "")
