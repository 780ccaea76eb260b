# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""LMCacheConnectorV1 with the hybrid memory allocator (HMA).

The connector is constructed for real; only LMCache's engine, which lives in
another project, is a stand-in registered as
``lmcache.integration.vllm.vllm_v1_adapter``.
"""

import sys
import types
from typing import Any
from unittest.mock import MagicMock

import pytest
import torch

from tests.v1.kv_connector.unit.utils import create_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import (
    LMCacheConnectorV1,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 16


class FakeLMCacheEngine:
    """Records what the connector asks; declares no hybrid support unless a
    test adds ``kv_cache_group_id`` or ``supports_hybrid_state_restore``."""

    matched_tokens = 3 * BLOCK_SIZE

    def __init__(self, vllm_config, role, parent) -> None:
        # LMCache's adapter reads the KV cache groups from its parent.
        self.seen_kv_cache_config = getattr(parent, "kv_cache_config", None)
        self.finished: list[list[int]] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        return self.matched_tokens

    def request_finished(self, request, block_ids: list[int]):
        self.finished.append(list(block_ids))
        return False, None


def _kv_cache_config(mamba: bool = True, attention_first: bool = True) -> KVCacheConfig:
    """One full-attention group, and (``mamba``) three Mamba "align" groups."""
    groups = [
        KVCacheGroupSpec(
            ["attn.0"],
            FullAttentionSpec(
                block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
            ),
        )
    ]
    if mamba:
        groups += [
            KVCacheGroupSpec(
                [f"linear_attn.{i}"],
                MambaSpec(
                    block_size=BLOCK_SIZE,
                    shapes=((1, 1),),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            )
            for i in range(3)
        ]
    if not attention_first:
        groups.reverse()
    return KVCacheConfig(num_blocks=100, kv_cache_tensors=[], kv_cache_groups=groups)


def _connector(
    monkeypatch: pytest.MonkeyPatch,
    kv_cache_config: KVCacheConfig,
    **engine_attributes: Any,
) -> LMCacheConnectorV1:
    engine_cls = type("Engine", (FakeLMCacheEngine,), engine_attributes)
    names = (
        "lmcache",
        "lmcache.integration",
        "lmcache.integration.vllm",
        "lmcache.integration.vllm.vllm_v1_adapter",
    )
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[names[-1]].LMCacheConnectorV1Impl = engine_cls
    vllm_config = create_vllm_config(
        kv_connector="LMCacheConnectorV1", kv_role="kv_both"
    )
    return LMCacheConnectorV1(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)


def test_lmcache_connector_supports_hma():
    assert issubclass(LMCacheConnectorV1, SupportsHMA)


def test_engine_reads_kv_cache_config_from_connector(monkeypatch):
    config = _kv_cache_config()
    connector = _connector(monkeypatch, config)

    assert connector._lmcache_engine.seen_kv_cache_config is config


@pytest.mark.parametrize("attention_first", [True, False])
def test_finished_request_forwards_attention_group_blocks(monkeypatch, attention_first):
    config = _kv_cache_config(attention_first=attention_first)
    attention_group = 0 if attention_first else 3
    connector = _connector(monkeypatch, config)
    block_ids = tuple([10 * g + i for i in range(4)] for g in range(4))

    connector.request_finished_all_groups(MagicMock(), block_ids)

    assert connector._lmcache_engine.finished == [block_ids[attention_group]]


def test_engine_selected_group_is_forwarded(monkeypatch):
    config = _kv_cache_config(attention_first=False)
    connector = _connector(monkeypatch, config, kv_cache_group_id=3)
    block_ids = tuple([10 * g + i for i in range(4)] for g in range(4))

    connector.request_finished_all_groups(MagicMock(), block_ids)

    assert connector._lmcache_engine.finished == [block_ids[3]]


@pytest.mark.parametrize("group_id", [1, 4])
def test_invalid_selected_group_is_rejected(monkeypatch, group_id):
    # Group 1 is a Mamba group; group 4 does not exist.
    connector = _connector(monkeypatch, _kv_cache_config(), kv_cache_group_id=group_id)
    block_ids = tuple([10 * g] for g in range(4))

    with pytest.raises(ValueError, match="not an attention group"):
        connector.request_finished_all_groups(MagicMock(), block_ids)


def test_hybrid_model_reports_no_external_hit_without_state_restore(monkeypatch):
    # Attention KV without the matching Mamba state would corrupt the output.
    connector = _connector(monkeypatch, _kv_cache_config())

    assert connector.get_num_new_matched_tokens(MagicMock(), 0) == (0, False)


def test_hybrid_model_reports_external_hit_with_state_restore(monkeypatch):
    connector = _connector(
        monkeypatch, _kv_cache_config(), supports_hybrid_state_restore=True
    )

    assert connector.get_num_new_matched_tokens(MagicMock(), 0) == (
        3 * BLOCK_SIZE,
        False,
    )


def test_attention_only_model_reports_external_hit(monkeypatch):
    connector = _connector(monkeypatch, _kv_cache_config(mamba=False))

    assert connector.get_num_new_matched_tokens(MagicMock(), 0) == (
        3 * BLOCK_SIZE,
        False,
    )
