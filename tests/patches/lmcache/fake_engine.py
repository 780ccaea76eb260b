"""A stand-in for LMCache's engine, the one part of LMCacheConnectorV1 that
lives in another project (and drives GPU memory). It is installed as
``lmcache.integration.vllm.vllm_v1_adapter`` so the real connector imports it
exactly as it imports LMCache, and it records what the connector asks."""

from __future__ import annotations

import sys
import types
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


class FakeLMCacheEngine:
    """An engine that predates hybrid support: it declares neither
    ``kv_cache_group_id`` nor ``supports_hybrid_state_restore``; ``install``
    adds them to a subclass when a test needs them."""

    matched_tokens = 0

    def __init__(self, vllm_config, role, parent) -> None:
        # LMCache's adapter reads the vLLM KV cache groups from its parent
        # (an older connector does not expose them).
        self.seen_kv_cache_config = getattr(parent, "kv_cache_config", None)
        self.lookups: list[int] = []
        self.finished: list[tuple[str, list[int]]] = []
        type(self).instances.append(self)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        self.lookups.append(num_computed_tokens)
        return self.matched_tokens

    def update_state_after_alloc(self, request, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids: list[int]):
        self.finished.append((request.request_id, list(block_ids)))
        return False, None

    def get_kv_events(self):
        return None


def install(monkeypatch, **attributes: Any) -> type[FakeLMCacheEngine]:
    """Make ``from lmcache.integration.vllm.vllm_v1_adapter import
    LMCacheConnectorV1Impl`` resolve to a fresh FakeLMCacheEngine subclass
    carrying ``attributes``; its constructed engines land in ``.instances``."""
    engine_cls = type(
        "FakeLMCacheEngine", (FakeLMCacheEngine,), {"instances": [], **attributes}
    )
    names = [
        "lmcache",
        "lmcache.integration",
        "lmcache.integration.vllm",
        "lmcache.integration.vllm.vllm_v1_adapter",
    ]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[names[-1]].LMCacheConnectorV1Impl = engine_cls
    return engine_cls
