"""With MTP, a decode instance keeps the attention hit below a deeper Mamba hit.

Patch: divergent-hybrid-hit-deeper-mamba. With an EAGLE-style drafter (MTP, one
module run N times, as Qwen3.5 deploys it) the full-attention lookup drops its last
matched block and the Mamba groups' lookup does not. A decode instance that received
a remote prefill holds that prompt's attention blocks and the Mamba state at its
end, so a request extending the prompt gets a Mamba hit one block deeper than the
attention hit. ``KVCacheManager.get_computed_blocks_for_connector`` took that as
evicted attention blocks and fell back to the hit every group agrees on, which has
no Mamba state below the dropped block: 0. The request pulled its whole prompt
again. Patched, the lookup is made again up to the attention hit: the request keeps
it, and NIXL's load brings the rest with the Mamba state at its end.
"""

import pytest

from ..builders import (
    BLOCK_SIZE,
    connectors,
    hybrid_kv_cache_config,
    prompt,
    remote_prefill_params,
    request,
    scheduler,
    vllm_config,
)
from ..mamba_state import MambaStateChecker, checked_schedule, checked_step

PATCH = "divergent-hybrid-hit-deeper-mamba"
NUM_SPECULATIVE_TOKENS = 3
# A remote prefill one token past 8 blocks: the decode instance caches its 8
# attention blocks and the Mamba state at token 128.
FIRST = prompt(8 * BLOCK_SIZE + 1, seed=21)


def _decode_instance(kind):
    sched = scheduler(
        vllm_config(
            **connectors(kind, "kv_both"),
            num_speculative_tokens=NUM_SPECULATIVE_TOKENS,
            spec_method="mtp",
            mtp_modules=1,
        ),
        hybrid_kv_cache_config(num_speculative_blocks=NUM_SPECULATIVE_TOKENS),
    )
    checker = MambaStateChecker(sched, check_recompute=True)
    first = request(FIRST, kv_transfer_params=remote_prefill_params(9), max_tokens=2)
    sched.add_request(first)
    for _ in range(20):
        checked_step(sched, checker)
        if first.is_finished():
            return sched, checker
    raise AssertionError("the first remote prefill did not finish")


def _per_group_hits(sched, req):
    coordinator = sched.kv_cache_manager.coordinator
    return coordinator.find_longest_cache_hit_per_group(
        req.block_hashes, req.num_tokens - 1
    )[1]


@pytest.mark.patch(PATCH)
@pytest.mark.vllm_versions(">=0.28")
@pytest.mark.parametrize("kind", ["nixl", "nixl+decodebench"])
def test_remote_prefill_keeps_attention_hit_below_deeper_mamba_hit(kind):
    sched, checker = _decode_instance(kind)
    second = request(
        FIRST + prompt(2 * BLOCK_SIZE, seed=22),
        kv_transfer_params=remote_prefill_params(11),
    )
    # The case: the Mamba groups hit the state at token 128, the attention
    # group one block short of it (its last matched block dropped for MTP),
    # and the hit every group agrees on is 0.
    full, *mamba = _per_group_hits(sched, second)
    assert full == 7 * BLOCK_SIZE
    assert mamba == [8 * BLOCK_SIZE] * len(mamba)
    assert sched.kv_cache_manager.get_computed_blocks(second)[1] == 0

    sched.add_request(second)
    checked_schedule(sched, checker)  # the checker raises on a missing Mamba state
    stats = sched.connector_prefix_cache_stats
    local = second.num_tokens - stats.queries

    # Stock: 0, the whole prompt pulled again. Patched: the attention hit.
    assert local == 7 * BLOCK_SIZE
    admission = next(a for a in checker.admissions if a.request_id == second.request_id)
    assert admission.external_tokens > 0
    for _ in range(20):  # served from the load: its prompt is computed
        checked_step(sched, checker)
        if second.num_computed_tokens >= second.num_prompt_tokens:
            break
    assert second.num_computed_tokens >= second.num_prompt_tokens


@pytest.mark.vllm_versions(">=0.28")
def test_plain_request_keeps_hit_every_group_agrees_on():
    # Guard: without a load that restores the Mamba state (a request sent
    # straight to the decode instance) the deeper hits are not served.
    sched, checker = _decode_instance("nixl")
    plain = request(FIRST + prompt(2 * BLOCK_SIZE, seed=23))
    sched.add_request(plain)
    checked_schedule(sched, checker)
    stats = sched.connector_prefix_cache_stats
    assert plain.num_tokens - stats.queries == 0
