"""The scheduler admits connector KV for Mamba-align hybrid models.

Patch: scheduler-mamba-external-kv. Stock vLLM asserts "External KV
connector is not verified yet" as soon as a connector reports external
tokens for a hybrid model in ``mamba_cache_mode="align"``, aligns the
(empty) chunk of a request whose KV is loading asynchronously, and cannot
handle KV load failures with more than one KV cache group.
"""

import pytest

from vllm.v1.request import RequestStatus

from ..builders import (
    BLOCK_SIZE,
    prompt,
    remote_prefill_params,
    request,
    scheduler,
    step,
    vllm_config,
)


@pytest.mark.patch("scheduler-mamba-external-kv")
def test_decode_instance_admits_remote_prefill_while_loading():
    sched = scheduler(vllm_config(kv_role="kv_both"))
    first = request(prompt(10 * BLOCK_SIZE), kv_transfer_params=remote_prefill_params(10))
    local = request(prompt(3 * BLOCK_SIZE, seed=5))
    sched.add_request(first)
    sched.add_request(local)

    output = step(sched)

    # The remote-prefill request waits for its KV without a chunk of its own,
    # and does not block the request behind it.
    assert first.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert first.request_id not in output.num_scheduled_tokens
    assert local.request_id in output.num_scheduled_tokens


@pytest.mark.patch("scheduler-mamba-external-kv")
def test_remote_prefill_runs_after_its_load_finishes():
    sched = scheduler(vllm_config(kv_role="kv_both"))
    first = request(prompt(10 * BLOCK_SIZE), kv_transfer_params=remote_prefill_params(10))
    sched.add_request(first)
    step(sched)

    step(sched, finished_recving={first.request_id})
    output = step(sched)

    # Full-prompt hit: only the last token is recomputed to sample from.
    assert output.num_scheduled_tokens[first.request_id] == 1
    assert first.status == RequestStatus.RUNNING


@pytest.mark.patch("scheduler-mamba-external-kv")
@pytest.mark.vllm_versions("<0.23")
def test_failed_load_on_hybrid_model_recomputes_from_zero():
    # From v0.23 on, upstream rejects block-level load failures for models
    # with several KV cache groups (connectors report failed requests instead).
    sched = scheduler(vllm_config(kv_role="kv_both", kv_load_failure_policy="recompute"))
    first = request(prompt(10 * BLOCK_SIZE), kv_transfer_params=remote_prefill_params(10))
    sched.add_request(first)
    step(sched)

    # The worker reports that one full-attention block failed to load.
    attention_blocks = sched.kv_cache_manager.get_block_ids(first.request_id)[0]
    step(
        sched,
        finished_recving={first.request_id},
        invalid_block_ids={attention_blocks[5]},
    )
    output = step(sched)

    # The attention KV is valid up to block 5, but the Mamba groups hold only
    # the state at the end of the prompt: the request recomputes from 0.
    assert first.status == RequestStatus.RUNNING
    assert output.num_scheduled_tokens[first.request_id] == 10 * BLOCK_SIZE
