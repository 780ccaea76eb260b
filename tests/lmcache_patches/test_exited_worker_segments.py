"""The shared-memory segments of a worker that was killed do not outlive it.

Patch: cpu-shm-exited-worker-segments. On a CPU engine LMCache shares the KV cache with
its server through POSIX shared-memory segments that the worker creates and unlinks at
exit. Measured in the CPU e2e (vLLM 0.32.0, ``--connector lmcache+nixl``): vLLM stopped
with SIGTERM left its whole KV cache behind as ``/dev/shm/lmcache_kv_<pid>_*``, because
vLLM's API server kills the engine core and its worker within the same second, before
any cleanup of theirs runs. Patched, the server removes a registration's segments whose
creating process (verified at registration: it maps the segment) has exited when it
releases the registration: when it reaps the silent worker, and when the server stops;
and, when the worker unregistered while it still ran (what vLLM's connector does as vLLM
stops, just before the worker is killed; measured in the CPU e2e), once it has exited.

A real worker (vLLM's allocation, vLLM's LMCacheMPConnector; a plain-attention layout,
which stock LMCache registers on CPU) registers from a child process that is then
SIGKILLed; a live worker registered beside it (another child, still running) must keep
its segments.
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

from lmcache_patches import deployment

SHM = Path("/dev/shm")

# Registers a worker with the server on PORT, prints its segments, then dies the way
# vLLM's engine core does on SIGTERM: without running any cleanup.
CHILD = """
import json, os, signal, sys
sys.path.insert(0, TESTS)
import lmcache_patches.conftest  # finds lmcache's compiled modules, as under pytest
from lmcache_patches import deployment
worker = deployment.allocate_worker(deployment.vllm_config(PORT), hybrid=False)
worker.connector.register_kv_caches(worker.kv_caches)
names = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"lmcache_kv_{os.getpid()}_"))
if UNREGISTER:  # what vLLM's connector does as vLLM stops, just before it is killed
    worker.connector.shutdown()
print(json.dumps(names), flush=True)
if LIVE:  # stays alive until the test closes its stdin
    sys.stdin.read()
os.kill(os.getpid(), signal.SIGKILL)
"""


def _segments(pid: int) -> set[str]:
    return {p.name for p in SHM.glob(f"lmcache_kv_{pid}_*")}


@pytest.fixture
def leftovers():
    """Segments a failed run leaves, removed after the test."""
    names: set[str] = set()
    yield names
    for name in names:
        (SHM / name).unlink(missing_ok=True)


def _code(port: int, unregister: bool = False, live: bool = False) -> str:
    return CHILD.replace("TESTS", repr(str(Path(__file__).parents[1]))).replace(
        "PORT", str(port)).replace("UNREGISTER", str(unregister)).replace("LIVE", str(live))


def _run_child(port: int, leftovers: set[str], unregister: bool = False) -> set[str]:
    code = _code(port, unregister)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=300)
    leftovers.update(n for n in os.listdir(SHM) if n.startswith(f"lmcache_kv_{proc.pid}_"))
    assert proc.returncode == -signal.SIGKILL, err[-3000:]
    names = set(json.loads(out.strip().splitlines()[-1]))
    assert names, "the worker registered no shared-memory segment"
    assert names <= _segments(proc.pid), "the killed worker's segments are already gone"
    return names


@pytest.mark.patch("cpu-shm-exited-worker-segments")
def test_a_reaped_killed_worker_leaves_no_segment(server, leftovers):
    live = subprocess.Popen([sys.executable, "-c", _code(server.port, live=True)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        _reap_beside(server, leftovers, live)
    finally:
        live.stdin.close()
        live.wait(timeout=60)


def _reap_beside(server, leftovers, live):
    from lmcache.v1.multiprocess.modules.lmcache_driven_transfer import (
        LMCacheDrivenTransferModule,
    )

    line = live.stdout.readline()
    leftovers.update(_segments(live.pid))
    live_segments = set(json.loads(line))
    assert live_segments, "the live worker registered no shared-memory segment"
    killed = _run_child(server.port, leftovers)

    transfer = server._module(LMCacheDrivenTransferModule)
    assert len(transfer.context_entries_snapshot()) == 2
    # Both are silent: the server's reaper would reap them after its timeout.
    reaped = transfer.reap_stale_instances(0.0, 0.0)

    assert len(reaped) == 2
    assert not (killed & {p.name for p in SHM.iterdir()}), (
        f"the killed worker's segments {sorted(killed)} outlived its registration")
    assert live_segments <= _segments(live.pid), "a live worker's segment was removed"
    # A restarted server could map them again by name (the worker's re-registration).
    from lmcache.v1.multiprocess.posix_shm import shm_map_readwrite, shm_munmap

    for name in live_segments:
        size = (SHM / name).stat().st_size
        shm_munmap(shm_map_readwrite(name, size), size)


@pytest.mark.patch("cpu-shm-exited-worker-segments")
def test_a_stopping_server_removes_a_killed_workers_segments(leftovers):
    with deployment.lmcache_server() as server:
        killed = _run_child(server.port, leftovers)
    assert not (killed & {p.name for p in SHM.iterdir()}), (
        f"the killed worker's segments {sorted(killed)} outlived the server")


@pytest.mark.patch("cpu-shm-exited-worker-segments")
def test_a_worker_that_unregisters_and_is_then_killed_leaves_no_segment(server, leftovers):
    """vLLM stopped with SIGTERM: its worker unregisters (still running, so its segments
    cannot go yet) and is killed before its own cleanup unlinks them."""
    from lmcache.v1.multiprocess.modules.lmcache_driven_transfer import (
        LMCacheDrivenTransferModule,
    )

    killed = _run_child(server.port, leftovers, unregister=True)
    transfer = server._module(LMCacheDrivenTransferModule)
    assert transfer.context_entries_snapshot() == {}, "the worker did not unregister"
    deadline = time.monotonic() + 10  # the server watches a live creator's segments
    while killed & {p.name for p in SHM.iterdir()} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (killed & {p.name for p in SHM.iterdir()}), (
        f"the unregistered, then killed worker's segments {sorted(killed)} outlived it")
