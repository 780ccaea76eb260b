# SPDX-License-Identifier: Apache-2.0
"""Where vLLM allocates the KV cache of a worker with LMCacheMPConnector
(``get_mem_pool_context``); network I/O is stubbed.

On a CPU worker in LMCache-driven mode, registration shares the KV cache with
the server through POSIX shared memory. A KV cache allocated in the
connector's context is shared in place, so a connector that registered it
before LMCache (e.g. NixlConnector first in a MultiConnector) keeps the
memory the model reads.
"""

# Standard
from types import SimpleNamespace
from typing import Any, cast
from unittest.mock import MagicMock

# Third Party
import pytest
import torch

pytest.importorskip("vllm", reason="MP connector imports vLLM at module top")

# Third Party
from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorRole,
)

# First Party
from lmcache.integration.vllm import lmcache_mp_connector as connector_mod  # noqa: E402
from lmcache.integration.vllm import vllm_multi_process_adapter as adapter_mod
from lmcache.integration.vllm.lmcache_mp_connector import (  # noqa: E402
    LMCacheMPConnector,
)
from lmcache.v1.multiprocess.posix_shm import shm_unlink  # noqa: E402
from lmcache.v1.multiprocess.transfer_context.worker_transfer import (  # noqa: E402
    ENV_MP_TRANSFER_MODE,
)
from lmcache.v1.platform.devices.cpu import shm as cpu_shm  # noqa: E402

pytestmark = pytest.mark.no_shared_allocator


@pytest.fixture
def transfer(monkeypatch: pytest.MonkeyPatch) -> MagicMock:
    """Stub transport and telemetry; return the worker's transfer context."""
    transfer = MagicMock()
    monkeypatch.delenv(ENV_MP_TRANSFER_MODE, raising=False)
    monkeypatch.setattr(connector_mod, "print_banner_once", MagicMock())
    monkeypatch.setattr(connector_mod, "vllm_layout_hints", lambda config: {})
    monkeypatch.setattr(adapter_mod.RequestClientFactory, "create", MagicMock())
    monkeypatch.setattr(adapter_mod, "get_lmcache_chunk_size", lambda *a, **kw: 4)
    monkeypatch.setattr(adapter_mod, "get_experimental", lambda *a, **kw: set())
    monkeypatch.setattr(adapter_mod, "HeartbeatThread", MagicMock())
    monkeypatch.setattr(adapter_mod, "set_ipc_policy", MagicMock())
    monkeypatch.setattr(
        adapter_mod, "create_transfer_context", lambda *a, **kw: transfer
    )
    monkeypatch.setattr(
        adapter_mod.RequestTelemetryFactory, "create", lambda **kw: MagicMock()
    )
    return transfer


def _worker(device_type: str, mode: str | None = None) -> LMCacheMPConnector:
    extra = {} if mode is None else {"lmcache.mp.mp_transfer_mode": mode}
    config = SimpleNamespace(
        model_config=SimpleNamespace(model="test-model", use_mla=False),
        parallel_config=SimpleNamespace(
            world_size=1, rank=0, tensor_parallel_size=1, pipeline_parallel_size=1
        ),
        cache_config=SimpleNamespace(block_size=4, enable_prefix_caching=True),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=True),
        device_config=SimpleNamespace(device_type=device_type),
        kv_transfer_config=KVTransferConfig(
            kv_connector="LMCacheMPConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
    )
    return LMCacheMPConnector(cast(VllmConfig, config), KVConnectorRole.WORKER)


def test_cpu_kv_cache_allocated_in_the_context_is_registered_in_place(
    transfer: MagicMock,
) -> None:
    """Registration moves nothing: an address handed out before it (what
    another connector registered) keeps the memory LMCache writes."""
    wrappers: list[Any] = []

    def register(kv_caches: dict[str, torch.Tensor], *args: Any, **kw: Any) -> None:
        # What the LMCache-driven CPU transfer context does on registration.
        wrappers.extend(cpu_shm.migrate_to_shm_and_wrap(t) for t in kv_caches.values())

    transfer.register.side_effect = register
    worker = _worker("cpu", mode="lmcache_driven")
    try:
        context = worker.get_mem_pool_context()
        assert isinstance(context, cpu_shm.ShmAllocationMode)
        with context:
            # As vLLM's CPU worker allocates its KV cache: raw bytes, then views.
            raw = torch.zeros(2 * 8 * 4 * 8 * 4, dtype=torch.int8, device="cpu")
        kv_cache = raw.view(torch.float32).view(2, 8, 4, 1, 8)
        registered_first = kv_cache.data_ptr()

        worker.register_kv_caches({"layer": kv_cache})

        (wrapper,) = wrappers
        assert kv_cache.data_ptr() == registered_first
        wrapper.to_tensor().fill_(7.0)
        assert torch.equal(raw.view(torch.float32), torch.full((512,), 7.0))
    finally:
        worker.shutdown()
        for w in wrappers:
            shm_unlink(w.shm_name)


@pytest.mark.parametrize("mode", ["lmcache_driven", "LMCACHE_DRIVEN"])
def test_cpu_worker_in_lmcache_driven_mode_allocates_in_shm(
    transfer: MagicMock, mode: str
) -> None:
    """The context resolves the mode registration will use."""
    worker = _worker("cpu", mode)
    try:
        context = worker.worker_adapter.kv_cache_allocation_context("cpu")
        assert isinstance(context, cpu_shm.ShmAllocationMode)
    finally:
        worker.shutdown()


@pytest.mark.parametrize(
    "device_type, mode",
    [
        ("cpu", None),
        ("cpu", "auto"),
        ("cpu", "engine_driven"),
        ("cuda", None),
        ("cuda", "lmcache_driven"),
    ],
)
def test_other_workers_keep_the_engine_memory(
    transfer: MagicMock, device_type: str, mode: str | None
) -> None:
    """Engine-driven transfer (a CPU worker's default) and CUDA workers
    allocate as before."""
    worker = _worker(device_type, mode)
    try:
        assert worker.worker_adapter.kv_cache_allocation_context(device_type) is None
    finally:
        worker.shutdown()


@pytest.mark.parametrize("outside", ["after the context", "with out="])
def test_kv_cache_not_allocated_in_the_context_is_refused_not_moved(
    transfer: MagicMock, outside: str
) -> None:
    """A KV cache tensor the context did not serve (allocated outside it, or
    by a call it leaves alone) would be moved away from its address by an
    LMCache-driven registration: refused with one error, nothing moved."""
    worker = _worker("cpu", mode="lmcache_driven")
    try:
        context = worker.get_mem_pool_context()
        assert isinstance(context, cpu_shm.ShmAllocationMode)
        if outside == "with out=":
            kv_cache = torch.empty(0)
            with context:
                torch.zeros(2, 8, 4, 1, 8, out=kv_cache)
        else:
            with context:
                pass
            kv_cache = torch.zeros(2, 8, 4, 1, 8, device="cpu")
        address = kv_cache.data_ptr()

        with pytest.raises(ValueError, match="would move it away from its address"):
            worker.register_kv_caches({"layer": kv_cache})

        transfer.register.assert_not_called()
        assert kv_cache.data_ptr() == address
        assert not cpu_shm.is_shm_backed(kv_cache)
    finally:
        worker.shutdown()
