# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prefix-cache hits of remote-prefill requests of hybrid (full attention +
Mamba "align") models on a kv_both instance.

NIXL runs both PD instances with kv_role="kv_both", so the role cannot tell
whether the connector delivers a request's running Mamba state. A request
that pulls its KV from a prefill instance (``do_remote_prefill``) receives
that state and keeps the full-attention hit of a shared prefix, whatever
connectors are configured; every other request is computed locally and
keeps the hit every KV cache group agrees on.
"""

from typing import Any

import pytest

from tests.v1.core.utils import create_requests
from tests.v1.kv_connector.unit.test_hybrid_decode_prefix_hit import (
    BLOCK_SIZE,
    PREFIX_BLOCKS,
    create_hybrid_pd_scheduler,
    seed_decode_side_prefix,
)
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from vllm.v1.core.sched.scheduler import Scheduler

pytestmark = pytest.mark.cpu_test


def _remote_prefill_params() -> dict[str, Any]:
    """kv_transfer_params a PD proxy hands the decode instance."""
    return dict(
        do_remote_prefill=True,
        do_remote_decode=False,
        remote_engine_id="my-engine-id",
        remote_request_id="prefill-replay",
        remote_block_ids=list(range(PREFIX_BLOCKS + 2)),
        remote_host="my-host",
        remote_port=1234,
        tp_size=1,
    )


def _num_computed_tokens_of_replay(
    scheduler: Scheduler, kv_transfer_params: dict[str, Any] | None
) -> int:
    """Schedule a request that extends the seeded prefix by two blocks;
    return the tokens it starts with (local hit plus external tokens)."""
    manager = scheduler.kv_cache_manager
    assert isinstance(manager.coordinator, HybridKVCacheCoordinator)
    # A remote prefill leaves the prefix cached as on a decode instance.
    seed_decode_side_prefix(manager, PREFIX_BLOCKS)
    [replay] = create_requests(
        num_requests=1,
        num_tokens=(PREFIX_BLOCKS + 2) * BLOCK_SIZE,
        max_tokens=1,
        same_prompt=True,
        block_size=BLOCK_SIZE,
        req_ids=["replay"],
    )
    replay.kv_transfer_params = kv_transfer_params

    scheduler.add_request(replay)
    [new_req] = scheduler.schedule().scheduled_new_reqs
    return new_req.num_computed_tokens


def test_kv_both_remote_prefill_request_keeps_full_attention_hit():
    """The prefix comes from the local cache and the connector loads the
    rest, with a connector that does not declare
    supports_divergent_local_hybrid_hits."""
    scheduler = create_hybrid_pd_scheduler("kv_both", matched_tokens=BLOCK_SIZE)

    num_computed = _num_computed_tokens_of_replay(scheduler, _remote_prefill_params())

    assert num_computed == PREFIX_BLOCKS * BLOCK_SIZE + BLOCK_SIZE


@pytest.mark.parametrize(
    "kv_transfer_params",
    [None, dict(do_remote_prefill=False, do_remote_decode=True)],
    ids=["local", "remote-decode"],
)
def test_kv_both_local_request_keeps_mamba_aligned_hit(
    kv_transfer_params: dict[str, Any] | None,
):
    """A request computed on this instance (a plain one, or the prefill side
    of a PD pair) needs a Mamba state at its hit boundary: none here."""
    scheduler = create_hybrid_pd_scheduler("kv_both", matched_tokens=BLOCK_SIZE)

    num_computed = _num_computed_tokens_of_replay(scheduler, kv_transfer_params)

    assert num_computed == BLOCK_SIZE
