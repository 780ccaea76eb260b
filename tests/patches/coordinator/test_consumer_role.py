"""A kv_consumer instance keeps the attention prefix hit of a hybrid model
for the requests whose KV load restores the Mamba state, and only for them.

Patch: coordinator-consumer-skips-mamba-hit (from v0.28 the NIXL+DecodeBench case,
past upstream's gate, proves divergent-hybrid-hit-per-request: decode_hit_patch). On a decode instance the
connector delivers only the running Mamba state at the end of each prompt,
so the Mamba groups never hold the per-block states of a shared prefix.
Stock v0.20.2 reduces the hit of every group to that of the Mamba groups
(0); stock v0.32+ keeps the attention hit only when every connector declares
``supports_divergent_local_hybrid_hits`` (NIXL alone does, a MultiConnector
with a connector that does not declare it does not). The role alone never
decides: see tests/patches/decode_hit for the state-level checks.
"""

import pytest

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
from ..decode_hit_patch import kinds

PATCH = "coordinator-consumer-skips-mamba-hit"
PREFIX = prompt(8 * BLOCK_SIZE, seed=1)


def _decode_instance_with_cached_prefix(kind: str, kv_role: str = "kv_consumer"):
    """A decode instance that served one remote-prefill request whose prompt
    starts with PREFIX: its full-attention blocks are cached, its Mamba
    groups only hold the state at the end of that prompt."""
    sched = scheduler(vllm_config(**connectors(kind, kv_role)))
    first = request(
        PREFIX + prompt(2 * BLOCK_SIZE, seed=2),
        kv_transfer_params=remote_prefill_params(10),
    )
    receive_remote_prefill(sched, first)
    return sched


@pytest.mark.parametrize("kind", kinds("nixl", "nixl+decodebench"))
def test_kv_consumer_takes_attention_prefix_from_local_cache(kind):
    # With NIXL alone this is upstream's behaviour from v0.24 on (parity); with
    # a connector set where upstream's capability gate is false it is this
    # patch's.
    sched = _decode_instance_with_cached_prefix(kind)
    suffix = prompt(2 * BLOCK_SIZE, seed=3)
    second = request(PREFIX + suffix, kv_transfer_params=remote_prefill_params(10))

    # The prefix comes from the local cache; the connector pulls the rest.
    assert local_hit_tokens(sched, second) == len(PREFIX)


@pytest.mark.patch(PATCH)
def test_kv_consumer_request_without_transfer_falls_back_to_common_hit():
    # Guard: a request no connector loads (NIXL loads only remote prefills)
    # has no Mamba state at the end of the attention hit, so it gets the hit
    # every group agrees on (none here), whatever the instance's role.
    sched = _decode_instance_with_cached_prefix("nixl")
    assert local_hit_tokens(sched, request(PREFIX + prompt(2 * BLOCK_SIZE, seed=3))) == 0


@pytest.mark.patch(PATCH)
@pytest.mark.parametrize("kv_role", ["kv_producer", None])
def test_producer_and_plain_instances_keep_mamba_aligned_hits(kv_role):
    # Guard: only a consumer leaves the Mamba groups out. A producer (or an
    # instance without a connector) computes its Mamba states itself, and
    # after a prefill of PREFIX + X its Mamba groups hold a state only at the
    # end of that prompt, so a request sharing just PREFIX has no common hit.
    sched = scheduler(vllm_config(kv_role=kv_role))
    run_local_prefill(sched, request(PREFIX + prompt(2 * BLOCK_SIZE, seed=2)))
    second = request(PREFIX + prompt(2 * BLOCK_SIZE, seed=3))

    assert cached_hit_tokens(sched, second) == 0
