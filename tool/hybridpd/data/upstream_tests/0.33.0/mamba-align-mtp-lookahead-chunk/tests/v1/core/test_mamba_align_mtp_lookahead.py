# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Multi-module MTP's prefill lookahead (`_reserve_prefill_lookahead`, #50062)
next to the Mamba align rule (`_mamba_block_aligned_split`).

A KV load can resume a prefill inside the prompt's last full block: with three
MTP modules a P/D prefiller stops two tokens short, so a prompt one token past
a block boundary resumes one token before that boundary. The align rule allows
only the chunk that ends on the boundary, fewer than `num_prefill_lookahead`
tokens before the prefill end; that chunk must be scheduled, not cut to nothing.
"""

import pytest

from tests.v1.kv_connector.unit.utils import (
    create_mock_connector,
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
    make_kv_cache_config,
)
from vllm.v1.request import RequestStatus

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 16
NUM_PREFILL_LOOKAHEAD = 3


def _align_scheduler():
    vllm_config = create_vllm_config(block_size=BLOCK_SIZE)
    vllm_config.cache_config.mamba_cache_mode = "align"
    kv_cache_config = make_kv_cache_config(
        BLOCK_SIZE, mamba_enabled=True, mamba_cache_mode="align"
    )
    scheduler = create_scheduler(vllm_config, kv_cache_config=kv_cache_config)
    assert scheduler.need_mamba_block_aligned_split
    scheduler.num_prefill_lookahead = NUM_PREFILL_LOOKAHEAD
    return scheduler


def _schedule_after_load(num_tokens: int, num_loaded_tokens: int) -> list[int]:
    """Load `num_loaded_tokens` of a `num_tokens` prompt asynchronously, then
    return the number of tokens scheduled in each step until the prefill ends
    (at most 4 steps)."""
    scheduler = _align_scheduler()
    request = create_request(num_tokens=num_tokens)
    scheduler.connector = create_mock_connector()
    scheduler.connector.get_loaded_kv_cache_group_ids.return_value = (0, 1)
    scheduler.connector.get_num_new_matched_tokens.return_value = (
        num_loaded_tokens,
        True,
    )
    scheduler.connector.request_finished.return_value = (False, None)
    scheduler.connector.take_events.return_value = ()
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    scheduler.update_from_output(
        output, create_model_runner_output([], finished_recving={request.request_id})
    )

    chunks = []
    for _ in range(4):
        output = scheduler.schedule()
        chunks.append(output.num_scheduled_tokens.get(request.request_id, 0))
        if not output.num_scheduled_tokens:
            continue
        runner_output = create_model_runner_output([request])
        if request.num_computed_tokens < num_tokens:
            # A partial prefill samples nothing.
            runner_output.sampled_token_ids = [[]]
        scheduler.update_from_output(output, runner_output)
        if request.num_computed_tokens >= num_tokens:
            break
    return chunks


@pytest.mark.parametrize("num_blocks", [1, 4])
def test_unaligned_resume_in_the_last_block_is_scheduled(num_blocks: int):
    # The prompt ends one token past a block boundary and the load resumes the
    # request one token before it: the aligned chunk ends 1 token before the
    # prefill end, within the lookahead of 3. It runs, then the last token.
    num_tokens = num_blocks * BLOCK_SIZE + 1
    assert _schedule_after_load(num_tokens, num_tokens - NUM_PREFILL_LOOKAHEAD + 1) == [
        1,
        1,
    ]


def test_lookahead_cut_then_the_aligned_chunk_to_the_block_end():
    # Resumed on a block boundary with 18 tokens to go, the first chunk ends at
    # the last cacheable boundary, 2 tokens before the prefill end; the
    # lookahead cuts it to 15 tokens, mid-block, as before. The align rule then
    # ends the next chunk at that block's end, within the lookahead: it runs,
    # then the last 2 tokens. (Where the trailing cached block is dropped, as
    # for EAGLE-style drafters by default, the first chunk ends a block
    # earlier and the prefill does not get here.)
    num_tokens = 2 * BLOCK_SIZE + 2
    assert _schedule_after_load(num_tokens, BLOCK_SIZE) == [BLOCK_SIZE - 1, 1, 2]
