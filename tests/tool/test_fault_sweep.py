"""The fault sweep of the commands that write into a user's directory and were not in it
yet: ``port``, ``port --continue``/``--skip``/``--abort`` and ``export-pr``.

Each case kills the command at a named state point (``HYBRIDPD_FAULT``, see
:func:`hybridpd.guard.fault`; ``write:<name>`` is inside the atomic write of a state
file, after the write and before the rename), then changes something as a user would,
then runs the commands a user runs next. The assertion is the issue's: nothing the user
made is lost (every byte of it is where they left it), and each command finishes, stops
on the port's conflict, or says in one line what to do.

(``apply``, ``export``, ``build`` and ``install`` are swept in test_interruptions.py,
``apply --installed`` and ``--revert`` in test_installed.py.)

Tiers: the default run takes one representative point per command with every kind of
user change at once; ``HYBRIDPD_FAULT_SWEEP=full`` (``ci/test.sh --full``) takes every
point with each kind of change on its own.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from builders import port_project, standard_project
from hybridpd.series.model import Series
from test_interruptions import USER, hybridpd

pytestmark = pytest.mark.usefixtures("isolated")

FULL = os.environ.get("HYBRIDPD_FAULT_SWEEP") in ("full", "real")
SUBMITTER = "PR Submitter <submitter@example.invalid>"
CONFLICT = {"README.txt": "proj, rewritten\n"}  # 2.0 rewrites the line feature changes

#: Per command: its arguments (``D``: the directory it writes), the state it starts
#: from, its points (the first is the default run's), and the commands run after.
PORT_AFTER = [["port", "--continue", "--dir", "D"], ["port", "--abort", "--dir", "D"]]
if FULL:  # a new port in the directory after all that (test_port_abort.py holds it too)
    PORT_AFTER.append(["port", "--from", "1.0", "--to", "2.0", "--dir", "D"])
COMMANDS = {
    "port": (["port", "--from", "1.0", "--to", "2.0", "--dir", "D"], "fresh",
             ["port:replayed", "port:conflict", "write:hybridpd-port.json"], PORT_AFTER),
    "port-continue": (["port", "--continue", "--dir", "D"], "resolved",
                      ["port:series-written", "write:series.toml", "write:hybridpd-port.json",
                       "write:feature.patch"], PORT_AFTER),
    "port-skip": (["port", "--skip", "--upstream", "1.5", "--dir", "D"], "stopped",
                  ["write:hybridpd-port.json", "port:series-written", "write:series.toml"],
                  PORT_AFTER),
    "port-abort": (["port", "--abort", "--dir", "D"], "stopped",
                   ["port-abort:restored", "port-abort:reset", "write:hybridpd-port-ended"],
                   PORT_AFTER),
    "export-pr": (["export-pr", "--all", "--pin", "1.0", "--to", "D", "--author", SUBMITTER],
                  "release", ["export-pr:written", "export-pr:sealed"],
                  [["export-pr", "--all", "--pin", "1.0", "--to", "D", "--author", SUBMITTER],
                   ["check"]]),
}


def _write(path: Path, data: bytes) -> dict[Path, bytes]:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {path: data}


def _append(path: Path) -> dict[Path, bytes]:
    if not path.is_file():
        return {}
    with open(path, "ab") as fh:
        fh.write(b"# the user's line\n")
    return {path: path.read_bytes()}


def _untracked(d: Path, series: Series) -> dict[Path, bytes]:
    kept = _write(d / "NOTES.md", b"the user's notes\n")
    kept |= _write(d / "mywork" / "fix.py", b"FIX = 1\n")
    for sub in sorted(p for p in d.iterdir() if p.is_dir() and p.name != "mywork"):
        if sub.name != ".git":  # inside a PR directory export-pr wrote
            kept |= _write(sub / "mine.md", b"the user's draft\n")
    return kept


#: A file a command may rightly rewrite around the user's line (series.toml, which a
#: port that finishes records its results in): the line must stay.
NOTE = b"# the user's note\n"


def _series(d: Path, series: Series) -> dict[Path, bytes]:
    with open(series.path, "ab") as fh:
        fh.write(NOTE)
    kept = {series.path: NOTE}
    for version in ("1.0", "2.0"):
        kept |= _write(series.dir / version / "my-wip.patch", b"the user's patch in progress\n")
    return kept


CHANGES = {
    "untracked": _untracked,
    "edit-other": lambda d, s: _append(d / "proj" / "__init__.py"),
    # A file the command changed: the port's commit's, or one export-pr wrote.
    "edit-touched": lambda d, s: _append(d / "proj" / "core.py")
    | _append(min((d / "fix-add").glob("*.patch"), default=d / "none")),
    "series": _series,
}


def _all(d: Path, series: Series) -> dict[Path, bytes]:
    kept: dict[Path, bytes] = {}
    for name in ("untracked", "edit-other", "series"):
        kept |= CHANGES[name](d, series)
    return kept


def _cases() -> list:
    if not FULL:
        return [pytest.param(c, points[0], "all", id=f"{c}-{points[0]}")
                for c, (_, _, points, _) in COMMANDS.items()]
    return [pytest.param(c, p, change, id=f"{c}-{p}-{change}")
            for c, (_, _, points, _) in COMMANDS.items() for p in points for change in CHANGES
            if not (c == "export-pr" and change == "edit-other")]  # no source tree there


def _start(tmp_path: Path, state: str) -> Series:
    """The series (and port directory ``tmp_path/D``) in the state the command starts from."""
    if state == "release":
        return standard_project(tmp_path)[1]
    series = port_project(tmp_path, CONFLICT)[1]
    if state == "fresh":
        return series
    dest = tmp_path / "D"
    stopped = hybridpd(series, "port", "--from", "1.0", "--to", "2.0", "--dir", str(dest))
    assert stopped.returncode == 1 and "conflicts" in stopped.stdout, stopped.stderr
    if state == "resolved":
        (dest / "README.txt").write_text("proj, rewritten\nNow with doubling.\n")
        subprocess.run(["git", *USER, "add", "README.txt"], cwd=dest, check=True)
    return series


def _args(args: list[str], d: Path) -> list[str]:
    return [str(d) if a == "D" else a for a in args]


@pytest.mark.parametrize("command,point,change", _cases())
def test_sweep_a_killed_command_then_user_work_then_the_next_commands(
    tmp_path: Path, command: str, point: str, change: str
) -> None:
    args, state, _, after = COMMANDS[command]
    series = _start(tmp_path, state)
    d = tmp_path / "D"
    killed = hybridpd(series, *_args(args, d), fault=point)
    assert killed.returncode == -9, (point, killed.stdout, killed.stderr)
    d.mkdir(exist_ok=True)  # a kill before the directory exists: the user makes it
    kept = (_all if change == "all" else CHANGES[change])(d, series)
    assert kept
    for then in after:
        result = hybridpd(series, *_args(then, d))
        assert "Traceback" not in result.stderr, (then, result.stderr)
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
        stopped = "stopped: patch feature conflicts" in result.stdout
        assert result.returncode == 0 or (result.returncode == 1 and (
            len(errors) == 1 or (stopped and not errors))), (then, result.stdout, result.stderr)
        for path, data in kept.items():
            assert path.is_file(), (then, path, result.stderr)
            have = path.read_bytes()
            assert (data in have) if data == NOTE else (have == data), (then, path, result.stderr)
    # No temporary file of an atomic write is left in the user's directories.
    left = [p for root in (d, series.dir) for p in root.rglob("*.hybridpd-tmp")
            if ".git" not in p.parts]
    assert left == []
