"""hybridpd.e2e.servers: start, readiness, failure naming and reaping, with a dummy server.

The dummy is a real HTTP server in its own process that also forks a child (like
vLLM's API server forks its engine core), so reaping is proven on the whole group.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import random
import socket

from hybridpd.e2e import servers
from hybridpd.e2e.servers import (
    ProcessFailed,
    Processes,
    StartupFailed,
    free_port,
    group_members,
)

DUMMY = textwrap.dedent(
    """
    import http.server, os, sys, time
    port, delay, mode = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    child = os.fork()
    if child == 0:  # the "engine core": ignores SIGTERM, so only SIGKILL ends it
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN) if mode == "stubborn" else None
        while True:
            time.sleep(1)
    print("starting", flush=True)
    time.sleep(delay)
    if mode == "crash":
        print("engine core died: boom", flush=True)
        sys.exit(3)
    if mode == "hang-in-use":  # vLLM's NIXL listener thread: dies, the engine waits
        print("zmq.error.ZMQError: Address already in use (tcp://localhost:1)", flush=True)
        while True:
            time.sleep(1)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers()
            self.wfile.write(b"ok")
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


@pytest.fixture
def dummy(tmp_path: Path) -> Path:
    path = tmp_path / "dummy_server.py"
    path.write_text(DUMMY)
    return path


def _start(procs: Processes, dummy: Path, name: str, delay: float = 0.2, mode: str = "ok"):
    port = free_port()
    proc = procs.start(name, [sys.executable, dummy, port, delay, mode])
    return proc, f"http://127.0.0.1:{port}/"


def test_ready_then_everything_reaped(tmp_path: Path, dummy: Path) -> None:
    with Processes(tmp_path / "logs", grace=2) as procs:
        a, url_a = _start(procs, dummy, "prefill")
        b, url_b = _start(procs, dummy, "decode", delay=0.5)
        seen = []
        ready = procs.wait_ready({"prefill": url_a, "decode": url_b}, 20, seen.append)
        assert set(ready) == {"prefill", "decode"}
        assert seen and "ready" in seen[-1]
        groups = [a.pid, b.pid]
        assert all(len(group_members(g)) == 2 for g in groups)  # server + forked child
    assert procs.leftovers() == {}
    assert all(group_members(g) == [] for g in groups)
    assert (tmp_path / "logs" / "prefill.log").read_text().startswith("$ ")


def test_stubborn_children_are_killed(tmp_path: Path, dummy: Path) -> None:
    with Processes(tmp_path / "logs", grace=1) as procs:
        proc, url = _start(procs, dummy, "decode", mode="stubborn")
        procs.wait_ready({"decode": url}, 20)
    assert group_members(proc.pid) == []


def test_crash_during_startup_names_the_process(tmp_path: Path, dummy: Path) -> None:
    with pytest.raises(ProcessFailed) as info:
        with Processes(tmp_path / "logs", grace=1) as procs:
            _, url_ok = _start(procs, dummy, "prefill")
            crash, url = _start(procs, dummy, "decode", delay=0.3, mode="crash")
            procs.wait_ready({"prefill": url_ok, "decode": url}, 20)
    err = info.value
    assert err.name == "decode"
    assert "exited with status 3" in str(err)
    assert "engine core died: boom" in str(err)
    assert str(tmp_path / "logs" / "decode.log") in str(err)
    assert procs.leftovers() == {}


def test_killed_mid_run_interrupts_the_main_thread(tmp_path: Path, dummy: Path) -> None:
    """A server killed while the run blocks on something else ends the run, named.

    The blocking call is a sleep far longer than the deadline: the watchdog must break
    into it (a flag-only interrupt would be seen only after the sleep returns).
    """
    with pytest.raises(ProcessFailed) as info:
        with Processes(tmp_path / "logs", grace=1, poll=0.1) as procs:
            proc, url = _start(procs, dummy, "decode")
            procs.wait_ready({"decode": url}, 20)
            os.kill(proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            time.sleep(300)  # stands for a request that would hang
    assert time.monotonic() - killed < 30
    assert "decode was killed by SIGKILL" in str(info.value)
    assert procs.leftovers() == {}


def test_a_wake_up_after_the_run_ended_is_ignored(tmp_path: Path, dummy: Path) -> None:
    with Processes(tmp_path / "logs", grace=1, poll=0.1) as procs:
        _start(procs, dummy, "decode")
    procs._armed = False
    procs._on_wake(signal.SIGUSR1, None)  # no exception once the context has ended
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_not_ready_in_time(tmp_path: Path, dummy: Path) -> None:
    with pytest.raises(ProcessFailed, match="prefill not ready after 1 s"):
        with Processes(tmp_path / "logs", grace=1) as procs:
            _, url = _start(procs, dummy, "prefill", delay=30)
            procs.wait_ready({"prefill": url}, 1)
    assert procs.leftovers() == {}


def test_expected_stop_is_not_a_failure(tmp_path: Path, dummy: Path) -> None:
    with Processes(tmp_path / "logs", grace=1) as procs:
        _, url = _start(procs, dummy, "decode")
        procs.wait_ready({"decode": url}, 20)
        procs.stop("decode")
        procs.check()  # no ProcessFailed


def test_check_soon_waits_for_the_exit_to_show(tmp_path: Path, dummy: Path) -> None:
    with pytest.raises(ProcessFailed, match="decode was killed by SIGKILL"):
        with Processes(tmp_path / "logs", grace=1, poll=60) as procs:  # watchdog asleep
            proc, url = _start(procs, dummy, "decode")
            procs.wait_ready({"decode": url}, 20)
            threading.Timer(0.3, os.kill, (proc.pid, signal.SIGKILL)).start()
            procs.check_soon(within=5)


def test_free_ports_come_from_below_the_ephemeral_range_and_never_twice() -> None:
    low, _ = servers.ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(10000 <= p < low for p in ports), ports


def test_free_port_skips_a_port_something_listens_on() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]

        class Fixed(random.Random):  # offers the busy port first, then another one
            offers = [busy, busy + 1 if busy + 1 < 60000 else busy - 1]

            def randint(self, a, b):
                return self.offers.pop(0) if self.offers else super().randint(a, b)

        port = free_port(Fixed(), ephemeral=(65000, 65535))
    assert port != busy


def test_free_port_falls_back_to_the_kernel_without_room_below_the_range() -> None:
    port = free_port(ephemeral=(1024, 65535))
    assert port > 0 and port not in (free_port(ephemeral=(1024, 65535)),)


def test_a_server_that_hangs_after_its_port_was_taken_fails_fast(tmp_path: Path, dummy: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(StartupFailed) as info:
        with Processes(tmp_path / "logs", grace=1) as procs:
            proc, url = _start(procs, dummy, "decode", delay=0.1, mode="hang-in-use")
            procs.wait_ready({"decode": url}, 60)
    assert time.monotonic() - t0 < 30  # not the ready timeout
    assert info.value.port_in_use
    assert "decode failed to start: zmq.error.ZMQError: Address already in use" in str(info.value)
    assert str(tmp_path / "logs" / "decode.log") in str(info.value)
    assert group_members(proc.pid) == []  # reaped all the same


def test_start_pair_starts_again_on_new_ports_when_a_port_was_taken(monkeypatch, tmp_path: Path) -> None:
    from hybridpd.e2e import pair as pair_mod

    attempts, stopped = [], []

    def once(procs, *args):
        attempts.append(1)
        if len(attempts) < 3:
            raise StartupFailed("decode", "Address already in use (tcp://localhost:1)", None)
        return pair_mod.Pair("p", "d", "x")

    class Procs:
        procs = {"prefill": 1, "decode": 1, "proxy": 1}

        def stop(self, name):
            stopped.append(name)

    monkeypatch.setattr(pair_mod, "_start_pair_once", once)
    said = []
    pair = pair_mod.start_pair(Procs(), None, "m", "nixl", "kv_both", pair_mod.ServerOptions(),
                               said.append)
    assert pair.decode == "d" and len(attempts) == 3
    assert stopped == ["proxy", "decode", "prefill"] * 2
    assert "starting the pair again on new ports (2/3)" in said[0]

    attempts.clear()
    monkeypatch.setattr(pair_mod, "START_ATTEMPTS", 2)
    with pytest.raises(StartupFailed):
        pair_mod.start_pair(Procs(), None, "m", "nixl", "kv_both", pair_mod.ServerOptions(),
                               said.append)


def test_start_pair_does_not_retry_other_startup_failures(monkeypatch) -> None:
    from hybridpd.e2e import pair as pair_mod

    def once(*args):
        raise StartupFailed("decode", "something else", None)

    monkeypatch.setattr(pair_mod, "_start_pair_once", once)
    with pytest.raises(StartupFailed, match="something else"):
        pair_mod.start_pair(None, None, "m", "nixl", "kv_both", pair_mod.ServerOptions(), print)
