# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Divergent local hybrid hits behind a MultiConnector with a store child: the
real OffloadingConnector beside NIXL in both orders, a sliding-window group
whose local hit lags the full-attention hit, and NIXL's back-off with
multi-module MTP.

A decode instance caches every full-attention block of a prefix it received
from a prefiller, but no Mamba state inside it. A later request sharing the
prefix keeps the deeper full-attention hit only where the load that serves it
restores the Mamba groups at its end (NIXL's remote prefill, or an offloading
load that ends on a stored Mamba chunk), and, for a connector without
``supports_divergent_local_hybrid_hits``, only where no sliding-window group's
hit is shorter than it.
"""

import dataclasses
import functools

import pytest

from vllm import SamplingParams
from vllm.config import SpeculativeConfig
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiKVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.request import Request, RequestStatus

from .test_divergent_hit_resume_point import (
    BLOCK_SIZE,
    DECODE_BENCH,
    NIXL,
    NUM_BLOCKS,
    PREFIX_BLOCKS,
    PREFIX_TOKENS,
    PROMPT_TOKENS,
    admit,
    make_request,
    schedule_and_measure,
    seed_decode_side_prefix,
)
from .utils import (
    EOS_TOKEN_ID,
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
    make_kv_cache_config,
)

pytestmark = pytest.mark.cpu_test

OFFLOADING = "OffloadingConnector"
# The CPU tier's scheduler side only counts chunks.
OFFLOADING_EXTRA_CONFIG = {"cpu_bytes_to_use": 1 << 24}
# A window of two blocks: the sliding-window group's hit at the end of the
# prefix needs the prefix's last two blocks.
SLIDING_WINDOW = 2 * BLOCK_SIZE


def _child_config(name: str) -> dict:
    config: dict = {"kv_connector": name, "kv_role": "kv_consumer"}
    if name == OFFLOADING:
        config["kv_connector_extra_config"] = dict(OFFLOADING_EXTRA_CONFIG)
    return config


def create_decode_scheduler(
    connectors: list[str], sliding_window: bool = False
) -> Scheduler:
    """A decode instance of a full attention (+ sliding window) + Mamba
    ("align") model whose KV connector is ``connectors[0]``, or a
    MultiConnector of ``connectors`` in that order."""
    if len(connectors) == 1:
        kwargs: dict = _child_config(connectors[0])
    else:
        kwargs = {
            "kv_connector": "MultiConnector",
            "kv_connector_extra_config": {
                "connectors": [_child_config(name) for name in connectors]
            },
        }
    vllm_config = create_vllm_config(
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=1024,
        disable_hybrid_kv_cache_manager=False,
        **kwargs,
    )
    vllm_config.cache_config.mamba_cache_mode = "align"
    kv_cache_config = make_kv_cache_config(
        block_size=BLOCK_SIZE,
        swa_enabled=sliding_window,
        sw_size=SLIDING_WINDOW,
        mamba_enabled=True,
        mamba_cache_mode="align",
        num_blocks=NUM_BLOCKS,
    )
    return create_scheduler(
        vllm_config, num_blocks=NUM_BLOCKS, kv_cache_config=kv_cache_config
    )


# ---------------------------------------------------------------- Offloading


def _offloading_child_index(scheduler: Scheduler) -> int:
    connectors = scheduler.connector._connectors  # type: ignore[union-attr]
    [index] = [i for i, c in enumerate(connectors) if type(c).__name__ == OFFLOADING]
    return index


def _step(scheduler: Scheduler) -> None:
    """One engine step: one sampled token per scheduled request, and every
    transfer job handed to the OffloadingConnector's worker completed."""
    output = scheduler.schedule()
    index = _offloading_child_index(scheduler)
    metadata = output.kv_connector_metadata.metadata[index]  # type: ignore[union-attr]
    assert isinstance(metadata, OffloadingConnectorMetadata)
    jobs = {*metadata.store_jobs, *metadata.load_jobs}
    worker_meta = None
    if jobs:
        completed = OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(jobs, 1))
        num_children = len(scheduler.connector._connectors)  # type: ignore[union-attr]
        worker_meta = MultiKVConnectorWorkerMetadata(
            metadata=tuple(
                completed if i == index else None for i in range(num_children)
            )
        )
    reqs = [scheduler.requests[req_id] for req_id in output.num_scheduled_tokens]
    scheduler.update_from_output(
        output, create_model_runner_output(reqs, kv_connector_worker_meta=worker_meta)
    )


def store_through_offloading(scheduler: Scheduler, prompt_token_ids: list[int]):
    """Compute a plain request of ``prompt_token_ids`` on the instance, so that
    the OffloadingConnector stores its blocks and Mamba states through its own
    store path (align mode keeps the Mamba state at the last block boundary
    before the prompt's last token), then drop the instance's prefix cache
    (as memory pressure would): the CPU tier alone holds them."""
    sampling_params = SamplingParams(max_tokens=1)
    sampling_params.update_from_generation_config({}, EOS_TOKEN_ID)
    request = Request(
        request_id="stored",
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=sampling_params,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
    scheduler.add_request(request)
    for _ in range(8):
        _step(scheduler)
    assert request.is_finished()
    assert not scheduler.requests
    assert scheduler.reset_prefix_cache()


OFFLOADING_SETS = pytest.mark.parametrize(
    "connectors",
    [[NIXL, OFFLOADING], [OFFLOADING, NIXL]],
    ids=["nixl+offloading", "offloading+nixl"],
)


@OFFLOADING_SETS
def test_offloading_remote_prefill_keeps_local_hit_and_loads_the_rest(connectors):
    """Nothing stored for the prompt: in either order NIXL serves the remote
    prefill, the cached prefix comes from the local cache and NIXL loads the
    rest with the Mamba state at its end."""
    scheduler = create_decode_scheduler(connectors)
    request = make_request(PROMPT_TOKENS, remote_prefill=True)

    num_local, num_external = admit(scheduler, request)

    assert num_local == PREFIX_TOKENS
    assert num_local + num_external == PROMPT_TOKENS - 1
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS


@pytest.mark.parametrize("stored", [False, True], ids=["empty-store", "stored"])
@OFFLOADING_SETS
def test_offloading_plain_request_keeps_agreed_hit(connectors, stored):
    """NIXL loads nothing for a plain request, so no child gives a resume
    point: it starts at the hit every group agrees on (none here). With the
    prompt's blocks stored, the OffloadingConnector loads them from there,
    up to its stored Mamba chunk."""
    scheduler = create_decode_scheduler(connectors)
    request = make_request(PROMPT_TOKENS + BLOCK_SIZE, remote_prefill=False)
    if stored:
        store_through_offloading(
            scheduler, request.prompt_token_ids[: PROMPT_TOKENS + 1]
        )

    num_local, num_external = admit(scheduler, request)

    assert num_local == 0
    assert num_external == (PROMPT_TOKENS if stored else 0)


@OFFLOADING_SETS
def test_offloading_stored_prompt_keeps_local_hit(connectors):
    """The CPU tier holds the prompt's blocks up to two blocks past the cached
    prefix, with the Mamba state there. First in the order, the
    OffloadingConnector matches and loads from the local hit to its stored
    Mamba chunk, which restores the Mamba groups, so the hit is kept; second,
    NIXL matches first and loads up to the prefiller's end."""
    scheduler = create_decode_scheduler(connectors)
    request = make_request(PROMPT_TOKENS + BLOCK_SIZE, remote_prefill=True)
    store_through_offloading(scheduler, request.prompt_token_ids[: PROMPT_TOKENS + 1])

    num_local, num_external = admit(scheduler, request)

    assert num_local == PREFIX_TOKENS
    if connectors[0] == OFFLOADING:
        assert num_local + num_external == PROMPT_TOKENS
        offloading = scheduler.connector._connectors[0]  # type: ignore[union-attr]
        mamba_group_ids = {
            group_id
            for group_id, group in enumerate(scheduler.kv_cache_config.kv_cache_groups)
            if isinstance(group.kv_cache_spec, MambaSpec)
        }
        assert mamba_group_ids <= set(offloading.get_loaded_kv_cache_group_ids(request))
    else:
        assert num_local + num_external == request.num_tokens - 1
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS


# ------------------------------------------------------ sliding-window lag


def seed_decode_side_prefix_with_window(
    scheduler: Scheduler, window_evicted: bool
) -> None:
    """Cache the prefix as a decode instance holds it after a transfer: every
    full-attention block, the sliding-window group's blocks (with
    ``window_evicted``, its last two, inside the window at the end of the
    prefix, evicted) and no Mamba state inside the prefix."""
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
        _, _, group_mamba_ids = manager.get_block_ids(fill.request_id)
        mamba_block_ids.append(group_mamba_ids[i])
    _, window_block_ids, _ = manager.get_block_ids(fill.request_id)
    evicted = set(mamba_block_ids)
    if window_evicted:
        evicted |= set(window_block_ids[-(SLIDING_WINDOW // BLOCK_SIZE) :])
    manager.free(fill)
    manager.block_pool.evict_blocks(evicted)


def admit_with_window(
    scheduler: Scheduler, request: Request, window_evicted: bool
) -> tuple[int, int]:
    seed_decode_side_prefix_with_window(scheduler, window_evicted)
    coordinator = scheduler.kv_cache_manager.coordinator
    assert isinstance(coordinator, HybridKVCacheCoordinator)
    _, per_group_hits = coordinator.find_longest_cache_hit_per_group(
        request.block_hashes, request.num_tokens - 1
    )
    # (full attention, sliding window, Mamba): the hit diverges, and with the
    # window's blocks evicted the sliding-window group lags full attention.
    window_hit = PREFIX_TOKENS - SLIDING_WINDOW if window_evicted else PREFIX_TOKENS
    assert per_group_hits == (PREFIX_TOKENS, window_hit, 0)
    scheduler.add_request(request)
    return schedule_and_measure(scheduler, request)


@pytest.mark.parametrize(
    "connectors,window_evicted,expected",
    [
        ([NIXL, DECODE_BENCH], False, (PREFIX_TOKENS, PROMPT_TOKENS - 1)),
        ([NIXL, DECODE_BENCH], True, (0, PROMPT_TOKENS - 1)),
        ([NIXL], True, (PREFIX_TOKENS, PROMPT_TOKENS - 1)),
    ],
    ids=[
        "nixl+decodebench-window-cached",
        "nixl+decodebench-window-evicted",
        "nixl-window-evicted",
    ],
)
def test_lagging_window_group_takes_agreed_hit_without_capability(
    connectors, window_evicted, expected
):
    """A sliding-window group whose hit is shorter than the full-attention hit
    needs its own blocks below that hit, inside its window. NIXL transfers the
    request's own blocks and writes them (the capability), so with NIXL alone
    the hit is kept; a MultiConnector whose other child lacks the capability
    might be served by a store that loads only past the hit, so there the
    request takes the hit every group agrees on before the query, and NIXL
    loads from there. With the window's blocks cached the hit is kept."""
    scheduler = create_decode_scheduler(connectors, sliding_window=True)
    request = make_request(PROMPT_TOKENS, remote_prefill=True)

    num_local, num_external = admit_with_window(scheduler, request, window_evicted)

    assert (num_local, num_local + num_external) == expected
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS


# ----------------------------------------------------- multi-module MTP


NUM_MTP_MODULES = 3
# NIXL's prefiller stops short of multi-module MTP's lookahead window (the
# drafter reads num_speculative_tokens prompt tokens ahead): the decoder
# recomputes num_speculative_tokens - 1 prompt tokens.
MTP_BACKOFF = NUM_MTP_MODULES - 1


def _mtp_modules(hf_config):
    # A callable override reaches the draft's config too, so both declare the
    # MTP modules.
    hf_config.update({"num_nextn_predict_layers": NUM_MTP_MODULES})
    return hf_config


@functools.cache
def _mtp_vllm_config_kwargs() -> dict:
    """The target and MTP draft of a hybrid (Gated DeltaNet + full attention)
    model with NUM_MTP_MODULES MTP modules, built once (vLLM inspects the
    model classes the first time)."""
    vllm_config = create_vllm_config(
        model="Qwen/Qwen3-Next-80B-A3B-Instruct",
        hf_overrides=_mtp_modules,
        block_size=BLOCK_SIZE,
    )
    speculative_config = SpeculativeConfig(
        method="mtp",
        num_speculative_tokens=NUM_MTP_MODULES,
        target_model_config=vllm_config.model_config,
        target_parallel_config=vllm_config.parallel_config,
    )
    assert speculative_config.use_multi_module_mtp()
    return {
        "model_config": vllm_config.model_config,
        "speculative_config": speculative_config,
    }


def create_mtp_decode_scheduler(connectors: list[str]) -> Scheduler:
    """create_decode_scheduler's instance, serving a model with multi-module
    MTP."""
    scheduler = create_decode_scheduler(connectors)
    vllm_config = dataclasses.replace(
        scheduler.vllm_config, **_mtp_vllm_config_kwargs()
    )
    assert vllm_config.num_prefill_lookahead_tokens == NUM_MTP_MODULES
    return create_scheduler(
        vllm_config,
        num_blocks=NUM_BLOCKS,
        kv_cache_config=scheduler.kv_cache_config,
    )


@pytest.mark.parametrize(
    "connectors", [[NIXL], [NIXL, DECODE_BENCH]], ids=["nixl", "nixl+decodebench"]
)
def test_mtp_remote_prefill_resumes_at_nixl_backoff(connectors):
    """With multi-module MTP, NIXL's remote prefill resumes at the prompt less
    its back-off, where the prefiller's Mamba state belongs: the divergent
    local hit (full attention, which MTP's lookahead and its dropped last
    block keep short of the prefix) stays below that point and NIXL loads the
    rest, also with a child beside NIXL that cannot complete such a hit."""
    scheduler = create_mtp_decode_scheduler(connectors)
    request = make_request(PROMPT_TOKENS, remote_prefill=True)
    seed_decode_side_prefix(scheduler)
    coordinator = scheduler.kv_cache_manager.coordinator
    assert isinstance(coordinator, HybridKVCacheCoordinator)
    _, (attention_hit, mamba_hit) = coordinator.find_longest_cache_hit_per_group(
        request.block_hashes, request.num_tokens - 1
    )
    assert attention_hit > mamba_hit == 0
    scheduler.add_request(request)

    num_local, num_external = schedule_and_measure(scheduler, request)

    assert num_local == attention_hit
    assert num_local + num_external == PROMPT_TOKENS - MTP_BACKOFF
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
