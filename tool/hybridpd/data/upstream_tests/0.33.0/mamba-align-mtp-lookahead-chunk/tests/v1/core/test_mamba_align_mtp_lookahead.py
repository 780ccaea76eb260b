# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Multi-module MTP's prefill lookahead (`_reserve_prefill_lookahead`, #50062)
next to the Mamba align rule (`_mamba_block_aligned_split`).

A KV load can resume a prefill inside the prompt's last full block: with three
MTP modules a P/D prefiller stops two tokens short, so a prompt one token past
a block boundary resumes one token before that boundary. A prefill without a
load gets there too when the lookahead cuts a chunk that would end on the last
block boundary before the prefill end. The align rule allows only the chunk
that ends on the boundary, fewer than `num_prefill_lookahead` tokens before the
prefill end; that chunk must be scheduled, not cut to nothing.
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


def _align_scheduler(with_connector: bool = True):
    vllm_config = create_vllm_config(block_size=BLOCK_SIZE)
    vllm_config.cache_config.mamba_cache_mode = "align"
    if not with_connector:
        vllm_config.kv_transfer_config = None
    kv_cache_config = make_kv_cache_config(
        BLOCK_SIZE, mamba_enabled=True, mamba_cache_mode="align"
    )
    scheduler = create_scheduler(vllm_config, kv_cache_config=kv_cache_config)
    assert scheduler.need_mamba_block_aligned_split
    scheduler.num_prefill_lookahead = NUM_PREFILL_LOOKAHEAD
    return scheduler


def _run_prefill(scheduler, request, num_tokens: int) -> list[int]:
    """The number of tokens scheduled for `request` in each step until its
    prefill ends (at most 4 steps)."""
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
    return _run_prefill(scheduler, request, num_tokens)


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


def test_load_resumed_on_a_boundary_then_the_aligned_chunk_to_the_block_end():
    # Loaded up to a block boundary (16 tokens) with 18 to go, the first chunk
    # ends at the last cacheable boundary, 2 tokens before the prefill end; the
    # lookahead cuts it to 15 tokens, mid-block, as before. The align rule then
    # ends the next chunk at that block's end, within the lookahead: it runs,
    # then the last 2 tokens. (Where the trailing cached block is dropped, as
    # for EAGLE-style drafters by default, the first chunk ends a block
    # earlier and the prefill does not get here.)
    num_tokens = 2 * BLOCK_SIZE + 2
    assert _schedule_after_load(num_tokens, BLOCK_SIZE) == [BLOCK_SIZE - 1, 1, 2]


def test_prefill_without_a_load_runs_the_aligned_chunk():
    # No KV connector, nothing cached: the first chunk would end on the last
    # block boundary, 2 tokens before the prefill end; the lookahead cuts it to
    # 31 tokens, mid-block. The align rule then ends the next chunk at that
    # boundary, within the lookahead: it runs (v0.33.0 schedules [31, 0, 0, 0]),
    # then the last 2 tokens.
    scheduler = _align_scheduler(with_connector=False)
    assert scheduler.connector is None
    num_tokens = 2 * BLOCK_SIZE + 2
    request = create_request(num_tokens=num_tokens)
    scheduler.add_request(request)
    assert _run_prefill(scheduler, request, num_tokens) == [2 * BLOCK_SIZE - 1, 1, 2]
