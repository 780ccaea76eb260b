# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""BlockStored events of a group that skips blocks (#44451).

Mamba groups in align mode cache only the block holding the state at the end
of a chunk (the blocks before it are null), and sliding-window groups mask
blocks out. Every BlockStored must stay dense: block_hashes[i] is the hash of
the i-th block_size chunk of token_ids, and parent_block_hash is the hash of
the block right before the first one.
"""

import pytest

import vllm.v1.core.kv_cache_utils as kv_cache_utils
from tests.v1.core.test_prefix_caching import make_request
from vllm.distributed.kv_events import BlockStored
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 4
NUM_BLOCKS = 6


def _cache_and_take_events(
    layout: str, block_mask: list[bool] | None = None, num_cached_blocks: int = 0
):
    """Cache the full blocks of a request from ``num_cached_blocks`` to
    NUM_BLOCKS in one call, with a null block wherever ``layout`` has "-" (a
    cached block: "x"), and return the request and the events published."""
    kv_cache_utils.init_none_hash(sha256)
    pool = BlockPool(
        num_gpu_blocks=16,
        enable_caching=True,
        hash_block_size=BLOCK_SIZE,
        enable_kv_cache_events=True,
    )
    req = make_request(
        "req",
        prompt_token_ids=list(range(100, 100 + NUM_BLOCKS * BLOCK_SIZE)),
        block_size=BLOCK_SIZE,
        hash_fn=sha256,
    )
    new_blocks = iter(pool.get_new_blocks(layout.count("x")))
    blocks = [next(new_blocks) if c == "x" else pool.null_block for c in layout]
    pool.cache_full_blocks(
        request=req,
        blocks=blocks,
        num_cached_blocks=num_cached_blocks,
        num_full_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        kv_cache_group_id=1,
        block_mask=block_mask,
    )
    events = pool.take_events()
    assert all(isinstance(event, BlockStored) for event in events)
    return req, events


def _expected(req, runs: list[tuple[int, int]]) -> list[tuple]:
    hashes = [kv_cache_utils.maybe_convert_block_hash(h) for h in req.block_hashes]
    return [
        (
            None if start == 0 else hashes[start - 1],
            hashes[start:end],
            req.all_token_ids[start * BLOCK_SIZE : end * BLOCK_SIZE],
        )
        for start, end in runs
    ]


def _shape(events) -> list[tuple]:
    return [(e.parent_block_hash, e.block_hashes, e.token_ids) for e in events]


@pytest.mark.parametrize(
    ("layout", "runs"),
    [
        # Mamba align mode: only the block where the chunk ended is cached.
        ("-----x", [(5, 6)]),
        # Several runs in one call (synthetic layouts), and a run from block 0.
        ("xx--x-", [(0, 2), (4, 5)]),
        ("-xx--x", [(1, 3), (5, 6)]),
        # No block skipped: one event, as before.
        ("xxxxxx", [(0, 6)]),
    ],
)
def test_block_stored_events_split_at_null_blocks(layout: str, runs):
    req, events = _cache_and_take_events(layout)

    assert _shape(events) == _expected(req, runs)
    for event in events:
        assert event.group_idx == 1
        assert event.block_size == BLOCK_SIZE
        assert len(event.token_ids) == len(event.block_hashes) * BLOCK_SIZE


def test_block_stored_events_split_at_masked_blocks():
    # A sliding-window group masks out blocks that can never serve a hit.
    req, events = _cache_and_take_events(
        "xxxxxx", block_mask=[True, False, False, True, True, False]
    )

    assert _shape(events) == _expected(req, [(0, 1), (3, 5)])


def test_block_stored_event_of_a_later_call_has_its_runs_parent():
    # A chunked prefill caches from num_cached_blocks on: the parent is the
    # block right before the run, not the one before the call's range.
    req, events = _cache_and_take_events("xx---x", num_cached_blocks=2)

    assert _shape(events) == _expected(req, [(5, 6)])


def test_no_block_stored_event_when_every_block_is_skipped():
    _, events = _cache_and_take_events("------")

    assert events == []
