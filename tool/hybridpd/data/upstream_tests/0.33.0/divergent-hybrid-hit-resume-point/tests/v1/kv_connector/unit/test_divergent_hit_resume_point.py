# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where a connector's load would resume a request of a hybrid model (full
attention + Mamba "align"), and the local hit kept below it.

A decode instance caches every full-attention block of a prefix it received
from a prefiller, but no Mamba state inside it. With a connector that declares
``supports_divergent_local_hybrid_hits`` a later request sharing the prefix
starts at the deeper full-attention hit, and the connector's load restores the
Mamba state at its end. ``get_divergent_hit_resume_point`` says where that load
would resume the request; when the full-attention hit reaches it (a prompt one
token past the cached prefix) the scheduler keeps the hit below it, so that the
load has a block to bring and the state with it.
"""

import importlib
from unittest.mock import patch

import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
    DecodeBenchConnector,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from .utils import (
    create_request,
    create_scheduler,
    create_vllm_config,
    make_kv_cache_config,
)

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 16
NUM_BLOCKS = 100
PREFIX_BLOCKS = 4
PREFIX_TOKENS = PREFIX_BLOCKS * BLOCK_SIZE
# A request that extends the cached prefix by two blocks.
PROMPT_TOKENS = PREFIX_TOKENS + 2 * BLOCK_SIZE
# The decoder's tokens of a prompt, for a prefill instance's pull.
DECODER_TOKENS = PROMPT_TOKENS - BLOCK_SIZE

NIXL = "NixlConnector"
DECODE_BENCH = "DecodeBenchConnector"
CAPABLE = "DivergentHitCapableConnector"


class DivergentHitCapableConnector(DecodeBenchConnector):
    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return True


def _connector_config(name: str, kv_role: str, module: str) -> dict:
    config: dict = {"kv_connector": name, "kv_role": kv_role}
    if name not in KVConnectorFactory._registry:
        # A test connector, defined in ``module``.
        config["kv_connector_module_path"] = module
    if name == NIXL and kv_role == "kv_both":
        # The prefill instance pulls the blocks a decoder holds for a prompt,
        # however few.
        config["kv_connector_extra_config"] = {
            "bidirectional_kv_xfer": True,
            "kv_recompute_threshold": 0,
        }
    return config


def create_hybrid_scheduler(
    connectors: list[str], kv_role: str = "kv_consumer", module: str = __name__
) -> Scheduler:
    """A decode instance (``kv_role="kv_both"``: a prefill instance with
    bidirectional KV transfer) of a full attention + Mamba ("align") model whose
    KV connector is ``connectors[0]``, or a MultiConnector of ``connectors`` in
    that order. Test connectors are looked up in ``module``."""
    if len(connectors) == 1:
        kwargs = _connector_config(connectors[0], kv_role, module)
        vllm_config = create_vllm_config(
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=1024,
            disable_hybrid_kv_cache_manager=False,
            **kwargs,
        )
    else:
        vllm_config = create_vllm_config(
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=1024,
            disable_hybrid_kv_cache_manager=False,
            kv_connector="MultiConnector",
            kv_connector_extra_config={
                "connectors": [
                    _connector_config(name, kv_role, module) for name in connectors
                ]
            },
        )
    vllm_config.cache_config.mamba_cache_mode = "align"
    kv_cache_config = make_kv_cache_config(
        block_size=BLOCK_SIZE,
        mamba_enabled=True,
        mamba_cache_mode="align",
        num_blocks=NUM_BLOCKS,
    )
    return create_scheduler(
        vllm_config, num_blocks=NUM_BLOCKS, kv_cache_config=kv_cache_config
    )


def hybrid_connector(
    connectors: list[str], kv_role: str = "kv_consumer", module: str = __name__
) -> KVConnectorBase_V1:
    connector = create_hybrid_scheduler(connectors, kv_role, module).connector
    assert connector is not None
    return connector


def seed_decode_side_prefix(scheduler: Scheduler) -> None:
    """Cache the prefix as a decode instance holds it after a transfer: every
    full-attention block, and no Mamba state inside the prefix."""
    manager = scheduler.kv_cache_manager
    fill = create_request(
        num_tokens=PREFIX_TOKENS,
        common_prefix_len=PREFIX_TOKENS,
        block_size=BLOCK_SIZE,
    )
    computed_blocks, num_computed, _ = manager.get_computed_blocks(fill)
    assert num_computed == 0
    mamba_block_ids = []
    for i in range(PREFIX_BLOCKS):
        manager.allocate_slots(
            fill, BLOCK_SIZE, new_computed_blocks=computed_blocks if i == 0 else None
        )
        fill.num_computed_tokens += BLOCK_SIZE
        _, group_mamba_ids = manager.get_block_ids(fill.request_id)
        mamba_block_ids.append(group_mamba_ids[i])
    manager.free(fill)
    manager.block_pool.evict_blocks(set(mamba_block_ids))


def make_request(num_tokens: int, remote_prefill: bool) -> Request:
    """A request whose prompt starts with the seeded prefix."""
    return create_request(
        num_tokens=num_tokens,
        common_prefix_len=PREFIX_TOKENS,
        do_remote_prefill=remote_prefill,
        num_remote_blocks=-(-num_tokens // BLOCK_SIZE),
        block_size=BLOCK_SIZE,
    )


def make_prefill_side_request(
    num_tokens: int, decoder_tokens: int | None = None
) -> Request:
    """A prefill instance's request that a decoder will continue; with
    ``decoder_tokens``, the decoder holds blocks for that many of its prompt
    tokens (bidirectional KV transfer)."""
    request = create_request(
        num_tokens=num_tokens,
        common_prefix_len=PREFIX_TOKENS,
        do_remote_decode=True,
        block_size=BLOCK_SIZE,
    )
    if decoder_tokens is not None:
        assert request.kv_transfer_params is not None
        request.kv_transfer_params.update(
            remote_engine_id="decode-engine-id",
            remote_request_id=f"decode-{request.request_id}",
            remote_block_ids=list(range(-(-decoder_tokens // BLOCK_SIZE))),
            remote_host="decode-host",
            remote_port=1234,
            remote_num_tokens=decoder_tokens,
        )
    return request


def admit(scheduler: Scheduler, request: Request) -> tuple[int, int]:
    """Seed the prefix, schedule ``request`` and return what it starts with:
    (local prefix-cache hit, tokens the connector loads)."""
    seed_decode_side_prefix(scheduler)
    coordinator = scheduler.kv_cache_manager.coordinator
    assert isinstance(coordinator, HybridKVCacheCoordinator)
    _, per_group_hits = coordinator.find_longest_cache_hit_per_group(
        request.block_hashes, request.num_tokens - 1
    )
    # The hit diverges: full attention holds the prefix, Mamba nothing in it.
    assert per_group_hits == (PREFIX_TOKENS, 0)
    scheduler.add_request(request)
    return schedule_and_measure(scheduler, request)


def schedule_and_measure(scheduler: Scheduler, request: Request) -> tuple[int, int]:
    connector = scheduler.connector
    assert connector is not None
    with patch.object(
        connector, "update_state_after_alloc", wraps=connector.update_state_after_alloc
    ) as update_state_after_alloc:
        output = scheduler.schedule()
    update_state_after_alloc.assert_called_once()
    _, _, num_external = update_state_after_alloc.call_args.args
    if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
        num_computed = request.num_computed_tokens
    else:
        [new_req] = output.scheduled_new_reqs
        num_computed = new_req.num_computed_tokens
    return num_computed - num_external, num_external


def test_prompt_one_token_past_cached_prefix_loads_last_block():
    """The full-attention hit reaches NIXL's load target (prompt - 1), where NIXL
    would load nothing and no Mamba state. The local hit stops one block short
    and NIXL loads that block with the state, instead of the decode instance
    recomputing the whole prompt."""
    scheduler = create_hybrid_scheduler([NIXL])
    request = make_request(PREFIX_TOKENS + 1, remote_prefill=True)

    num_local, num_external = admit(scheduler, request)

    assert num_local == PREFIX_TOKENS - BLOCK_SIZE
    assert num_external == BLOCK_SIZE
    assert num_local + num_external == request.num_tokens - 1
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_remote_prefill_keeps_local_hit_and_loads_the_rest():
    """Below the resume point nothing changes: the cached prefix comes from the
    local cache and NIXL loads the rest of the prompt with the Mamba state at
    its end. (Passes without the resume point too.)"""
    scheduler = create_hybrid_scheduler([NIXL])
    request = make_request(PROMPT_TOKENS, remote_prefill=True)

    num_local, num_external = admit(scheduler, request)

    assert num_local == PREFIX_TOKENS
    assert num_local + num_external == PROMPT_TOKENS - 1
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_prefill_side_pull_from_decoder_keeps_local_hit():
    """With bidirectional KV transfer, a prefill instance pulls the blocks the
    decoder holds for the prompt, with the Mamba state at their end: the cached
    prefix comes from the local cache and NIXL pulls the rest of what the
    decoder holds. (Passes without the resume point too.)"""
    scheduler = create_hybrid_scheduler([NIXL], kv_role="kv_both")
    request = make_prefill_side_request(PROMPT_TOKENS, DECODER_TOKENS)

    assert admit(scheduler, request) == (PREFIX_TOKENS, DECODER_TOKENS - PREFIX_TOKENS)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_prefill_side_hit_reaching_pull_from_decoder_pulls_last_block():
    """The decoder holds blocks for exactly the cached prefix: the
    full-attention hit reaches where the pull would end, so taken whole the
    pull would bring no tokens and no Mamba state. The local hit stops one
    block short and NIXL pulls that block with the decoder's state, instead
    of the prefill instance recomputing from the hit every group agrees on."""
    scheduler = create_hybrid_scheduler([NIXL], kv_role="kv_both")
    request = make_prefill_side_request(PROMPT_TOKENS, PREFIX_TOKENS)

    assert admit(scheduler, request) == (PREFIX_TOKENS - BLOCK_SIZE, BLOCK_SIZE)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_nixl_resume_point():
    """A remote prefill resumes where the prefiller's Mamba state belongs (the
    prompt less NIXL's back-off); NIXL loads nothing for a plain request, nor
    for a prefill instance's request without a pull from the decoder."""
    nixl = hybrid_connector([NIXL])
    remote = make_request(PROMPT_TOKENS, remote_prefill=True)
    plain = make_request(PROMPT_TOKENS, remote_prefill=False)

    assert nixl.get_divergent_hit_resume_point(remote) == PROMPT_TOKENS - 1
    assert nixl.get_divergent_hit_resume_point(plain) is None
    prefill_side = hybrid_connector([NIXL], kv_role="kv_both")
    assert (
        prefill_side.get_divergent_hit_resume_point(
            make_prefill_side_request(PROMPT_TOKENS)
        )
        is None
    )


def test_nixl_resume_point_for_pull_from_decoder():
    """The pull from the decoder ends at the decoder's tokens, where its Mamba
    state is; none is given where those reach the prompt, once the pull is
    registered, or without bidirectional KV transfer."""
    nixl = hybrid_connector([NIXL], kv_role="kv_both")
    request = make_prefill_side_request(PROMPT_TOKENS, DECODER_TOKENS)
    assert nixl.get_divergent_hit_resume_point(request) == DECODER_TOKENS

    # A pull of the whole prompt resumes the request before its last token,
    # not where the decoder's Mamba state is.
    for decoder_tokens in (PROMPT_TOKENS, PROMPT_TOKENS + BLOCK_SIZE):
        whole = make_prefill_side_request(PROMPT_TOKENS, decoder_tokens)
        assert nixl.get_divergent_hit_resume_point(whole) is None

    assert request.kv_transfer_params is not None
    request.kv_transfer_params["_remote_blocks_processed"] = True
    assert nixl.get_divergent_hit_resume_point(request) is None

    one_way = hybrid_connector([NIXL])
    request = make_prefill_side_request(PROMPT_TOKENS, DECODER_TOKENS)
    assert one_way.get_divergent_hit_resume_point(request) is None


@pytest.mark.parametrize(
    "bidirectional,use_host_buffer,processed,drop_key,block_ids",
    [
        (True, False, False, None, True),
        (False, False, False, None, True),
        (True, True, False, None, True),
        (True, False, True, None, True),
        (True, False, False, "remote_engine_id", True),
        (True, False, False, "remote_request_id", True),
        (True, False, False, "remote_host", True),
        (True, False, False, "remote_port", True),
        (True, False, False, None, False),
    ],
    ids=[
        "pull",
        "one-way",
        "host-buffer",
        "processed",
        "no-engine-id",
        "no-request-id",
        "no-host",
        "no-port",
        "no-block-ids",
    ],
)
def test_nixl_pull_from_decoder_resume_point_iff_pull_registered(
    bidirectional, use_host_buffer, processed, drop_key, block_ids
):
    """NIXL gives a point for a prefill instance's request exactly when
    update_state_after_alloc registers a pull of the decoder's blocks."""
    engine = create_hybrid_scheduler([NIXL], kv_role="kv_both")
    nixl = engine.connector
    assert nixl is not None
    scheduler = nixl.connector_scheduler
    assert scheduler is not None
    scheduler.is_bidirectional_kv_xfer_enabled = bidirectional
    scheduler.use_host_buffer = use_host_buffer
    request = make_prefill_side_request(PROMPT_TOKENS, DECODER_TOKENS)
    params = request.kv_transfer_params
    assert params is not None
    if processed:
        params["_remote_blocks_processed"] = True
    if drop_key is not None:
        del params[drop_key]
    if not block_ids:
        params["remote_block_ids"] = []

    point = nixl.get_divergent_hit_resume_point(request)
    blocks = engine.kv_cache_manager.empty_kv_cache_blocks
    scheduler.update_state_after_alloc(request, blocks, 0)

    registered = request.request_id in scheduler._reqs_need_recv
    assert registered == (
        bidirectional
        and not use_host_buffer
        and not processed
        and drop_key is None
        and block_ids
    )
    assert (point is not None) == registered


def test_nixl_prompt_embeds_remote_prefill_gets_no_point():
    """NIXL pulls nothing for a remote prefill given as prompt embeddings (the
    decoder recomputes it), so it gives no point."""
    nixl = hybrid_connector([NIXL])
    request = Request(
        request_id="embeds",
        prompt_token_ids=None,
        prompt_embeds=torch.zeros(PROMPT_TOKENS, 8),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
    )
    request.kv_transfer_params = make_request(
        PROMPT_TOKENS, remote_prefill=True
    ).kv_transfer_params

    assert nixl.get_divergent_hit_resume_point(request) is None
    assert nixl.get_num_new_matched_tokens(request, 0) == (0, False)


def test_nixl_push_resume_point():
    """In push mode the prefiller writes a remote prefill's blocks up to the
    prompt less NIXL's back-off, with the Mamba state there; push mode has no
    pull from the decoder, so a prefill instance's request gets no point."""
    push = hybrid_connector(["NixlPushConnector"])
    remote = make_request(PROMPT_TOKENS, remote_prefill=True)
    plain = make_request(PROMPT_TOKENS, remote_prefill=False)
    prefill_side = make_prefill_side_request(PROMPT_TOKENS, DECODER_TOKENS)

    assert push.get_divergent_hit_resume_point(remote) == PROMPT_TOKENS - 1
    assert push.get_divergent_hit_resume_point(plain) is None
    assert push.get_divergent_hit_resume_point(prefill_side) is None


@pytest.mark.parametrize("is_producer", [False, True])
def test_moriio_read_resume_point_only_for_remote_prefill(is_producer):
    """MoRIIO's READ path reads a consumer's remote prefill up to the prompt
    less the last token, with the recurrent state; it loads nothing for any
    other request."""
    moriio = importlib.import_module(
        "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"
    )
    scheduler = object.__new__(moriio.MoRIIOConnectorScheduler)
    scheduler.mode = moriio.MoRIIOMode.READ
    scheduler.is_producer = is_producer
    connector = object.__new__(moriio.MoRIIOConnector)
    connector.connector_scheduler = scheduler
    connector.mode = moriio.MoRIIOMode.READ
    connector._transfers_mamba_state = True
    assert connector.supports_divergent_local_hybrid_hits

    remote = make_request(PROMPT_TOKENS, remote_prefill=True)
    plain = make_request(PROMPT_TOKENS, remote_prefill=False)
    prefill_side = make_prefill_side_request(PROMPT_TOKENS)

    expected = None if is_producer else PROMPT_TOKENS - 1
    assert connector.get_divergent_hit_resume_point(remote) == expected
    assert connector.get_divergent_hit_resume_point(plain) is None
    assert connector.get_divergent_hit_resume_point(prefill_side) is None
    if expected is not None:
        # The read ends at the point for any local hit below it.
        for computed in (0, PREFIX_TOKENS, expected):
            matched, _ = scheduler.get_num_new_matched_tokens(remote, computed)
            assert computed + matched == expected


@pytest.mark.parametrize(
    "name,expected", [(DECODE_BENCH, None), (CAPABLE, PROMPT_TOKENS)]
)
def test_default_resume_point_follows_capability(name, expected):
    """A connector that does not override the method: no bound for a capable
    connector, no point for any other."""
    connector = hybrid_connector([name])
    request = make_request(PROMPT_TOKENS, remote_prefill=True)

    assert connector.get_divergent_hit_resume_point(request) == expected
