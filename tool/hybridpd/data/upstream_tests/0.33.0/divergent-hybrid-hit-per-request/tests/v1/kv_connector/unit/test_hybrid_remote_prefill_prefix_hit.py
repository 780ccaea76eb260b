# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Divergent local hybrid hits (full attention + Mamba "align") decided per
request behind a MultiConnector.

A decode instance caches every full-attention block of a prefix it received
from a prefiller, but no Mamba state inside it. A later request sharing the
prefix may start at the deeper full-attention hit only if the KV load that
serves it restores the Mamba groups at its end. The scheduler asks the
connector, before the lookup, where its load would resume the request
(``get_divergent_hit_resume_point``: a MultiConnector gives the nearest point
of any child) and, after the query, whether the load of the child that matched
restores the Mamba groups (``get_loaded_kv_cache_group_ids``).
"""

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
    DecodeBenchConnector,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.request import Request, RequestStatus

from .test_divergent_hit_resume_point import (
    BLOCK_SIZE,
    CAPABLE,
    DECODE_BENCH,
    DECODER_TOKENS,
    NIXL,
    PREFIX_TOKENS,
    PROMPT_TOKENS,
    DivergentHitCapableConnector,
    admit,
    hybrid_connector,
    make_prefill_side_request,
    make_request,
)
from .test_divergent_hit_resume_point import (
    create_hybrid_scheduler as _create_hybrid_scheduler,
)

pytestmark = pytest.mark.cpu_test

ATTENTION_ONLY = "AttentionOnlyLoadConnector"
# The test connectors resolve in this module.
__all__ = ["AttentionOnlyLoadConnector", "DivergentHitCapableConnector"]


class AttentionOnlyLoadConnector(DecodeBenchConnector):
    """A load that writes the attention groups only: it cannot complete a
    divergent hybrid hit."""

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        groups = self._kv_cache_config.kv_cache_groups
        return tuple(
            group_id
            for group_id in super().get_loaded_kv_cache_group_ids(request)
            if not isinstance(groups[group_id].kv_cache_spec, MambaSpec)
        )


def create_hybrid_scheduler(
    connectors: list[str], kv_role: str = "kv_consumer"
) -> Scheduler:
    return _create_hybrid_scheduler(connectors, kv_role, module=__name__)


NIXL_SETS = pytest.mark.parametrize(
    "connectors",
    [[NIXL, DECODE_BENCH], [DECODE_BENCH, NIXL]],
    ids=["nixl+decodebench", "decodebench+nixl"],
)


def test_remote_prefill_keeps_local_hit_and_loads_the_rest():
    """The cached prefix comes from the local cache and NIXL loads the rest of
    the prompt with the Mamba state at its end, also with a child that cannot
    complete a divergent hit configured beside NIXL."""
    scheduler = create_hybrid_scheduler([NIXL, DECODE_BENCH])
    request = make_request(PROMPT_TOKENS, remote_prefill=True)

    num_local, num_external = admit(scheduler, request)

    assert num_local == PREFIX_TOKENS
    assert num_local + num_external == PROMPT_TOKENS - 1
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_plain_request_keeps_agreed_hit():
    """NIXL loads nothing for a plain request, so no load restores a Mamba
    state: it starts at the hit every group agrees on (none here), and from
    there DecodeBench loads all but the last token."""
    scheduler = create_hybrid_scheduler([NIXL, DECODE_BENCH])
    request = make_request(PROMPT_TOKENS, remote_prefill=False)

    num_local, num_external = admit(scheduler, request)

    assert (num_local, num_external) == (0, PROMPT_TOKENS - 1)
    assert request.status == RequestStatus.RUNNING


def test_prompt_one_token_past_cached_prefix_loads_last_block():
    """The resume point is kept below with a child beside NIXL too: the local
    hit stops one block short of NIXL's load target and NIXL loads that block
    with the state."""
    scheduler = create_hybrid_scheduler([NIXL, DECODE_BENCH])
    request = make_request(PREFIX_TOKENS + 1, remote_prefill=True)

    num_local, num_external = admit(scheduler, request)

    assert num_local == PREFIX_TOKENS - BLOCK_SIZE
    assert num_external == BLOCK_SIZE
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_first_matching_child_that_restores_mamba_keeps_hit():
    """MultiConnector(DecodeBench, NIXL): DecodeBench matches first and serves the
    remote prefill. Its load writes the Mamba groups
    (get_loaded_kv_cache_group_ids), so the local hit is kept under its load."""
    scheduler = create_hybrid_scheduler([DECODE_BENCH, NIXL])
    request = make_request(PROMPT_TOKENS, remote_prefill=True)

    num_local, num_external = admit(scheduler, request)

    assert num_local == PREFIX_TOKENS
    # DecodeBench fills all but the last token, synchronously; NIXL would
    # have stopped at its back-off too.
    assert num_local + num_external == PROMPT_TOKENS - 1


def test_load_not_restoring_mamba_falls_back_to_agreed_hit():
    """A child whose load writes the attention groups only matches a divergent
    hit first. Its load would resume the request without a Mamba state, so the
    request starts from the hit every group agrees on (none here), without
    that load. For a remote prefill that recomputes the whole prompt and drops
    the prefiller's work (its blocks are released): acceptable for such a
    connector only, none shipped in vLLM answers so."""
    scheduler = create_hybrid_scheduler([ATTENTION_ONLY, NIXL])
    request = make_request(PROMPT_TOKENS, remote_prefill=True)

    num_local, num_external = admit(scheduler, request)

    assert (num_local, num_external) == (0, 0)


def test_prefill_side_pull_from_decoder_keeps_local_hit():
    """With bidirectional KV transfer and a child beside NIXL that cannot
    complete a divergent hit, a prefill instance still takes the cached prefix
    from the local cache and NIXL pulls the rest of what the decoder holds."""
    scheduler = create_hybrid_scheduler([NIXL, DECODE_BENCH], kv_role="kv_both")
    request = make_prefill_side_request(PROMPT_TOKENS, DECODER_TOKENS)

    assert admit(scheduler, request) == (PREFIX_TOKENS, DECODER_TOKENS - PREFIX_TOKENS)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS


@NIXL_SETS
def test_prefill_side_request_without_pull_gets_no_resume_point(connectors):
    """NIXL loads nothing for a prefill instance's request unless it pulls the
    decoder's blocks, so no child may serve a local hit deeper than the Mamba
    groups' hit for it."""
    connector = hybrid_connector(connectors, kv_role="kv_both", module=__name__)

    assert (
        connector.get_divergent_hit_resume_point(
            make_prefill_side_request(PROMPT_TOKENS)
        )
        is None
    )


@pytest.mark.parametrize(
    "connectors,remote,plain",
    [
        ([NIXL, DECODE_BENCH], PROMPT_TOKENS - 1, None),
        ([DECODE_BENCH, NIXL], PROMPT_TOKENS - 1, None),
        ([NIXL, CAPABLE], PROMPT_TOKENS - 1, PROMPT_TOKENS),
        ([CAPABLE, NIXL], PROMPT_TOKENS - 1, PROMPT_TOKENS),
        ([DECODE_BENCH, CAPABLE], PROMPT_TOKENS, PROMPT_TOKENS),
    ],
    ids=[
        "nixl+decodebench",
        "decodebench+nixl",
        "nixl+capable",
        "capable+nixl",
        "decodebench+capable",
    ],
)
def test_multi_connector_resume_point_is_nearest_child_point(connectors, remote, plain):
    """The child that serves the request is known only after the lookup, so a
    MultiConnector gives the nearest point any child gives."""
    multi = hybrid_connector(connectors, module=__name__)
    remote_request = make_request(PROMPT_TOKENS, remote_prefill=True)
    plain_request = make_request(PROMPT_TOKENS, remote_prefill=False)

    assert multi.get_divergent_hit_resume_point(remote_request) == remote
    assert multi.get_divergent_hit_resume_point(plain_request) == plain


@pytest.mark.parametrize(
    "connectors,capable",
    [
        ([NIXL, DECODE_BENCH], False),
        ([DECODE_BENCH, NIXL], False),
        ([NIXL, CAPABLE], True),
    ],
    ids=["nixl+decodebench", "decodebench+nixl", "nixl+capable"],
)
def test_multi_connector_capability_stays_all_children(connectors, capable):
    """The capability stays the AND over the children."""
    connector = hybrid_connector(connectors, module=__name__)
    assert connector.supports_divergent_local_hybrid_hits is capable
