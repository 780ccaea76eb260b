# SPDX-License-Identifier: Apache-2.0
"""Tests for removing the CPU KV segments of a worker that exited.

A worker unlinks the POSIX SHM segments it created when it exits cleanly.
One killed first (on SIGTERM, vLLM's API server kills its engine core and
workers within a second) cannot, so the server removes them when it
releases the registration: ``CPUCacheContext.close``.
"""

# Standard
import os
import subprocess
import sys

# Third Party
import pytest
import torch

# First Party
from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper
from lmcache.v1.platform.cache_context import create_cache_context
from lmcache.v1.platform.devices.cpu import shm as cpu_shm
from lmcache.v1.platform.devices.cpu.shm import (
    CpuShmTensorWrapper,
    migrate_to_shm_and_wrap,
)

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/dev/shm"), reason="POSIX SHM segments live in /dev/shm"
)

# A worker that registers vLLM-style KV tensors, prints their wire
# descriptors and exits the way a killed one does: no atexit handler, no
# finalizer.
_WORKER = """
import os, sys
import torch
from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper
from lmcache.v1.platform.devices.cpu.shm import migrate_to_shm_and_wrap
kv = [torch.zeros(2, 8, 16, 4, 32, dtype=torch.float16) for _ in range(2)]
for tensor in kv:
    print(DeviceIPCWrapper.Serialize(migrate_to_shm_and_wrap(tensor)).hex())
sys.stdout.flush()
os._exit(0)
"""


def _exists(wrapper: CpuShmTensorWrapper) -> bool:
    return os.path.exists("/dev/shm/" + wrapper.shm_name.lstrip("/"))


def _exited_worker_wrappers() -> list[DeviceIPCWrapper]:
    out = subprocess.run(
        [sys.executable, "-c", _WORKER],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    return [DeviceIPCWrapper.Deserialize(bytes.fromhex(x)) for x in out.split()]


def test_close_removes_an_exited_workers_segments() -> None:
    wrappers = _exited_worker_wrappers()
    try:
        assert wrappers and all(_exists(w) for w in wrappers)
        context = create_cache_context(wrappers, lmcache_tokens_per_chunk=16)

        context.close()

        assert not any(_exists(w) for w in wrappers)
    finally:
        for w in wrappers:
            if _exists(w):
                os.unlink("/dev/shm/" + w.shm_name.lstrip("/"))


def test_close_keeps_a_live_workers_segments() -> None:
    kv = [torch.zeros(2, 8, 16, 4, 32, dtype=torch.float16) for _ in range(2)]
    wrappers = [migrate_to_shm_and_wrap(t) for t in kv]
    received = [
        DeviceIPCWrapper.Deserialize(DeviceIPCWrapper.Serialize(w)) for w in wrappers
    ]
    context = create_cache_context(received, lmcache_tokens_per_chunk=16)

    context.close()

    assert all(_exists(w) for w in wrappers)
    kv[0].fill_(1.0)
    assert torch.equal(wrappers[0].to_tensor(), kv[0])


def test_segment_creator_gone() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    prefix = CpuShmTensorWrapper.SHM_NAME_PREFIX

    assert cpu_shm.segment_creator_gone("%s%d_0" % (prefix, dead.pid))
    assert cpu_shm.segment_creator_gone("%s%d_3" % (prefix.lstrip("/"), dead.pid))
    assert not cpu_shm.segment_creator_gone("%s%d_0" % (prefix, os.getpid()))
    # Names of another form are never judged gone.
    assert not cpu_shm.segment_creator_gone("/lmcache_test_%d" % dead.pid)
    assert not cpu_shm.segment_creator_gone("%s%d" % (prefix, dead.pid))
    assert not cpu_shm.segment_creator_gone("%sx_0" % prefix)
