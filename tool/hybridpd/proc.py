"""One runner for every external process hybridpd starts (git goes through :mod:`gitops`).

Everything here is project agnostic: it knows commands, environments and process
groups, not pins, venvs or patches.

- :func:`run` runs a command to its end and returns a :class:`Completed`: output captured
  (default), appended to a log file, or left on the terminal. A program that cannot be
  started (exit 127) and a timeout (``timed_out``) are results too, so a caller decides;
  ``check=True`` raises :class:`ProcessError` instead, which carries the command, the
  exit code and the tail of the output.
- :func:`script` runs a Python snippet in another interpreter and reads the one JSON line
  it prints after a marker (the probes of venvs).
- :func:`start` starts a long-running child in its own session (so its whole process
  group can be stopped) with its output in a log file; :func:`stop` stops that group:
  SIGTERM, then SIGKILL after a grace period, and reaps the child by PID.
- :func:`clean_env` is the environment children get by default: the caller's, without
  the variables that would make a child read another tree (``PYTHONPATH``) or another
  repository (``GIT_DIR``, ``GIT_WORK_TREE``, ``GIT_INDEX_FILE``...).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from hybridpd.errors import HybridpdError

#: A child :func:`start` started (callers name its type without importing subprocess).
Child = subprocess.Popen
#: Variables a child never inherits (see the module docstring).
DROPPED = (
    "PYTHONPATH",
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
)

#: Exit code of a program that could not be started (as a shell reports it).
NOT_STARTED = 127


class ProcessError(HybridpdError):
    """A command failed; the message names it, its exit code and its last output line."""

    def __init__(self, what: str, completed: Completed) -> None:
        self.completed = completed
        if completed.timed_out:
            how = "did not finish in time"
        elif completed.returncode == NOT_STARTED and completed.not_started:
            how = "could not start"
        else:
            how = f"failed (exit {completed.returncode})"
        super().__init__(f"{what} {how}: {completed.tail()}")


@dataclass(frozen=True)
class Completed:
    """What a finished command left: exit code (None when it timed out) and output."""

    cmd: tuple[str, ...]
    returncode: int | None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    not_started: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def tail(self, limit: int = 300) -> str:
        """The signal that killed it, else the last non-empty line of stderr, else of
        stdout, else "no output"."""
        if self.returncode is not None and self.returncode < 0:
            try:
                return f"killed by {signal.Signals(-self.returncode).name}"
            except ValueError:
                return f"killed by signal {-self.returncode}"
        for text in (self.stderr, self.stdout):
            lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
            if lines:
                return lines[-1][:limit]
        return "no output"


def clean_env(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """``os.environ`` without :data:`DROPPED`, plus ``overrides``."""
    env = {k: v for k, v in os.environ.items() if k not in DROPPED}
    env.update(overrides or {})
    return env


def run(
    cmd: Sequence[str | os.PathLike],
    *,
    cwd: Path | str | None = None,
    env: Mapping[str, str] | None = None,
    capture: bool = True,
    log_file: Path | None = None,
    timeout: float | None = None,
    check: bool = False,
    what: str | None = None,
) -> Completed:
    """Run ``cmd`` to its end. ``env`` None means :func:`clean_env`.

    Output: captured (``capture``), else appended to ``log_file`` (stdout and stderr
    together, after a ``$ command`` line), else left on the terminal.
    """
    args = tuple(str(c) for c in cmd)
    env = dict(env) if env is not None else clean_env()
    out: IO[Any] | int | None = subprocess.PIPE if capture else None
    fh = None
    if log_file is not None and not capture:
        fh = open(log_file, "a")
        fh.write(f"\n$ {' '.join(args)}\n")
        fh.flush()
        out = fh
    try:
        proc = subprocess.run(
            args, cwd=cwd, env=env, text=True, stdout=out,
            stderr=subprocess.STDOUT if fh else out, timeout=timeout, check=False,
        )
        completed = Completed(args, proc.returncode, proc.stdout or "", proc.stderr or "")
    except subprocess.TimeoutExpired as exc:
        completed = Completed(args, None, _text(exc.stdout), _text(exc.stderr), timed_out=True)
    except OSError as exc:
        # The missing file may be the program or the working directory: name it.
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != args[0] else ""
        why = f"cannot run {args[0]}: {exc.strerror or exc}{where}"
        if fh is not None:
            fh.write(why + "\n")
        completed = Completed(args, NOT_STARTED, "", why, not_started=True)
    finally:
        if fh is not None:
            fh.close()
    if check and not completed.ok:
        raise ProcessError(what or args[0], completed)
    return completed


def _text(data: bytes | str | None) -> str:
    if isinstance(data, bytes):
        return data.decode("utf-8", errors="replace")
    return data or ""


def script(
    python: Path | str,
    code: str,
    marker: str,
    *args: str,
    cwd: Path | str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    require_ok: bool = True,
) -> tuple[Completed, Any]:
    """Run ``python -c code args``; the JSON after ``marker + " "`` on the first line
    that starts with it. None when no such line was printed, or (``require_ok``) the
    run failed after printing it."""
    completed = run([python, "-c", code, *args], cwd=cwd, env=env, timeout=timeout)
    prefix = marker + " "
    line = next((l for l in completed.stdout.splitlines() if l.startswith(prefix)), None)
    if line is None or (require_ok and not completed.ok):
        return completed, None
    return completed, json.loads(line[len(prefix):])


def start(
    cmd: Sequence[str | os.PathLike],
    log_file: Path,
    *,
    cwd: Path | str | None = None,
    env: Mapping[str, str] | None = None,
    stdin: bool = False,
) -> Child:
    """Start ``cmd`` in its own session, output to ``log_file`` (after a ``$ command``
    line); stdin closed, or a pipe (``proc.stdin``) with ``stdin``. ``env`` None means
    :func:`clean_env`."""
    args = [str(c) for c in cmd]
    with open(log_file, "ab") as out:
        out.write(f"$ {' '.join(args)}\n".encode())
        out.flush()
        return subprocess.Popen(
            args, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else clean_env(), cwd=cwd,
            start_new_session=True,
        )


def wait(proc: subprocess.Popen, timeout: float | None) -> int | None:
    """``proc``'s exit code, or None if it is still running after ``timeout`` s."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def group_members(pgid: int) -> list[int]:
    """Live pids whose process group is ``pgid`` (read from /proc; empty elsewhere).

    Zombies do not count: they run nothing, and an orphan's zombie is its new
    parent's to reap (in a container whose pid 1 never reaps, they stay listed).
    """
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            pids.append(int(entry.name))
    return pids


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to process group ``pgid`` (gone or not ours: nothing to do)."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop(proc: subprocess.Popen, grace: float = 5.0) -> int:
    """Stop ``proc``'s whole process group: SIGTERM, then SIGKILL to whatever is left of
    the group (the leader or any member) after ``grace`` s; reap ``proc``; its code.

    A member that outlives the leader is waited for too: a child ignoring SIGTERM is
    killed, not left behind.
    """
    pgid = proc.pid
    signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (proc.poll() is None or group_members(pgid)):
        time.sleep(0.05)
    if proc.poll() is None or group_members(pgid):
        signal_group(pgid, signal.SIGKILL)
    code = proc.wait()
    settle = time.monotonic() + 5  # SIGKILL is asynchronous
    while group_members(pgid) and time.monotonic() < settle:
        time.sleep(0.05)
    return code


@dataclass(frozen=True)
class Identity:
    """Who a pid is now: its process group and its start time (clock ticks after boot,
    field 22 of ``/proc/<pid>/stat``). A pid is reused; pid and start time together are
    not, within one boot."""

    pid: int
    pgid: int
    start_time: int


def identity(pid: int) -> Identity | None:
    """``pid``'s :class:`Identity`; None when it is gone, a zombie, or /proc cannot say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # comm may hold spaces and parentheses
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return Identity(pid, int(fields[2]), int(fields[19]))


def boot_id() -> str:
    """This boot's id (a start time means nothing across a reboot); "" where unknown."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def shm_files(pid: int, shm: Path = Path("/dev/shm")) -> set[Path]:
    """Files under ``shm`` that ``pid`` maps or holds open (read from /proc; empty when
    it is gone)."""
    found: set[str] = set()
    prefix = f"{shm}/"
    try:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(prefix):
                found.add(parts[5])
    except OSError:
        pass
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith(prefix):
                found.add(target)
    except OSError:
        pass
    return {Path(p) for p in found if not p.endswith(" (deleted)")}
