# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Decode-side prefix-cache hits of hybrid (full attention + Mamba "align")
models behind a MultiConnector.

Under PD disaggregation a decode instance caches every full-attention block of
a prefix it received, but no Mamba state inside it: the connector delivers the
running state at the end of each prompt only. A later request sharing the
prefix may keep the deeper full-attention hit only if the connector that
serves it restores the Mamba state at the end of what it loads (NIXL does).
A MultiConnector may complete such a hit when any child may, and answers for
the child that matched the request. A request that no restoring load serves
keeps the hit every KV cache group agrees on.
"""

from typing import Any
from unittest.mock import patch

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
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 16
PREFIX_BLOCKS = 4
PREFIX_TOKENS = PREFIX_BLOCKS * BLOCK_SIZE
# The replayed request extends the cached prefix by two blocks.
REPLAY_TOKENS = PREFIX_TOKENS + 2 * BLOCK_SIZE
# NIXL leaves the last prompt token of a hybrid model to the decode instance
# (it recomputes it from the transferred Mamba state).
NIXL_LOADED_TOKENS = REPLAY_TOKENS - 1 - PREFIX_TOKENS

NIXL = "NixlConnector"
DECODE_BENCH = "DecodeBenchConnector"


def create_hybrid_pd_scheduler(
    connectors: list[str], num_blocks: int = 100
) -> Scheduler:
    """FA + Mamba ("align" cache mode) scheduler of a decode instance whose KV
    connector is ``connectors[0]`` alone, or a MultiConnector of them (in that
    order)."""
    model_config = ModelConfig(
        model="facebook/opt-125m",
        trust_remote_code=True,
        dtype="float16",
        seed=42,
        skip_tokenizer_init=True,
    )
    if len(connectors) == 1:
        kv_transfer_config = KVTransferConfig(
            kv_connector=connectors[0], kv_role="kv_consumer"
        )
    else:
        kv_transfer_config = KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_consumer",
            kv_connector_extra_config={
                "connectors": [
                    {"kv_connector": name, "kv_role": "kv_consumer"}
                    for name in connectors
                ]
            },
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
        kv_transfer_config=kv_transfer_config,
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


def _remote_prefill_params(num_tokens: int) -> dict[str, Any]:
    """kv_transfer_params a PD proxy hands the decode instance."""
    return dict(
        do_remote_prefill=True,
        do_remote_decode=False,
        remote_engine_id="my-engine-id",
        remote_request_id="prefill-replay",
        remote_block_ids=list(range(-(-num_tokens // BLOCK_SIZE))),
        remote_host="my-host",
        remote_port=1234,
        tp_size=1,
    )


def _replay(num_tokens: int, remote_prefill: bool) -> Request:
    """A request whose prompt starts with the seeded prefix."""
    [replay] = create_requests(
        num_requests=1,
        num_tokens=num_tokens,
        max_tokens=1,
        same_prompt=True,
        block_size=BLOCK_SIZE,
        req_ids=["replay"],
    )
    if remote_prefill:
        replay.kv_transfer_params = _remote_prefill_params(num_tokens)
    return replay


def _admit_on_decode_instance(
    scheduler: Scheduler, request: Request
) -> tuple[int, int]:
    """Seed the decode-side prefix, admit ``request`` and return the tokens it
    starts with: (local prefix-cache hit, external tokens the connector loads)."""
    manager = scheduler.kv_cache_manager
    assert isinstance(manager.coordinator, HybridKVCacheCoordinator)
    seed_decode_side_prefix(manager, PREFIX_BLOCKS)
    _, per_group_hits = manager.coordinator.find_longest_cache_hit_per_group(
        request.block_hashes, request.num_tokens - 1
    )
    # Full attention holds the prefix; Mamba holds nothing inside it.
    assert per_group_hits == (PREFIX_TOKENS, 0)

    connector = scheduler.connector
    assert connector is not None
    with patch.object(
        connector,
        "update_state_after_alloc",
        wraps=connector.update_state_after_alloc,
    ) as update_state_after_alloc:
        scheduler.add_request(request)
        output = scheduler.schedule()
    update_state_after_alloc.assert_called_once()
    _, _, num_external_tokens = update_state_after_alloc.call_args.args

    if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
        num_computed_tokens = request.num_computed_tokens
    else:
        [new_req] = output.scheduled_new_reqs
        num_computed_tokens = new_req.num_computed_tokens
    return num_computed_tokens - num_external_tokens, num_external_tokens


CONNECTOR_SETS = pytest.mark.parametrize(
    "connectors", [[NIXL], [NIXL, DECODE_BENCH]], ids=["nixl", "nixl+decodebench"]
)


@CONNECTOR_SETS
def test_remote_prefill_served_by_nixl_keeps_full_attention_hit(
    connectors: list[str],
):
    """The prefix comes from the local cache and NIXL loads the rest, with the
    Mamba state at its end, also when a child that does not restore the state
    (DecodeBench) is configured next to NIXL."""
    scheduler = create_hybrid_pd_scheduler(connectors)
    replay = _replay(REPLAY_TOKENS, remote_prefill=True)

    num_local, num_external = _admit_on_decode_instance(scheduler, replay)

    assert (num_local, num_external) == (PREFIX_TOKENS, NIXL_LOADED_TOKENS)
    assert replay.status == RequestStatus.WAITING_FOR_REMOTE_KVS


@CONNECTOR_SETS
def test_plain_request_keeps_common_hit(connectors: list[str]):
    """A plain request sent straight to the decode instance: NIXL loads nothing
    for it, so no load may restore a Mamba state. It keeps the hit every group
    agrees on (none here), and the tokens another child (DecodeBench) matches
    from there."""
    scheduler = create_hybrid_pd_scheduler(connectors)
    replay = _replay(REPLAY_TOKENS, remote_prefill=False)

    num_local, num_external = _admit_on_decode_instance(scheduler, replay)

    expected_external = REPLAY_TOKENS - 1 if DECODE_BENCH in connectors else 0
    assert (num_local, num_external) == (0, expected_external)
    assert replay.status == RequestStatus.RUNNING


@CONNECTOR_SETS
def test_prompt_one_token_past_cached_prefix_falls_back_to_common_hit(
    connectors: list[str],
):
    """The full-attention hit is prompt length - 1, so NIXL has nothing left
    to load and no Mamba state arrives at its end: the request starts from the
    hit every group agrees on (none here) and loads nothing external."""
    scheduler = create_hybrid_pd_scheduler(connectors)
    replay = _replay(PREFIX_TOKENS + 1, remote_prefill=True)

    num_local, num_external = _admit_on_decode_instance(scheduler, replay)

    assert (num_local, num_external) == (0, 0)
    assert replay.status == RequestStatus.RUNNING


def test_non_restoring_child_first_falls_back_to_common_hit():
    """MultiConnector(DecodeBench, NIXL): DecodeBench matches first and serves
    the remote-prefill request, but restores no Mamba state, so the deeper
    full-attention hit is not kept and the tokens matched beyond it are not
    loaded."""
    scheduler = create_hybrid_pd_scheduler([DECODE_BENCH, NIXL])
    replay = _replay(REPLAY_TOKENS, remote_prefill=True)

    num_local, num_external = _admit_on_decode_instance(scheduler, replay)

    assert (num_local, num_external) == (0, 0)
    assert replay.status == RequestStatus.RUNNING


@pytest.mark.parametrize(
    "connectors,completes",
    [([NIXL, DECODE_BENCH], True), ([DECODE_BENCH, NIXL], False)],
    ids=["nixl+decodebench", "decodebench+nixl"],
)
def test_multi_connector_answers_per_request(connectors: list[str], completes: bool):
    """Before the lookup a MultiConnector says whether any child may restore the
    Mamba state for the request; after the query it answers for the child that
    matched the request. Its capability stays the AND over its children."""
    connector = create_hybrid_pd_scheduler(connectors).connector
    assert connector is not None
    assert not connector.supports_divergent_local_hybrid_hits

    plain = _replay(REPLAY_TOKENS, remote_prefill=False)
    assert not connector.may_complete_divergent_local_hybrid_hit(plain)

    remote = _replay(REPLAY_TOKENS, remote_prefill=True)
    assert connector.may_complete_divergent_local_hybrid_hit(remote)
    num_external, _ = connector.get_num_new_matched_tokens(remote, PREFIX_TOKENS)
    assert num_external == NIXL_LOADED_TOKENS
    assert connector.completes_divergent_local_hybrid_hit(remote) is completes
