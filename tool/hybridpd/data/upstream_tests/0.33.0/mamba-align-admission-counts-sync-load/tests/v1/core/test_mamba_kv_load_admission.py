# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Admission of a synchronous KV connector load on a hybrid model (attention +
Mamba, mamba_cache_mode="align") when the block pool is nearly full.

A load over a local prefix hit takes, in each Mamba group, the block that holds
the state at the end of the loaded tokens (`allocate_external_computed_blocks`)
besides the running state's block (`allocate_new_blocks`). If admission counts
one block less than that, `allocate_slots` admits the request and
`BlockPool.get_new_blocks` raises "Cannot get 1 free blocks from the pool"
inside `Scheduler.schedule()`, which ends the engine core. The request must
wait instead, and run once blocks are freed.
"""

from unittest.mock import patch

import pytest

from tests.v1.kv_connector.unit.utils import (
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
    make_kv_cache_config,
)
from vllm.v1.request import RequestStatus

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 16


def test_sync_kv_load_waits_for_mamba_state_block_on_full_pool():
    # The null block and 11 usable blocks, shared by the attention group and
    # the Mamba group.
    num_blocks = 12
    vllm_config = create_vllm_config(
        kv_connector="DecodeBenchConnector",
        kv_role="kv_both",
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=256,
    )
    vllm_config.cache_config.mamba_cache_mode = "align"
    kv_cache_config = make_kv_cache_config(
        BLOCK_SIZE,
        mamba_enabled=True,
        mamba_cache_mode="align",
        num_blocks=num_blocks,
    )
    scheduler = create_scheduler(
        vllm_config, num_blocks=num_blocks, kv_cache_config=kv_cache_config
    )
    block_pool = scheduler.kv_cache_manager.block_pool

    # `holder` computes one block and keeps it (attention KV and Mamba state)
    # cached and referenced; `req` starts with that block and has 17 more
    # tokens; `filler` takes the rest of the pool.
    holder = create_request(
        request_id=1,
        num_tokens=BLOCK_SIZE,
        common_prefix_len=BLOCK_SIZE,
        max_tokens=2,
        block_size=BLOCK_SIZE,
    )
    filler = create_request(
        request_id=2, num_tokens=4 * BLOCK_SIZE, max_tokens=1, block_size=BLOCK_SIZE
    )
    req = create_request(
        request_id=3,
        num_tokens=2 * BLOCK_SIZE + 1,
        common_prefix_len=BLOCK_SIZE,
        max_tokens=1,
        block_size=BLOCK_SIZE,
    )

    # Only `req` gets an external hit: DecodeBenchConnector fills every token
    # past the local hit but the last one, synchronously (the tokens are
    # computed in the same step).
    connector = scheduler.connector
    decode_bench_lookup = connector.get_num_new_matched_tokens

    def lookup(request, num_computed_tokens):
        if request is not req:
            return 0, False
        return decode_bench_lookup(request, num_computed_tokens)

    with patch.object(connector, "get_num_new_matched_tokens", side_effect=lookup):
        scheduler.add_request(holder)
        output = scheduler.schedule()
        scheduler.update_from_output(output, create_model_runner_output([holder]))

        # `holder` decodes (one more attention block and Mamba block), `filler`
        # prefills its first 48 tokens (3 attention blocks and 1 Mamba block):
        # 3 blocks stay free.
        # `req` hits `holder`'s block locally (16 tokens), DecodeBenchConnector
        # loads tokens 16-31 and token 32 is computed, so it needs 2 attention
        # blocks and 2 Mamba blocks (the state at token 32 that the load
        # writes, and the running state): 4, one more than is free.
        scheduler.add_request(filler)
        scheduler.add_request(req)
        output = scheduler.schedule()
        assert set(output.num_scheduled_tokens) == {
            holder.request_id,
            filler.request_id,
        }
        assert req.status == RequestStatus.WAITING
        assert block_pool.get_num_free_blocks() == 3
        # Once `holder` and `filler` are done and their blocks free, `req` is
        # admitted with its local hit and its load, and runs to completion.
        for _ in range(3):
            scheduler.update_from_output(
                output,
                create_model_runner_output(
                    [scheduler.requests[i] for i in output.num_scheduled_tokens]
                ),
            )
            output = scheduler.schedule()
            if output.scheduled_new_reqs:
                break
        (new_req,) = output.scheduled_new_reqs
        assert new_req.req_id == req.request_id
        assert new_req.num_computed_tokens == 2 * BLOCK_SIZE
        assert output.num_scheduled_tokens == {req.request_id: 1}
        scheduler.update_from_output(output, create_model_runner_output([req]))

    assert req.is_finished()
