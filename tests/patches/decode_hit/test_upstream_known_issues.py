"""vLLM bugs on hybrid models that this patch series does not fix (yet).

Each test reproduces the bug on a real Scheduler and is a strict xfail: it
fails while the bug is there, on stock and patched builds alike, and turns red
(XPASS) the day a pin carries a fix, so the exclusion it justifies elsewhere
can be removed.
"""

import pytest

from ..builders import (
    BLOCK_SIZE,
    connectors,
    hybrid_kv_cache_config,
    prompt,
    request,
    scheduler,
    vllm_config,
)
from ..mamba_state import MambaStateChecker, checked_step


@pytest.mark.vllm_versions(">=0.23")
@pytest.mark.xfail(
    strict=True,
    raises=ValueError,
    reason=(
        "vLLM bug: in Mamba align mode, MambaManager.get_num_blocks_to_allocate "
        "caps new blocks at physical_block_cap and does not count the block a "
        "synchronous external load on top of a local hit takes, so allocate_slots "
        "admits the request and then fails with 'Cannot get 1 free blocks from "
        "the pool'"
    ),
)
@pytest.mark.parametrize("kind", ["nixl+decodebench", "decodebench+nixl"])
def test_sync_load_over_local_hit_on_a_full_pool(kind):
    # Found by test_mamba_state_property.py (which therefore gives these
    # connector sets only a pool that never runs out). Six short plain requests
    # fill a 40-block pool, then a prompt of one cached block + 17 tokens gets
    # a synchronous DecodeBench load on top of its local hit.
    sched = scheduler(
        vllm_config(**connectors(kind, "kv_both")),
        hybrid_kv_cache_config(num_blocks=40),
    )
    checker = MambaStateChecker(sched)
    prefix = prompt(6 * BLOCK_SIZE, seed=100)
    reqs = [request(prefix[:BLOCK_SIZE], max_tokens=n) for n in (2, 2, 1, 1, 2, 2)]
    reqs.append(request(prefix[:BLOCK_SIZE] + prompt(BLOCK_SIZE + 1, seed=1006),
                        max_tokens=1))
    for r in reqs:
        sched.add_request(r)
    for _ in range(100):
        checked_step(sched, checker)
        if all(r.is_finished() for r in reqs):
            break
    assert all(r.is_finished() for r in reqs)
