"""The record of the process groups a run started, and the reaping of what a killed run
left behind.

:class:`~.servers.Processes` writes ``<run dir>/processes.json`` (atomically,
:func:`hybridpd.guard.write_atomic`) when it starts a process and whenever a group gains
a member: per process its name, pid, process group id, start time (from
``/proc/<pid>/stat``), the members of its group seen so far (pid and start time each),
and the shared-memory files it may leave (globs, ``{pid}`` standing for each recorded pid
of the group, e.g. LMCache's ``/dev/shm/lmcache_kv_{pid}_*``). A closed run deletes it.

A run killed with SIGKILL cannot clean up: its servers live on in their own sessions.
:func:`reap` (``hybridpd e2e --reap DIR``, and every ``hybridpd e2e`` into an ``--out``
that has a record) ends them. A run's ``--out`` is new each time by default, so each
record is also named in ``<cache>/e2e/live/`` while it exists (with its host, pid
namespace and boot), and every ``hybridpd e2e`` first reaps what a killed run of the same
host, namespace and boot left wherever it wrote (:func:`reap_registered`); a cache shared
with other hosts or containers never lets one act on another's processes. Invariants:

- a group is signalled only when one of its recorded processes is still alive with the
  recorded start time, in the recorded group, in the same boot: a pid the kernel gave to
  another process since is never touched (pid and start time are not reused together),
  and nothing is ever found by name;
- shared-memory files are removed only under ``/dev/shm``: those the record's globs name
  and those the group's members map or hold open just before they end; never while a
  recorded pid belongs to another process now (its pid-named files may be that
  process's);
- a record whose writer (the hybridpd process that started the groups, pid and start
  time) still runs is refused with one line: that run is alive and reaps its own;
- the record is deleted once every group in it is handled, and the network of
  simulated hosts it names (``--hosts netns``, :mod:`.netns`: namespaces and links,
  recorded before they are made) is removed;
- a server on a simulated host has the ``/dev/shm`` of that host, whose holder process
  the entry names (``root``: pid and start time): its files are read and removed as
  ``/proc/<holder>/root/dev/shm/...`` only while that holder runs with its recorded
  start time; once it is gone, so is that tmpfs and everything in it.

A SIGKILL between a fork and the record's write would leave a group no record names;
:meth:`~.servers.Processes.start` writes the record before it returns, so that window is
one ``fork`` + one small write.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
import signal
import socket
import time
from pathlib import Path
from typing import Any

from hybridpd import cache, guard, proc
from hybridpd.e2e import netns
from hybridpd.errors import HybridpdError, LocalFileError

#: The record's name in a run directory.
RECORD = "processes.json"
#: Where shared-memory segments live; nothing outside it is ever removed.
SHM = Path("/dev/shm")


class StillRunning(HybridpdError):
    """The run that recorded the groups is alive: it is not ours to reap."""


@dataclasses.dataclass
class Entry:
    """One started process and what is known of its group."""

    name: str
    pid: int
    pgid: int
    start_time: int
    members: dict[int, int] = dataclasses.field(default_factory=dict)  # pid -> start time
    shm: tuple[str, ...] = ()
    # The holder (pid, start time) of the simulated host whose /dev/shm the globs
    # name (netns.py); None: this host's.
    root: tuple[int, int] | None = None

    @classmethod
    def of(cls, name: str, pid: int, shm: tuple[str, ...] = (),
           root: int | None = None) -> Entry | None:
        """The entry of a process just started (None: it is already gone). A holder
        ``root`` already gone is recorded with start time -1: no /dev/shm of its is
        ever read or removed."""
        ident = proc.identity(pid)
        if ident is None:
            return None
        held = proc.identity(root) if root is not None else None
        return cls(name, pid, ident.pgid, ident.start_time, {}, tuple(shm),
                   None if root is None else (root, held.start_time if held else -1))

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "pid": self.pid, "pgid": self.pgid,
            "start_time": self.start_time,
            "members": [[p, s] for p, s in sorted(self.members.items())],
            "shm": list(self.shm),
            **({"root": list(self.root)} if self.root is not None else {}),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Entry:
        return cls(str(data["name"]), int(data["pid"]), int(data["pgid"]),
                   int(data["start_time"]), {int(p): int(s) for p, s in data.get("members", [])},
                   tuple(str(g) for g in data.get("shm", [])),
                   (int(data["root"][0]), int(data["root"][1])) if data.get("root") else None)

    def known(self) -> dict[int, int]:
        """Every recorded pid of the group with its start time."""
        return {self.pid: self.start_time, **self.members}

    def add_members(self, pids: list[int]) -> bool:
        """Record the group's members not yet recorded; whether any was new."""
        new = False
        for pid in pids:
            if pid not in self.members and pid != self.pid:
                ident = proc.identity(pid)
                if ident is not None and ident.pgid == self.pgid:
                    self.members[pid] = ident.start_time
                    new = True
        return new

    def shm_paths(self) -> set[Path]:
        """The files under /dev/shm the globs name now (under the simulated host's,
        while its holder runs; none once it is gone)."""
        base = shm_dir(self.root)
        if base is None:
            return set()
        out: set[Path] = set()
        for pattern in self.shm:
            if base != SHM and pattern.startswith(f"{SHM}/"):
                pattern = f"{base}/{pattern[len(str(SHM)) + 1:]}"
            for pid in self.known() if "{pid}" in pattern else (None,):
                expanded = pattern.replace("{pid}", str(pid)) if pid is not None else pattern
                out |= {Path(p) for p in glob.glob(expanded)}
        return {p for p in out if _under_shm(p)}


def shm_dir(root: tuple[int, int] | None) -> Path | None:
    """/dev/shm, or that of the simulated host whose holder is ``root`` (pid, start
    time) as seen from here; None where that holder is gone (and its tmpfs with it)."""
    if root is None:
        return SHM
    now = proc.identity(root[0])
    if now is None or now.start_time != root[1]:
        return None
    return Path(f"/proc/{root[0]}/root/dev/shm")


def write(path: Path, entries: list[Entry], writer: proc.Identity | None = None,
          network: dict | None = None) -> None:
    """Write the record of ``entries`` started by ``writer`` and of the ``network`` of
    simulated hosts it made (delete it when there is neither)."""
    if not entries and network is None:
        path.unlink(missing_ok=True)
        _named(path).unlink(missing_ok=True)
        return
    doc = {
        "boot_id": proc.boot_id(),
        "writer": [writer.pid, writer.start_time] if writer else None,
        "processes": [e.to_json() for e in entries],
        **({"network": network} if network is not None else {}),
    }
    guard.write_atomic(path, json.dumps(doc, indent=2) + "\n")
    named = _named(path)  # after the record: a name never points at a record to come
    if not named.is_file():
        guard.write_atomic(named, json.dumps({"record": str(path.resolve()), **_here()}) + "\n")


def read(path: Path) -> tuple[str, list[Entry]]:
    """The boot id and entries of a record (:func:`read_network` its network); a
    record that cannot be read is an error
    that names it (never a reason to signal anything), and so is one whose writer still
    runs (:class:`StillRunning`)."""
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict):
            raise TypeError(f"JSON {json.dumps(doc)[:40]}, not an object")
        boot, entries = str(doc.get("boot_id", "")), [Entry.from_json(e) for e in doc["processes"]]
        writer = doc.get("writer")
        if writer is not None:
            writer = [int(writer[0]), int(writer[1])]
        alive = (writer and boot == proc.boot_id()
                 and (now := proc.identity(int(writer[0]))) is not None
                 and now.start_time == int(writer[1]))
    except OSError as exc:
        raise LocalFileError.from_os_error(exc) from None
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise LocalFileError(f"{path}: not a record of processes ({exc}); "
                             "end them by hand and delete it") from None
    if alive:
        raise StillRunning(f"{path.parent}: the run that started these servers (pid "
                           f"{writer[0]}) is still running; stop it (it reaps its own) "
                           "or use another --out")
    return boot, entries


def read_network(path: Path) -> netns.Network | None:
    """The network of simulated hosts a record names (None: none); an error that names
    the record where it cannot be read."""
    try:
        data = json.loads(path.read_text()).get("network")
        return netns.Network.from_json(data) if data is not None else None
    except OSError as exc:
        raise LocalFileError.from_os_error(exc) from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LocalFileError(f"{path}: its network is not one e2e made ({exc}); "
                             "remove its namespaces and links by hand") from None


@dataclasses.dataclass(frozen=True)
class NetworkReaped:
    """What :func:`reap` removed of a recorded network of simulated hosts."""

    record: Path
    network: str  # its id
    removed: tuple[str, ...]

    def line(self) -> str:
        what = (f"removed {', '.join(self.removed)}" if self.removed
                else "already gone")
        return f"{self.record.parent}: network of simulated hosts {self.network} {what}"

    def to_json(self) -> dict[str, Any]:
        return {"record": str(self.record), "network": self.network,
                "outcome": "removed" if self.removed else "gone",
                "removed": list(self.removed)}


@dataclasses.dataclass(frozen=True)
class Reaped:
    """What :func:`reap` did with one recorded process group."""

    record: Path
    name: str
    pgid: int
    outcome: str  # "ended", "gone" (nothing left to end), "pid reused" (left alone)
    pids: tuple[int, ...] = ()  # the members that were signalled
    shm_removed: tuple[str, ...] = ()

    def line(self) -> str:
        what = {
            "ended": f"ended process group {self.pgid} ({len(self.pids)} process(es))",
            "gone": "already gone",
            "pid reused": f"pid {self.pgid} now belongs to another process: left alone",
        }[self.outcome]
        shm = f"; removed {len(self.shm_removed)} shared-memory file(s)" if self.shm_removed else ""
        return f"{self.record.parent}: {self.name} {what}{shm}"

    def to_json(self) -> dict[str, Any]:
        return {"record": str(self.record), "name": self.name, "pgid": self.pgid,
                "outcome": self.outcome, "pids": list(self.pids),
                "shm_removed": list(self.shm_removed)}


def records(directory: Path) -> list[Path]:
    """The records in ``directory`` (an e2e ``--out``) and its run directories."""
    directory = Path(directory)
    found = [directory / RECORD, *sorted(directory.glob(f"*/{RECORD}"))]
    return [p for p in found if p.is_file()]


def reap(directory: Path, grace: float = 5.0) -> list[Reaped | NetworkReaped]:
    """End what the runs recorded in ``directory`` left running (see the module's
    invariants); what was done with each recorded group."""
    out: list[Reaped | NetworkReaped] = []
    for path in records(directory):
        out.extend(_reap_record(path, grace))
    return out


def reap_registered(grace: float = 5.0) -> tuple[list[Reaped | NetworkReaped], list[str]]:
    """End what killed runs left wherever they wrote (the records named in
    ``<cache>/e2e/live/``); a live run's record is left to it. What was done with each
    group, and a line per record that could not be read (kept, never signalled)."""
    out: list[Reaped | NetworkReaped] = []
    unreadable: list[str] = []
    if not _live().is_dir():
        return out, unreadable
    here = _here()
    for named in sorted(_live().iterdir()):
        if named.name.startswith("."):  # a name being written (guard.write_atomic)
            continue
        try:
            data = json.loads(named.read_text())
            path = Path(data["record"])
            place = {k: data[k] for k in here}
        except (OSError, ValueError, TypeError, KeyError):
            continue  # not one this version wrote: nothing to act on
        if place != here or not path.is_absolute() or path.name != RECORD:
            # Another host, container (pid namespace) or boot shares this cache: its
            # processes are not ours to judge, nor its /dev/shm ours to clean.
            continue
        if not path.is_file():
            named.unlink(missing_ok=True)  # the run closed, or was reaped
            continue
        try:
            out.extend(_reap_record(path, grace))
        except StillRunning:
            continue
        except HybridpdError as exc:
            unreadable.append(exc.message)
    return out, unreadable


def _reap_record(path: Path, grace: float) -> list[Reaped | NetworkReaped]:
    boot, entries = read(path)
    network = read_network(path)
    same_boot = boot == proc.boot_id()
    out: list[Reaped | NetworkReaped] = [
        _reap_one(path, entry, same_boot, grace) for entry in entries]
    if network is not None and same_boot:
        # Its servers are ended: nothing holds the namespaces any more. (Another boot
        # has none of them: /run/netns and the links do not outlive one.)
        try:
            removed = netns.remove(network)
        except netns.NetnsError as exc:
            raise LocalFileError(f"{path}: {exc.message}; the record is kept") from None
        out.append(NetworkReaped(path, network.id, tuple(removed)))
    path.unlink(missing_ok=True)
    _named(path).unlink(missing_ok=True)
    return out


def _here() -> dict[str, Any]:
    """Where a run's processes live: host, pid namespace and boot. A registered record
    is acted on only from the same place."""
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = None
    return {"host": socket.gethostname(), "pidns": pidns, "boot_id": proc.boot_id()}


def _live() -> Path:
    return cache.cache_dir() / "e2e" / "live"


def _named(record: Path) -> Path:
    """The file in ``<cache>/e2e/live/`` that names ``record`` while it exists."""
    key = hashlib.sha256(str(Path(record).resolve()).encode()).hexdigest()[:20]
    return _live() / key


def _reap_one(path: Path, entry: Entry, same_boot: bool, grace: float) -> Reaped:
    now = {pid: proc.identity(pid) for pid in entry.known()} if same_boot else {}
    ours = [pid for pid, ident in now.items()
            if ident is not None and ident.pgid == entry.pgid
            and ident.start_time == entry.known()[pid]]
    reused = [pid for pid, ident in now.items() if ident is not None and pid not in ours]
    if not ours:
        outcome = "pid reused" if reused else "gone"
        removed = _remove(entry.shm_paths()) if not reused else ()
        return Reaped(path, entry.name, entry.pgid, outcome, shm_removed=removed)
    members = proc.group_members(entry.pgid)
    shm = entry.shm_paths() | owned_shm(entry.pgid)
    _end_group(entry.pgid, grace)
    shm |= entry.shm_paths()  # named by a glob only once written
    return Reaped(path, entry.name, entry.pgid, "ended", tuple(sorted(members)),
                  _remove(shm) if not reused else ())


def owned_shm(pgid: int) -> set[Path]:
    """The files under /dev/shm the live members of group ``pgid`` map or hold open; a
    member in another mount namespace (a simulated host's) names its own /dev/shm,
    reached here through ``/proc/<pid>/root``."""
    mine = _mount_ns("self")
    out: set[Path] = set()
    for pid in proc.group_members(pgid):
        theirs = _mount_ns(str(pid))
        for p in proc.shm_files(pid):
            if theirs is not None and theirs != mine:
                p = Path(f"/proc/{pid}/root{p}")
            if _under_shm(p):
                out.add(p)
    return out


def _mount_ns(pid: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def _end_group(pgid: int, grace: float) -> None:
    """SIGTERM to the group, SIGKILL to what is left after ``grace`` s; wait until the
    kernel has ended them all (their zombies are init's to reap)."""
    proc.signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while proc.group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if proc.group_members(pgid):
        proc.signal_group(pgid, signal.SIGKILL)
    settle = time.monotonic() + 5
    while proc.group_members(pgid) and time.monotonic() < settle:
        time.sleep(0.05)


#: A simulated host's /dev/shm seen from the root mount namespace.
_HOST_SHM = re.compile(r"^/proc/\d+/root/dev/shm$")


def _under_shm(path: Path) -> bool:
    return ".." not in path.parts and (
        path.parent == SHM or bool(_HOST_SHM.match(str(path.parent))))


def _remove(paths: set[Path]) -> tuple[str, ...]:
    removed = []
    for p in sorted(paths):
        try:
            p.unlink()
            removed.append(str(p))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise LocalFileError.from_os_error(exc) from None
    return tuple(removed)
