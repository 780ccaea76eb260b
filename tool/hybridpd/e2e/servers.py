"""Start, watch and reap the processes of an e2e run (vLLM servers, the proxy).

Invariants:

- every process starts in its own session (``start_new_session=True``), so its
  process group id is its pid and covers the children it forks (vLLM's engine core
  and workers); stopping a process signals that group, by id, and nothing else;
- every process writes stdout+stderr to ``<log_dir>/<name>.log``, which is kept
  whatever happens;
- the run directory's ``processes.json`` (:mod:`.reap`) records each group (pid,
  process group id, start time, the members seen so far, the shared-memory files it
  may leave) from its start until it is stopped, so that what a SIGKILLed run left can
  be reaped later (:func:`.reap.reap`) without guessing;
- :meth:`Processes.close` (also on ``__exit__``, on Ctrl-C, on SIGTERM or SIGHUP, and
  after a failure) stops every group it started: SIGTERM, a grace period, then
  SIGKILL, and waits for each direct child so none is left as a zombie; a signal that
  arrives while it does so is held until it is done (then raised), never left to cut
  the reaping short; it removes the shared-memory files the record names, then the
  network of simulated hosts (:mod:`.netns`) the record names, once nothing runs in it;
- a process that exits while it is expected to run is a failure that names it: the
  watchdog thread wakes the main thread with a real signal (``SIGUSR1``, sent to that
  thread), whose handler raises there, so even a blocking call (a sleep, a request
  that would hang) ends within the watchdog's poll interval; the context turns it into
  :class:`ProcessFailed` (its exit status and the tail of its log). ``_thread.
  interrupt_main`` is not enough: it only sets a flag that a blocking call never reads.
"""

from __future__ import annotations

import _thread
import os
import random
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from hybridpd import proc as proc_mod
from hybridpd.e2e import netns
from hybridpd.e2e import reap as reap_mod
from hybridpd.errors import HybridpdError
from hybridpd.proc import group_members
from hybridpd.proc import signal_group as _signal_group
from hybridpd.progress import Log

#: The log line of a server whose port was taken between our pick and its bind.
ADDRESS_IN_USE = "Address already in use"

# The signal the watchdog sends to the main thread when a process died.
_WAKE = signal.SIGUSR1
#: Signals that end a run, reaping its processes first (one ignored, as under nohup,
#: stays ignored).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Woken(BaseException):
    """Raised in the main thread by the watchdog's signal; becomes ProcessFailed."""


class E2EError(HybridpdError):
    """An e2e run failed; the logs named in the message are kept."""


class ProcessFailed(E2EError):
    """A process of the run exited (or never became ready)."""

    def __init__(self, name: str, reason: str, log: Path | None, tail: str = ""):
        self.name, self.reason, self.log, self.tail = name, reason, log, tail
        where = f"; log: {log}" if log else ""
        last = f"; last line: {tail.splitlines()[-1].strip()[:200]}" if tail.strip() else ""
        super().__init__(f"{name} {reason}{where}{last}")


class StartupFailed(ProcessFailed):
    """A starting process logged a line that means it will never get ready.

    Some failures do not end the process: vLLM's NIXL side-channel listener dies
    in its own thread when its port is taken, and the engine waits for it forever.
    """

    def __init__(self, name: str, line: str, log: Path | None):
        self.line = line
        super().__init__(name, f"failed to start: {line.strip()[:200]}", log)

    @property
    def port_in_use(self) -> bool:
        return ADDRESS_IN_USE in self.line


#: Ports handed out by :func:`free_port` in this process: never handed out twice.
_GIVEN: set[int] = set()


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The ports the kernel picks for ``bind(0)`` and outgoing connections."""
    try:
        low, high = (int(x) for x in Path(path).read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(rng: random.Random | None = None, ephemeral: tuple[int, int] | None = None) -> int:
    """A TCP port nothing listens on now, and that nothing else is likely to take.

    A server binds its port seconds after we pick it (vLLM's NIXL side channel only
    after the model loaded). A port from the kernel's ephemeral range can be taken
    in between: by ``bind(0)`` of the servers themselves (vLLM's engine and ZMQ
    ports) or as the local end of any outgoing connection. So pick below that range
    (where only explicit binds go), check that it binds on all addresses, and never
    hand the same port out twice; fall back to the kernel's choice when there is no
    room below the range.
    """
    rng = rng or random.SystemRandom()
    low, _ = ephemeral or ephemeral_range()
    lo, hi = 10000, low - 1
    for _ in range(200 if hi - lo > 100 else 0):
        port = rng.randint(lo, hi)
        if port not in _GIVEN and _bindable(port):
            _GIVEN.add(port)
            return port
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def _bindable(port: int) -> bool:
    for host in ("0.0.0.0", "127.0.0.1"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def new_lines(path: Path, offset: int) -> tuple[str, int]:
    """The whole lines ``path`` gained past byte ``offset``, and the offset after them (a
    partial last line is read again next time); ``("", offset)`` while it does not
    exist."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return "", offset
    end = data.rfind(b"\n") + 1
    return data[:end].decode(errors="replace"), offset + end


@dataclass
class Proc:
    name: str
    cmd: list[str]
    log: Path
    popen: proc_mod.Child
    started: float = field(default_factory=time.monotonic)
    expect_running: bool = True
    _scanned: int = 0  # bytes of the log :meth:`fatal_line` has read

    def fatal_line(self, markers: Sequence[str]) -> str | None:
        """The first new log line holding one of ``markers`` (whole lines only)."""
        if not markers:
            return None
        try:
            text, self._scanned = new_lines(self.log, self._scanned)
        except OSError:
            return None
        for line in text.splitlines():
            if any(m in line for m in markers):
                return line
        return None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def failure(self, reason: str) -> ProcessFailed:
        return ProcessFailed(self.name, reason, self.log, log_tail(self.log))


class Processes:
    """The processes of one run; a context manager that always reaps them."""

    def __init__(self, log_dir: Path, *, grace: float = 15.0, poll: float = 0.5):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.grace, self.poll = grace, poll
        self.procs: dict[str, Proc] = {}
        self.record = self.log_dir / reap_mod.RECORD
        self._entries: dict[str, reap_mod.Entry] = {}
        self.network: netns.Network | None = None  # recorded before it is made
        self._writer = proc_mod.identity(os.getpid())
        self._closing = False
        self._holding = False  # in start(): between the fork and the record
        self._held: int | None = None  # a stop signal that arrived meanwhile
        self.failure: ProcessFailed | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._old_handlers: dict[int, object] = {}
        self._main: int | None = None  # the thread the watchdog wakes with _WAKE
        self._armed = False

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "Processes":
        if threading.current_thread() is threading.main_thread():
            self._main = threading.get_ident()
            self._old_handlers[_WAKE] = signal.signal(_WAKE, self._on_wake)
            for sig in STOP_SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._old_handlers[sig] = signal.signal(sig, self._on_stop)
        self._armed = True
        self._watchdog = threading.Thread(target=self._watch, name="e2e-watchdog", daemon=True)
        self._watchdog.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._closing = True  # a stop signal from now on is held (see _on_stop)
        self._armed = False  # a wake-up that arrives from now on is ignored
        self.close()
        if self._watchdog is not None:
            self._watchdog.join()  # no wake-up can be sent once the handler is gone
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()
        # A watchdog wake-up (or, off the main thread, its KeyboardInterrupt): report
        # what died instead.
        if exc_type in (_Woken, KeyboardInterrupt) and self.failure is not None:
            raise self.failure from None
        if exc_type is None and self._held is not None:
            raise KeyboardInterrupt(signal.Signals(self._held).name)
        return False

    def _on_stop(self, signum, frame) -> None:
        if self._closing or self._holding:  # finish reaping (or recording), then stop
            self._held = signum
            return
        raise KeyboardInterrupt(signal.Signals(signum).name)

    def _on_wake(self, signum, frame) -> None:
        if self._armed:
            raise _Woken()

    def _wake_main(self) -> None:
        if self._main is not None:
            signal.pthread_kill(self._main, _WAKE)
        else:  # used off the main thread: no handler of ours to run there
            _thread.interrupt_main()

    def start(
        self,
        name: str,
        cmd: Sequence[str | os.PathLike],
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        shm: Sequence[str] = (),
        root: int | None = None,
    ) -> Proc:
        """Start ``name`` in its own session and record it. ``shm``: globs of the
        shared-memory files it may leave under /dev/shm (``{pid}``: any pid of its
        group), removed when it is stopped or reaped; ``root``: the holder pid of the
        simulated host it runs on, whose /dev/shm that is (:mod:`.netns`)."""
        if name in self.procs and self.procs[name].popen.poll() is None:
            raise E2EError(f"{name} is already running")
        log = self.log_dir / f"{name}.log"
        cmd = [str(c) for c in cmd]
        # A stop signal between the fork and the record would leave a group that
        # neither close() nor a later reap knows of: it waits until both are done.
        self._holding = True
        try:
            popen = proc_mod.start(cmd, log, cwd=cwd, env=env)
            proc = Proc(name, cmd, log, popen)
            with self._lock:
                self.procs[name] = proc
                entry = reap_mod.Entry.of(name, popen.pid, tuple(shm), root)
                if entry is not None:
                    self._entries[name] = entry
                    self._write_record()
        finally:
            self._holding = False
        if self._held is not None and not self._closing:
            raise KeyboardInterrupt(signal.Signals(self._held).name)
        return proc

    def _write_record(self) -> None:
        """Write processes.json (the caller holds the lock)."""
        reap_mod.write(self.record, list(self._entries.values()), self._writer,
                       self.network.to_json() if self.network is not None else None)

    def make_network(self, network: netns.Network) -> None:
        """Record ``network``, then make it (:func:`.netns.create`); :meth:`close`
        removes it, or a later reap where this run is killed."""
        if self.network is not None:
            raise E2EError(f"this run already has the network {self.network.id}")
        with self._lock:
            self.network = network
            self._write_record()
        try:
            netns.create(network)
        except netns.NetnsError as exc:
            raise E2EError(f"cannot make the simulated hosts' network: {exc.message}") from None

    def _record_members(self) -> None:
        """Add the members each group gained (vLLM's engine core, its workers)."""
        with self._lock:
            if any([e.add_members(group_members(e.pgid)) for e in self._entries.values()]):
                self._write_record()

    def stop(self, name: str, *, keep_shm: bool = False) -> int | None:
        """Stop ``name``'s process group (expected: not a failure); its exit status.
        ``keep_shm``: leave its shared-memory files (and its record, which names them)
        until :meth:`close`, for a check of who else removes them."""
        proc = self.procs[name]
        proc.expect_running = False
        owned = {name: reap_mod.owned_shm(proc.pid)}
        code = self._terminate([proc])[0]
        if not keep_shm:
            self._forget(owned)
        return code

    def shm_files(self, name: str) -> set[Path]:
        """The shared-memory files ``name``'s record names now (its globs over every
        pid its group had)."""
        self._record_members()
        with self._lock:
            entry = self._entries.get(name)
            return entry.shm_paths() if entry is not None else set()

    def close(self) -> None:
        self._closing = True
        self._stop.set()
        with self._lock:
            procs = list(self.procs.values())
            for p in procs:
                p.expect_running = False
        owned = {p.name: reap_mod.owned_shm(p.pid) for p in procs}
        self._terminate(procs)
        self._forget(owned)
        self._remove_network()

    def _remove_network(self) -> None:
        """Remove the run's network once no recorded group is left in it (a group left
        keeps it, and the record, for a later reap)."""
        with self._lock:
            if self.network is None or self._entries:
                return
            try:
                netns.remove(self.network)
            except netns.NetnsError as exc:
                raise E2EError(f"{exc.message}; `hybridpd e2e --reap {self.log_dir}` "
                               "removes it") from None
            self.network = None
            self._write_record()

    def _forget(self, owned: Mapping[str, set[Path]]) -> None:
        """Drop stopped groups from the record and remove their shared-memory files
        (the record's globs, and ``owned``: those their members had open before they
        were stopped); a group with members left stays recorded (for a later reap)."""
        with self._lock:
            for name, files in owned.items():
                entry = self._entries.get(name)
                if entry is None or group_members(entry.pgid):
                    continue
                for path in entry.shm_paths() | files:
                    path.unlink(missing_ok=True)
                del self._entries[name]
            self._write_record()

    def _terminate(self, procs: Sequence[Proc]) -> list[int | None]:
        for p in procs:
            _signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        for p in procs:
            # The leader may exit before its children: wait for the whole group.
            while time.monotonic() < deadline and (p.popen.poll() is None or group_members(p.pid)):
                time.sleep(0.1)
            if p.popen.poll() is None or group_members(p.pid):
                _signal_group(p.pid, signal.SIGKILL)
            proc_mod.wait(p.popen, 10)
            # SIGKILL is asynchronous: give the kernel a moment to end the children.
            settle = time.monotonic() + 5
            while group_members(p.pid) and time.monotonic() < settle:
                time.sleep(0.05)
        return [p.popen.returncode for p in procs]

    def leftovers(self) -> dict[str, list[int]]:
        """Members still alive in each started group (should be empty after close)."""
        return {p.name: m for p in self.procs.values() if (m := group_members(p.pid))}

    # ------------------------------------------------------------------ watching

    def check(self) -> None:
        """Raise :class:`ProcessFailed` if a process that should run has exited."""
        if self.failure is not None:
            raise self.failure
        for p in list(self.procs.values()):
            code = p.popen.poll()
            if code is not None and p.expect_running:
                self.failure = p.failure(_exit_reason(code))
                raise self.failure

    def check_soon(self, within: float = 3.0) -> None:
        """Like :meth:`check`, but waits ``within`` seconds for an exit to show.

        For a request that just failed: a server killed mid-request closes its
        sockets a moment before its exit status can be read, and "decode was killed
        by SIGKILL" explains the failure better than the broken response does.
        """
        deadline = time.monotonic() + within
        while True:
            self.check()
            if time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            self._record_members()
            with self._lock:
                procs = list(self.procs.values())
            for p in procs:
                code = p.popen.poll()
                if code is not None and p.expect_running and self.failure is None:
                    self.failure = p.failure(_exit_reason(code))
                    self._wake_main()
                    return

    def wait_ready(
        self,
        urls: Mapping[str, str],
        timeout: float,
        progress: Log | None = None,
        fatal: Sequence[str] = (ADDRESS_IN_USE,),
    ) -> dict[str, float]:
        """Poll each ``name -> url`` until it answers 200; seconds each took.

        Fails as soon as one of the named processes exits, logs a line holding one
        of ``fatal`` (:class:`StartupFailed`), or at ``timeout``.
        """
        t0 = time.monotonic()
        pending = dict(urls)
        ready: dict[str, float] = {}
        last_shown = -1
        while pending:
            self.check()
            for name in pending:
                line = self.procs[name].fatal_line(fatal)
                if line is not None:
                    # Not kept as self.failure: the caller may stop the process
                    # and start it again (a port taken under it).
                    raise StartupFailed(name, line, self.procs[name].log)
            for name, url in list(pending.items()):
                if _http_ok(url):
                    ready[name] = round(time.monotonic() - self.procs[name].started, 1)
                    del pending[name]
            elapsed = time.monotonic() - t0
            if progress and (int(elapsed) != last_shown or not pending):
                last_shown = int(elapsed)
                parts = [f"{n} ready ({s:.0f} s)" for n, s in ready.items()]
                parts += [f"{n} starting" for n in pending]
                progress(f"[{elapsed:4.0f} s] " + ", ".join(parts))
            if not pending:
                break
            if elapsed > timeout:
                name = next(iter(pending))
                self.failure = self.procs[name].failure(f"not ready after {timeout:.0f} s")
                raise self.failure
            time.sleep(min(self.poll, 0.5))  # the watchdog may poll slower
        return ready


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"
