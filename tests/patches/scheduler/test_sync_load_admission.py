"""A synchronous KV load on a hybrid model waits for blocks instead of crashing.

Patch: mamba-align-admission-counts-sync-load. In Mamba align mode,
``MambaManager.get_num_blocks_to_allocate`` caps the blocks a new request takes
at ``physical_block_cap`` and does not count the block a synchronous external
load takes for the Mamba state at the end of the loaded tokens
(``allocate_external_computed_blocks``). On a nearly full pool
``allocate_slots`` admits the request, then ``get_new_blocks`` raises
"Cannot get 1 free blocks from the pool": in a server that ends the engine
core. Found by test_mamba_state_property.py.
"""

import pytest

from vllm.v1.request import RequestStatus

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


@pytest.mark.patch("mamba-align-admission-counts-sync-load")
@pytest.mark.vllm_versions(">=0.23")
@pytest.mark.parametrize("kind", ["nixl+decodebench", "decodebench+nixl"])
def test_sync_load_over_local_hit_waits_on_a_full_pool(kind):
    # Six short plain requests fill a 40-block pool, then a prompt of one cached
    # block + 17 tokens gets a synchronous DecodeBench load on top of its local
    # hit: its attention group needs 2 new blocks, each Mamba group 2 (the
    # loaded state's block and the running state's), 8 in all, when 7 are free.
    sched = scheduler(
        vllm_config(**connectors(kind, "kv_both")),
        hybrid_kv_cache_config(num_blocks=40),
    )
    checker = MambaStateChecker(sched)
    prefix = prompt(6 * BLOCK_SIZE, seed=100)
    reqs = [request(prefix[:BLOCK_SIZE], max_tokens=n) for n in (2, 2, 1, 1, 2, 2)]
    last = request(prefix[:BLOCK_SIZE] + prompt(BLOCK_SIZE + 1, seed=1006), max_tokens=1)
    reqs.append(last)
    for r in reqs:
        sched.add_request(r)

    waited = False
    for _ in range(100):
        checked_step(sched, checker)  # raises on a request without its Mamba state
        others_running = any(r.status == RequestStatus.RUNNING for r in reqs[:-1])
        waited |= last.status == RequestStatus.WAITING and others_running
        if all(r.is_finished() for r in reqs):
            break

    # It waited for blocks while the others ran, was admitted once they freed
    # some, with its synchronous load, and every request finished.
    assert waited
    assert all(r.is_finished() for r in reqs)
    (adm,) = [a for a in checker.admissions if a.request_id == last.request_id]
    assert adm.external_tokens > 0
    assert adm.serving_connector == "DecodeBenchConnector"
