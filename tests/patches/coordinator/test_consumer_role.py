"""A kv_consumer instance keeps the attention prefix hit of a hybrid model.

Patch: coordinator-consumer-skips-mamba-hit. On a decode instance the
connector delivers only the running Mamba state at the end of each prompt,
so the Mamba groups never hold the per-block states of a shared prefix.
Stock vLLM reduces the hit of every group to that of the Mamba groups (0).
"""

import pytest

from ..builders import (
    BLOCK_SIZE,
    prompt,
    receive_remote_prefill,
    remote_prefill_params,
    request,
    run_local_prefill,
    scheduler,
    vllm_config,
)

PREFIX = prompt(8 * BLOCK_SIZE, seed=1)


def _decode_instance_with_cached_prefix(kv_role: str):
    """A decode instance that served one remote-prefill request whose prompt
    starts with PREFIX: its full-attention blocks are cached, its Mamba
    groups only hold the state at the end of that prompt."""
    sched = scheduler(vllm_config(kv_role=kv_role))
    first = request(
        PREFIX + prompt(2 * BLOCK_SIZE, seed=2),
        kv_transfer_params=remote_prefill_params(10),
    )
    receive_remote_prefill(sched, first)
    return sched


@pytest.mark.patch("coordinator-consumer-skips-mamba-hit")
def test_kv_consumer_keeps_attention_hit_without_request_flag():
    sched = _decode_instance_with_cached_prefix("kv_consumer")
    second = request(PREFIX + prompt(2 * BLOCK_SIZE, seed=3))

    blocks, num_hit_tokens = sched.kv_cache_manager.get_computed_blocks(second)

    assert num_hit_tokens == len(PREFIX)
    full_attention, *mamba_groups = blocks.blocks
    assert len(full_attention) == len(PREFIX) // BLOCK_SIZE
    # The Mamba groups contribute no blocks: their state arrives with the
    # request's KV transfer.
    assert all(len(group) == 0 for group in mamba_groups)


@pytest.mark.patch("coordinator-consumer-skips-mamba-hit")
def test_kv_consumer_schedules_only_the_missing_tokens_for_transfer():
    sched = _decode_instance_with_cached_prefix("kv_consumer")
    suffix = prompt(2 * BLOCK_SIZE, seed=3)
    second = request(PREFIX + suffix, kv_transfer_params=remote_prefill_params(10))

    sched.add_request(second)
    sched.schedule()

    # The prefix is taken from the local cache; the connector is asked only
    # for the rest of the prompt.
    stats = sched.connector_prefix_cache_stats
    assert stats is not None
    assert stats.queries == len(suffix)
    assert second.num_computed_tokens > len(PREFIX)


@pytest.mark.patch("coordinator-consumer-skips-mamba-hit")
@pytest.mark.parametrize("kv_role", ["kv_producer", None])
def test_producer_and_plain_instances_keep_mamba_aligned_hits(kv_role):
    # Guard: only a consumer leaves the Mamba groups out. A producer (or an
    # instance without a connector) computes its Mamba states itself, and
    # after a prefill of PREFIX + X its Mamba groups hold a state only at the
    # end of that prompt, so a request sharing just PREFIX has no common hit.
    sched = scheduler(vllm_config(kv_role=kv_role))
    run_local_prefill(sched, request(PREFIX + prompt(2 * BLOCK_SIZE, seed=2)))
    second = request(PREFIX + prompt(2 * BLOCK_SIZE, seed=3))

    _, num_hit_tokens = sched.kv_cache_manager.get_computed_blocks(second)

    assert num_hit_tokens == 0
