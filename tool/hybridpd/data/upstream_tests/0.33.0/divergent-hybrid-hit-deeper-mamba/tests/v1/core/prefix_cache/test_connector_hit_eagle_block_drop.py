# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The local lookup for a request scheduled with a KV connector on a hybrid
model (full attention + Mamba "align") with an EAGLE-style drafter.

The full-attention lookup drops its last matched block for the drafter
(``drop_eagle_block``); the Mamba lookup does not. A request that extends a
cached prompt (its Mamba state cached at the end) then gets a Mamba hit one
block deeper than the full-attention hit. ``get_computed_blocks_for_connector``
looks the hit up again up to the full-attention hit instead of falling back to
the reconciled hit, which has no Mamba state below the dropped block. Without a
drafter a deeper Mamba hit means evicted full-attention blocks, and the lookup
still falls back to the reconciled hit.
"""

import pytest

from tests.v1.core.prefix_cache.test_partial_prefix_cache_hits import (
    make_full_mamba_manager,
)
from tests.v1.core.test_prefix_caching import make_request
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash

BLOCK_SIZE = 4


@pytest.fixture(autouse=True)
def _init_hash_fn():
    init_none_hash(sha256)


def _manager_with_cached_prompt(use_eagle: bool, num_blocks: int = 2):
    """A manager that cached a prompt of ``num_blocks`` blocks: its
    full-attention blocks and the Mamba state at its end. Also returns the
    prompt and its block ids per group."""
    manager = make_full_mamba_manager(
        dcp_world_size=1,
        hash_block_size=BLOCK_SIZE,
        use_eagle=use_eagle,
        num_speculative_blocks=1 if use_eagle else 0,
    )
    prefix = list(range(num_blocks * BLOCK_SIZE))
    req = make_request("0", prefix, BLOCK_SIZE, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req)
    assert num_computed == 0
    assert manager.allocate_slots(req, len(prefix), num_computed, computed_blocks)
    block_ids = manager.get_block_ids(req.request_id)
    manager.free(req)
    manager.new_step_starts()
    return manager, prefix, block_ids


def _extending_request(manager, prefix: list[int]):
    """A request extending the cached prompt by a block and a token, and its hit per
    KV cache group."""
    req = make_request("1", prefix + [100] * (BLOCK_SIZE + 1), BLOCK_SIZE, sha256)
    _, per_group_hits = manager.coordinator.find_longest_cache_hit_per_group(
        req.block_hashes, req.num_tokens - 1
    )
    return req, per_group_hits


@pytest.mark.parametrize("use_eagle", [False, True])
def test_connector_lookup_keeps_full_attention_hit_below_deeper_mamba_hit(
    use_eagle: bool,
):
    manager, prefix, _ = _manager_with_cached_prompt(use_eagle)
    req, per_group_hits = _extending_request(manager, prefix)
    full_hit = BLOCK_SIZE if use_eagle else 2 * BLOCK_SIZE
    # With EAGLE the Mamba group hits one block deeper than full attention.
    assert per_group_hits == (full_hit, 2 * BLOCK_SIZE)

    blocks, num_local, _, hit_diverged = manager.get_computed_blocks_for_connector(req)

    assert num_local == full_hit
    # Diverged: only a load that restores the Mamba state may complete it.
    assert hit_diverged == use_eagle
    assert [len(group) for group in blocks.blocks] == [
        full_hit // BLOCK_SIZE,
        0 if use_eagle else 2,
    ]
    # The reconciled hit has no Mamba state below the dropped block.
    assert manager.get_computed_blocks(req)[1] == (0 if use_eagle else full_hit)


@pytest.mark.parametrize("use_eagle", [False, True])
def test_connector_lookup_after_evicted_full_attention_blocks(use_eagle: bool):
    # The full-attention blocks 2 and 3 of a cached four-block prompt are
    # evicted; the Mamba state at its end survives.
    manager, prefix, (full_ids, _) = _manager_with_cached_prompt(
        use_eagle, num_blocks=4
    )
    manager.block_pool.evict_blocks({full_ids[2], full_ids[3]})
    req, per_group_hits = _extending_request(manager, prefix)
    full_hit = BLOCK_SIZE if use_eagle else 2 * BLOCK_SIZE
    assert per_group_hits == (full_hit, 4 * BLOCK_SIZE)

    blocks, num_local, _, hit_diverged = manager.get_computed_blocks_for_connector(req)

    if use_eagle:
        # A dropped block and evicted blocks look alike: the lookup keeps the
        # full-attention hit, diverged, for a load to complete.
        assert (num_local, hit_diverged) == (full_hit, True)
        assert [len(group) for group in blocks.blocks] == [full_hit // BLOCK_SIZE, 0]
    else:
        # Without a drafter the reconciled hit, as before: no Mamba state
        # below the evicted blocks.
        assert (num_local, hit_diverged) == (0, False)
