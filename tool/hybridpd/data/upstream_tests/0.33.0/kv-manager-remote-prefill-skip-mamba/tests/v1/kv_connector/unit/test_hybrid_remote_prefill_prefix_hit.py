# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prefix-cache hits of remote-prefill requests of hybrid (full attention +
Mamba "align") models on a kv_both instance.

NIXL runs both PD instances with kv_role="kv_both", so the role cannot tell
whether the connector delivers a request's running Mamba state. A request
that pulls its KV from a prefill instance (``do_remote_prefill``) receives
that state and keeps the full-attention hit of a shared prefix, whatever
connectors are configured; every other request is computed locally and
keeps the hit every KV cache group agrees on.
"""

from typing import Any

import pytest
import torch

from tests.v1.core.utils import create_requests
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.structured_output import StructuredOutputManager

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 16
PREFIX_BLOCKS = 4


def _create_kv_both_scheduler(
    matched_tokens: int, num_blocks: int = 100
) -> Scheduler:
    """FA + Mamba ("align" cache mode) kv_both scheduler whose MockKVConnector
    loads ``matched_tokens`` per request and does not declare
    supports_divergent_local_hybrid_hits."""
    model_config = ModelConfig(
        model="facebook/opt-125m",
        trust_remote_code=True,
        dtype="float16",
        seed=42,
        skip_tokenizer_init=True,
    )
    vllm_config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=8192,
            max_model_len=8192,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            watermark=0.0,
        ),
        model_config=model_config,
        cache_config=CacheConfig(
            block_size=BLOCK_SIZE,
            enable_prefix_caching=True,
            mamba_cache_mode="align",
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="MockKVConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "matched_tokens": matched_tokens,
                "is_async": False,
                "supports_divergent_local_hybrid_hits": False,
            },
        ),
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["fa"],
                FullAttentionSpec(
                    block_size=BLOCK_SIZE,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=BLOCK_SIZE,
                    shapes=((1, 1),),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
        ],
    )
    register_all_kvcache_specs(vllm_config)
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        log_stats=True,
    )


def _seed_remote_prefilled_prefix(manager: KVCacheManager, num_blocks: int) -> None:
    """Cache a ``num_blocks`` prefix as a remote prefill leaves it: every
    full-attention block, and no Mamba state inside the prefix."""
    [fill] = create_requests(
        num_requests=1,
        num_tokens=num_blocks * BLOCK_SIZE,
        max_tokens=1,
        same_prompt=True,
        block_size=BLOCK_SIZE,
        req_ids=["fill"],
    )
    computed_blocks, num_computed, _ = manager.get_computed_blocks(fill)
    assert num_computed == 0
    mamba_ids = []
    for i in range(num_blocks):
        manager.allocate_slots(
            fill, BLOCK_SIZE, new_computed_blocks=computed_blocks if i == 0 else None
        )
        fill.num_computed_tokens += BLOCK_SIZE
        _, group_mamba_ids = manager.get_block_ids(fill.request_id)
        mamba_ids.append(group_mamba_ids[i])
    manager.free(fill)
    manager.block_pool.evict_blocks(set(mamba_ids))


def _remote_prefill_params() -> dict[str, Any]:
    """kv_transfer_params a PD proxy hands the decode instance."""
    return dict(
        do_remote_prefill=True,
        do_remote_decode=False,
        remote_engine_id="my-engine-id",
        remote_request_id="prefill-replay",
        remote_block_ids=list(range(PREFIX_BLOCKS + 2)),
        remote_host="my-host",
        remote_port=1234,
        tp_size=1,
    )


def _num_computed_tokens_of_replay(
    scheduler: Scheduler, kv_transfer_params: dict[str, Any] | None
) -> int:
    """Schedule a request that extends the seeded prefix by two blocks;
    return the tokens it starts with (local hit plus external tokens)."""
    manager = scheduler.kv_cache_manager
    assert isinstance(manager.coordinator, HybridKVCacheCoordinator)
    _seed_remote_prefilled_prefix(manager, PREFIX_BLOCKS)
    [replay] = create_requests(
        num_requests=1,
        num_tokens=(PREFIX_BLOCKS + 2) * BLOCK_SIZE,
        max_tokens=1,
        same_prompt=True,
        block_size=BLOCK_SIZE,
        req_ids=["replay"],
    )
    replay.kv_transfer_params = kv_transfer_params

    scheduler.add_request(replay)
    [new_req] = scheduler.schedule().scheduled_new_reqs
    return new_req.num_computed_tokens


def test_kv_both_remote_prefill_request_keeps_full_attention_hit():
    """The prefix comes from the local cache and the connector loads the
    rest, with a connector that does not declare
    supports_divergent_local_hybrid_hits."""
    scheduler = _create_kv_both_scheduler(matched_tokens=BLOCK_SIZE)

    num_computed = _num_computed_tokens_of_replay(scheduler, _remote_prefill_params())

    assert num_computed == PREFIX_BLOCKS * BLOCK_SIZE + BLOCK_SIZE


@pytest.mark.parametrize(
    "kv_transfer_params",
    [None, dict(do_remote_prefill=False, do_remote_decode=True)],
    ids=["local", "remote-decode"],
)
def test_kv_both_local_request_keeps_mamba_aligned_hit(
    kv_transfer_params: dict[str, Any] | None,
):
    """A request computed on this instance (a plain one, or the prefill side
    of a PD pair) needs a Mamba state at its hit boundary: none here."""
    scheduler = _create_kv_both_scheduler(matched_tokens=BLOCK_SIZE)

    num_computed = _num_computed_tokens_of_replay(scheduler, kv_transfer_params)

    assert num_computed == BLOCK_SIZE
