"""On a kv_both instance the remote-prefill flag of a request decides.

Patch: divergent-hybrid-hit-per-request. NIXL runs both PD instances
with kv_role="kv_both": requests that pull their KV from a producer
(``do_remote_prefill``) take the attention prefix hit, every other request
keeps Mamba-aligned hits.
"""

import pytest

from vllm.v1.request import RequestStatus

from ..builders import (
    BLOCK_SIZE,
    cached_hit_tokens,
    connectors,
    local_hit_tokens,
    prompt,
    receive_remote_prefill,
    remote_prefill_params,
    request,
    run_local_prefill,
    scheduler,
    vllm_config,
)

PATCH = "divergent-hybrid-hit-per-request"
PREFIX = prompt(8 * BLOCK_SIZE, seed=11)


def _kv_both_instance(kind: str = "nixl+decodebench"):
    """A kv_both instance that received one remote prefill sharing PREFIX
    (attention blocks cached, Mamba state only at the end of that prompt)
    and ran one local prefill of PREFIX's first 4 blocks (a Mamba state at
    token 64)."""
    sched = scheduler(vllm_config(**connectors(kind, "kv_both")))
    receive_remote_prefill(
        sched,
        request(
            PREFIX + prompt(2 * BLOCK_SIZE, seed=12),
            kv_transfer_params=remote_prefill_params(10),
        ),
    )
    run_local_prefill(sched, request(PREFIX[: 4 * BLOCK_SIZE]))
    return sched


@pytest.mark.patch(PATCH)
@pytest.mark.parametrize("kind", ["nixl", "nixl+decodebench"])
def test_remote_prefill_request_takes_attention_prefix_from_local_cache(kind):
    # NIXL alone: upstream's behaviour from v0.24 on (parity). A MultiConnector
    # with a connector that does not declare the capability: this patch's.
    sched = _kv_both_instance(kind)
    second = request(
        PREFIX + prompt(2 * BLOCK_SIZE, seed=13),
        kv_transfer_params=remote_prefill_params(10),
    )

    assert local_hit_tokens(sched, second) == len(PREFIX)


@pytest.mark.patch(PATCH)
def test_producer_side_request_keeps_mamba_aligned_hit():
    # Guard: the same prefix without do_remote_prefill is computed locally
    # and needs a Mamba state at the hit boundary: the one at token 64.
    sched = _kv_both_instance()
    local = request(PREFIX + prompt(2 * BLOCK_SIZE, seed=13))

    assert cached_hit_tokens(sched, local) == 4 * BLOCK_SIZE
    assert local_hit_tokens(sched, local) == 4 * BLOCK_SIZE


@pytest.mark.patch(PATCH)
def test_remote_prefill_request_runs_after_pulling_only_the_rest():
    sched = _kv_both_instance()
    suffix = prompt(2 * BLOCK_SIZE, seed=14)
    second = request(PREFIX + suffix, kv_transfer_params=remote_prefill_params(10))

    receive_remote_prefill(sched, second)

    assert second.status == RequestStatus.RUNNING
    assert second.num_computed_tokens >= second.num_prompt_tokens
