# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Decode-side prefix-cache hits of hybrid (full attention + Mamba "align")
models on a kv_consumer instance.

Under PD disaggregation the connector delivers the running Mamba state at
the end of each prompt, never the per-block Mamba states of its prefix, so a
decode instance's Mamba groups hold no state inside a shared prefix while
its full-attention groups hold every block of it. A kv_consumer instance
must keep the full-attention hit whatever connectors are configured, not
only when every connector declares supports_divergent_local_hybrid_hits.
"""

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


def create_hybrid_pd_scheduler(
    kv_role: str,
    matched_tokens: int,
    supports_divergent_hits: bool = False,
    num_blocks: int = 100,
) -> Scheduler:
    """FA + Mamba ("align" cache mode) scheduler of a PD instance whose
    MockKVConnector loads ``matched_tokens`` external tokens per request."""
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
            kv_role=kv_role,
            kv_connector_extra_config={
                "matched_tokens": matched_tokens,
                "is_async": False,
                "supports_divergent_local_hybrid_hits": supports_divergent_hits,
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


def seed_decode_side_prefix(manager: KVCacheManager, num_blocks: int) -> None:
    """Cache a ``num_blocks`` prefix the way a decode instance holds it: every
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
    # The per-block Mamba states of the prefix never reach a decode instance.
    manager.block_pool.evict_blocks(set(mamba_ids))


def _num_computed_tokens_of_replay(scheduler: Scheduler, num_blocks: int) -> int:
    """Schedule a request that extends the seeded prefix; return the tokens
    it starts with (local prefix-cache hit plus external tokens)."""
    manager = scheduler.kv_cache_manager
    assert isinstance(manager.coordinator, HybridKVCacheCoordinator)
    seed_decode_side_prefix(manager, PREFIX_BLOCKS)
    [replay] = create_requests(
        num_requests=1,
        num_tokens=num_blocks * BLOCK_SIZE,
        max_tokens=1,
        same_prompt=True,
        block_size=BLOCK_SIZE,
        req_ids=["replay"],
    )
    _, per_group_hits = manager.coordinator.find_longest_cache_hit_per_group(
        replay.block_hashes, replay.num_tokens - 1
    )
    # Full attention holds the prefix; Mamba holds nothing inside it.
    assert per_group_hits == (PREFIX_BLOCKS * BLOCK_SIZE, 0)

    scheduler.add_request(replay)
    [new_req] = scheduler.schedule().scheduled_new_reqs
    return new_req.num_computed_tokens


@pytest.mark.parametrize("supports_divergent_hits", [False, True])
def test_kv_consumer_keeps_full_attention_hit(supports_divergent_hits: bool):
    """The prefix comes from the local cache and the connector loads the
    rest, also with a connector that does not declare
    supports_divergent_local_hybrid_hits (e.g. a MultiConnector of NIXL and
    an offloading connector)."""
    scheduler = create_hybrid_pd_scheduler(
        "kv_consumer",
        matched_tokens=BLOCK_SIZE,
        supports_divergent_hits=supports_divergent_hits,
    )

    num_computed = _num_computed_tokens_of_replay(scheduler, PREFIX_BLOCKS + 2)

    assert num_computed == PREFIX_BLOCKS * BLOCK_SIZE + BLOCK_SIZE


def test_kv_consumer_without_external_tokens_uses_common_hit():
    """A diverged hit that no connector load backs has no Mamba state at its
    end: the request falls back to the hit every group agrees on."""
    scheduler = create_hybrid_pd_scheduler("kv_consumer", matched_tokens=0)

    assert _num_computed_tokens_of_replay(scheduler, PREFIX_BLOCKS + 2) == 0


@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_both"])
def test_other_roles_keep_mamba_aligned_hit(kv_role: str):
    """A producer computes its Mamba states itself, and kv_both is decided
    per request: without a capable connector their hit stays the one every
    group agrees on (none here), plus the external tokens."""
    scheduler = create_hybrid_pd_scheduler(kv_role, matched_tokens=BLOCK_SIZE)

    num_computed = _num_computed_tokens_of_replay(scheduler, PREFIX_BLOCKS + 2)

    assert num_computed == BLOCK_SIZE
