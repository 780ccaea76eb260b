"""On a kv_both instance the remote-prefill flag of a request decides.

Patch: kv-manager-remote-prefill-skip-mamba. NIXL runs both PD instances
with kv_role="kv_both": requests that pull their KV from a producer
(``do_remote_prefill``) leave the Mamba groups out of the prefix hit, every
other request keeps Mamba-aligned hits.
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

PREFIX = prompt(8 * BLOCK_SIZE, seed=11)


def _kv_both_instance():
    """A kv_both instance that received one remote prefill sharing PREFIX
    (attention blocks cached, Mamba state only at the end of that prompt)
    and ran one local prefill of PREFIX's first 4 blocks (a Mamba state at
    token 64)."""
    sched = scheduler(vllm_config(kv_role="kv_both"))
    receive_remote_prefill(
        sched,
        request(
            PREFIX + prompt(2 * BLOCK_SIZE, seed=12),
            kv_transfer_params=remote_prefill_params(10),
        ),
    )
    run_local_prefill(sched, request(PREFIX[: 4 * BLOCK_SIZE]))
    return sched


@pytest.mark.patch("kv-manager-remote-prefill-skip-mamba")
def test_remote_prefill_request_gets_attention_prefix_hit():
    sched = _kv_both_instance()
    second = request(
        PREFIX + prompt(2 * BLOCK_SIZE, seed=13),
        kv_transfer_params=remote_prefill_params(10),
    )

    blocks, num_hit_tokens = sched.kv_cache_manager.get_computed_blocks(second)

    assert num_hit_tokens == len(PREFIX)
    full_attention, *mamba_groups = blocks.blocks
    assert len(full_attention) == len(PREFIX) // BLOCK_SIZE
    assert all(len(group) == 0 for group in mamba_groups)


@pytest.mark.patch("kv-manager-remote-prefill-skip-mamba")
def test_producer_side_request_keeps_mamba_aligned_hit():
    # Guard: the same prefix without do_remote_prefill is computed locally
    # and needs a Mamba state at the hit boundary: the one at token 64.
    sched = _kv_both_instance()
    local = request(PREFIX + prompt(2 * BLOCK_SIZE, seed=13))

    blocks, num_hit_tokens = sched.kv_cache_manager.get_computed_blocks(local)

    assert num_hit_tokens == 4 * BLOCK_SIZE
    _, *mamba_groups = blocks.blocks
    # The Mamba hit is the state block at the boundary (null blocks before).
    assert all(len(group) == 4 for group in mamba_groups)
    assert all(not group[-1].is_null for group in mamba_groups)


@pytest.mark.patch("kv-manager-remote-prefill-skip-mamba")
def test_remote_prefill_request_is_admitted_with_local_hit():
    sched = _kv_both_instance()
    suffix = prompt(2 * BLOCK_SIZE, seed=14)
    second = request(PREFIX + suffix, kv_transfer_params=remote_prefill_params(10))

    receive_remote_prefill(sched, second)

    # Local prefix + pulled suffix; the request runs after its load.
    assert second.num_computed_tokens == len(PREFIX) + len(suffix)
    assert second in sched.running
