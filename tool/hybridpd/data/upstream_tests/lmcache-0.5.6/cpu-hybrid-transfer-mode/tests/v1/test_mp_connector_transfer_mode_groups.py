# SPDX-License-Identifier: Apache-2.0
"""The transfer mode a CPU worker with several KV groups allocates and
registers its KV cache for (LMCacheMPConnector); network I/O is stubbed.

``auto`` resolves to the LMCache-driven path for several KV groups on CPU.
The allocation (``get_mem_pool_context``) counts the engine's KV cache
groups, registration LMCache's engine groups, which may differ (one engine
group split by physical identity): registration refuses a mode other than
the one the KV cache was allocated for only where that would move it (an
engine-memory KV cache registered for the LMCache-driven path); a KV cache
allocated in shared memory keeps the LMCache-driven mode.
"""

# Standard
from types import SimpleNamespace
from typing import cast
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
from lmcache.v1.multiprocess.transfer_context.worker_transfer import (  # noqa: E402
    ENV_MP_TRANSFER_MODE,
    MPTransferMode,
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


@pytest.mark.parametrize("mode, num_kv_groups", [(None, 2), ("auto", 3)])
def test_cpu_worker_with_several_kv_groups_allocates_in_shm(
    transfer: MagicMock, mode: str | None, num_kv_groups: int
) -> None:
    """``auto`` picks the LMCache-driven path for several KV groups on CPU,
    and the allocation resolves it too."""
    worker = _worker("cpu", mode)
    try:
        context = worker.worker_adapter.kv_cache_allocation_context(
            "cpu", num_kv_groups
        )
        assert isinstance(context, cpu_shm.ShmAllocationMode)
    finally:
        worker.shutdown()


def _groups(n: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(engine_group_id=i, tokens_per_block=4) for i in range(n)]


def test_registration_refuses_a_mode_other_than_the_allocations(
    transfer: MagicMock,
) -> None:
    """One KV cache group at allocation (engine-driven, the engine's memory)
    but two engine groups at registration (LMCache-driven, which would move
    the KV cache): one clear error, nothing registered."""
    worker = _worker("cpu")
    try:
        assert worker.worker_adapter.kv_cache_allocation_context("cpu", 1) is None
        with pytest.raises(ValueError, match="set the transfer mode explicitly"):
            worker.worker_adapter.register_kv_caches(
                {"layer": torch.zeros(2, 4)}, cast(list, _groups(2))
            )
        transfer.register.assert_not_called()
    finally:
        worker.shutdown()


def test_registration_in_the_allocations_mode_is_accepted(
    transfer: MagicMock,
) -> None:
    """The same mode from both counts registers as before."""
    worker = _worker("cpu")
    try:
        context = worker.worker_adapter.kv_cache_allocation_context("cpu", 2)
        assert isinstance(context, cpu_shm.ShmAllocationMode)
        with context:
            kv_cache = torch.zeros(2, 4, device="cpu")
        worker.worker_adapter.register_kv_caches(
            {"layer": kv_cache}, cast(list, _groups(3))
        )
        transfer.register.assert_called_once()
    finally:
        worker.shutdown()


def test_registration_keeps_the_lmcache_driven_mode_of_the_allocation(
    transfer: MagicMock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two KV cache groups at allocation (LMCache-driven, in shared memory)
    but one engine group at registration (a scratch group dropped), which
    alone would resolve engine-driven: the KV cache already lives where an
    LMCache-driven registration shares it in place, so registration keeps
    that mode, also when it re-registers."""
    create = MagicMock(return_value=transfer)
    monkeypatch.setattr(adapter_mod, "create_transfer_context", create)
    worker = _worker("cpu")
    try:
        context = worker.worker_adapter.kv_cache_allocation_context("cpu", 2)
        assert isinstance(context, cpu_shm.ShmAllocationMode)
        with context:
            kv_cache = torch.zeros(2, 4, device="cpu")
        worker.worker_adapter.register_kv_caches(
            {"layer": kv_cache}, cast(list, _groups(1))
        )
        transfer.register.assert_called_once()
        assert create.call_args.kwargs["mode"] is MPTransferMode.LMCACHE_DRIVEN
    finally:
        worker.shutdown()
