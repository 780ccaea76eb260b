# SPDX-License-Identifier: Apache-2.0
"""Tests for removing the CPU KV segments of a worker that exited.

A worker unlinks the POSIX SHM segments it created when it exits cleanly.
One killed first (on SIGTERM, vLLM's API server kills its engine core and
workers within a second) cannot, so the server removes them when it
releases the registration (``CPUCacheContext.close``): those whose creator
it verified at registration, once that creator has exited (vLLM's connector
unregisters from the still-running worker as vLLM stops, and the worker is
killed before its own cleanup).
"""

# Standard
import os
import subprocess
import sys
import time

# Third Party
import pytest
import torch

# First Party
from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper
from lmcache.v1.platform.cache_context import create_cache_context
from lmcache.v1.platform.devices.cpu import shm as cpu_shm
from lmcache.v1.platform.devices.cpu import shm_segments
from lmcache.v1.platform.devices.cpu.shm import (
    CpuShmTensorWrapper,
    migrate_to_shm_and_wrap,
)

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/dev/shm"), reason="POSIX SHM segments live in /dev/shm"
)


@pytest.fixture(autouse=True)
def _fast_watcher(monkeypatch):
    """Poll often, and leave no watched segment to the next test."""
    monkeypatch.setattr(shm_segments, "_EXITED_CREATOR_POLL_S", 0.05)
    yield
    with shm_segments._PENDING_LOCK:
        shm_segments._PENDING_SEGMENTS.clear()


# A worker that shares vLLM-style KV tensors, prints their wire descriptors,
# waits until the server has registered them (its stdin closes), then exits
# the way a killed one does: no atexit handler, no finalizer.
_WORKER = """
import os, sys
import torch
from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper
from lmcache.v1.platform.devices.cpu.shm import migrate_to_shm_and_wrap
kv = [torch.zeros(2, 8, 16, 4, 32, dtype=torch.float16) for _ in range(2)]
for tensor in kv:
    print(DeviceIPCWrapper.Serialize(migrate_to_shm_and_wrap(tensor)).hex())
print("", flush=True)
sys.stdin.read()
os._exit(0)
"""


def _path(wrapper: CpuShmTensorWrapper) -> str:
    return "/dev/shm/" + wrapper.shm_name.lstrip("/")


def _received(line: str) -> CpuShmTensorWrapper:
    """A wire descriptor as the server receives it."""
    wrapper = DeviceIPCWrapper.Deserialize(bytes.fromhex(line))
    assert isinstance(wrapper, CpuShmTensorWrapper)
    return wrapper


def test_close_removes_an_exited_workers_segments() -> None:
    worker = subprocess.Popen(
        [sys.executable, "-c", _WORKER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert worker.stdin is not None and worker.stdout is not None
    wrappers: list[CpuShmTensorWrapper] = []
    try:
        for line in iter(worker.stdout.readline, "\n"):
            wrappers.append(_received(line))
        assert wrappers
        # Registered while the worker runs, as the server registers it.
        context = create_cache_context(list(wrappers), lmcache_tokens_per_chunk=16)
        worker.stdin.close()
        assert worker.wait(timeout=60) == 0
        assert all(os.path.exists(_path(w)) for w in wrappers)

        context.close()

        assert not any(os.path.exists(_path(w)) for w in wrappers)
    finally:
        worker.kill()
        worker.wait()
        for w in wrappers:
            if os.path.exists(_path(w)):
                os.unlink(_path(w))


def _start_worker() -> tuple[subprocess.Popen[str], list[CpuShmTensorWrapper]]:
    worker = subprocess.Popen(
        [sys.executable, "-c", _WORKER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert worker.stdout is not None
    wrappers = [_received(line) for line in iter(worker.stdout.readline, "\n")]
    return worker, wrappers


def _stop_worker(
    worker: subprocess.Popen[str], wrappers: list[CpuShmTensorWrapper]
) -> None:
    worker.kill()
    worker.wait()
    for w in wrappers:
        if os.path.exists(_path(w)):
            os.unlink(_path(w))


def _gone_within(wrappers: list[CpuShmTensorWrapper], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(os.path.exists(_path(w)) for w in wrappers):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_close_removes_a_live_workers_segments_once_it_exits() -> None:
    """The worker unregisters while it runs, then dies before its cleanup."""
    worker, wrappers = _start_worker()
    try:
        assert wrappers
        context = create_cache_context(list(wrappers), lmcache_tokens_per_chunk=16)

        context.close()

        assert all(os.path.exists(_path(w)) for w in wrappers)
        assert worker.stdin is not None
        worker.stdin.close()
        assert worker.wait(timeout=60) == 0
        assert _gone_within(wrappers, 10 * shm_segments._EXITED_CREATOR_POLL_S)
    finally:
        _stop_worker(worker, wrappers)


def test_a_segment_removed_or_created_again_under_its_name_is_left_alone() -> None:
    """The worker unlinked its segments itself, and a new one has the name (a
    worker with the same PID, or the same worker again): that file stays."""
    worker, wrappers = _start_worker()
    try:
        context = create_cache_context(list(wrappers), lmcache_tokens_per_chunk=16)
        context.close()
        recreated = wrappers[0]
        for w in wrappers:
            cpu_shm.shm_unlink(w.shm_name)
        cpu_shm.shm_create_readwrite(recreated.shm_name, 4096)
        assert worker.stdin is not None
        worker.stdin.close()
        assert worker.wait(timeout=60) == 0

        time.sleep(3 * shm_segments._EXITED_CREATOR_POLL_S)

        assert os.path.exists(_path(recreated))
        assert not shm_segments._PENDING_SEGMENTS
        cpu_shm.shm_unlink(recreated.shm_name)
    finally:
        _stop_worker(worker, wrappers)


def test_close_keeps_a_live_workers_segments() -> None:
    kv = [torch.zeros(2, 8, 16, 4, 32, dtype=torch.float16) for _ in range(2)]
    wrappers = [migrate_to_shm_and_wrap(t) for t in kv]
    received = [
        DeviceIPCWrapper.Deserialize(DeviceIPCWrapper.Serialize(w)) for w in wrappers
    ]
    context = create_cache_context(received, lmcache_tokens_per_chunk=16)

    context.close()

    assert all(os.path.exists(_path(w)) for w in wrappers)
    # A restarted server maps them again by name.
    kv[0].fill_(1.0)
    assert torch.equal(received[0].to_tensor(), kv[0])


def test_close_keeps_a_segment_whose_creator_it_cannot_verify() -> None:
    """A name's PID that names no process proves nothing (the server may run
    in another PID namespace than a live worker): the segment stays."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = "%s%d_0" % (CpuShmTensorWrapper.SHM_NAME_PREFIX, dead.pid)
    cpu_shm.shm_create_readwrite(name, 2 * 8 * 16 * 4 * 32 * 2)
    try:
        wrapper = CpuShmTensorWrapper(
            torch.empty(2, 8, 16, 4, 32, dtype=torch.float16), name
        )
        context = create_cache_context([wrapper], lmcache_tokens_per_chunk=16)

        context.close()

        assert os.path.exists(_path(wrapper))
    finally:
        cpu_shm.shm_unlink(name)


def test_segment_creator_and_process_gone() -> None:
    worker, wrappers = _start_worker()
    try:
        creator = shm_segments.segment_creator(wrappers[0].shm_name)
        assert creator is not None and creator.pid == worker.pid
        assert creator.file_id == (
            os.stat(_path(wrappers[0])).st_dev,
            os.stat(_path(wrappers[0])).st_ino,
        )
        assert not shm_segments.process_gone(creator.pid, creator.start_time)
        # Another process with this PID (a reused one) is not the creator.
        assert shm_segments.process_gone(creator.pid, creator.start_time + 1)
    finally:
        _stop_worker(worker, wrappers)
    assert shm_segments.process_gone(creator.pid, creator.start_time)

    # This process's own segment names no other creator.
    own = migrate_to_shm_and_wrap(torch.zeros(4))
    assert shm_segments.segment_creator(own.shm_name) is None
    prefix = CpuShmTensorWrapper.SHM_NAME_PREFIX
    assert shm_segments.segment_creator("%s%d_0" % (prefix, worker.pid)) is None
    for name in (
        "/lmcache_test_1",
        "%s%d" % (prefix, os.getpid()),
        "%sx_0" % prefix,
        "%s\u00b2_0" % prefix,
        "%s%s_0" % (prefix, "9" * 20),
    ):
        assert shm_segments.segment_creator(name) is None
