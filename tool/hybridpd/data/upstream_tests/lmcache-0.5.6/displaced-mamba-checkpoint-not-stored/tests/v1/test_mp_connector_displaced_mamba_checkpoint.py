# SPDX-License-Identifier: Apache-2.0
"""An interior Mamba checkpoint that is not its column's end state is not stored."""

# Standard
from types import SimpleNamespace

# Third Party
import pytest

pytest.importorskip("vllm", reason="MP connector imports vLLM at module top")

# Third Party
from vllm.v1.utils import ConstantList  # noqa: E402

# First Party
from lmcache.integration.vllm.lmcache_mp_connector import (  # noqa: E402
    LMCacheMPConnector,
    get_displaced_mamba_checkpoint_column,
    get_mamba_prefill_checkpoint_position,
)
from lmcache.integration.vllm.lmcache_mp_metadata import (  # noqa: E402
    LMCacheMPRequestMetadata,
    LMCacheMPRequestTracker,
)

if get_mamba_prefill_checkpoint_position is None:
    pytest.skip(
        "vLLM without interior Mamba prefill checkpoints", allow_module_level=True
    )

BLOCK = 256
ATTN, MAMBA = 0, 1


def _column(query_start: int, query_end: int, drop_eagle_block: bool = True):
    return get_displaced_mamba_checkpoint_column(
        query_start=query_start,
        query_end=query_end,
        mamba_block_size=BLOCK,
        hash_block_size=BLOCK,
        cache_hit_alignment_tokens=BLOCK,
        checkpoint_alignment=BLOCK,
        drop_eagle_block=drop_eagle_block,
    )


@pytest.mark.parametrize(
    ("query_start", "query_end", "drop_eagle_block", "column"),
    [
        # MTP: the checkpoint at 512 goes to column 2, which ends at 768.
        (0, 1000, True, 2),
        # Whole blocks: the checkpoint at 768 is column 2's end.
        (0, 1024, True, None),
        # Without an EAGLE-style drafter the checkpoint is at its column's end.
        (0, 1000, False, None),
        # A step too short for an interior checkpoint.
        (512, 1000, True, None),
    ],
)
def test_displaced_column(query_start, query_end, drop_eagle_block, column):
    assert _column(query_start, query_end, drop_eagle_block) == column


def test_no_checkpoint_without_alignment():
    assert (
        get_displaced_mamba_checkpoint_column(
            query_start=0,
            query_end=1000,
            mamba_block_size=BLOCK,
            hash_block_size=BLOCK,
            cache_hit_alignment_tokens=BLOCK,
            checkpoint_alignment=None,
            drop_eagle_block=True,
        )
        is None
    )


def _tracker(num_tokens: int) -> LMCacheMPRequestTracker:
    request = SimpleNamespace(
        request_id="req-0",
        cache_salt="",
        prompt_token_ids=list(range(num_tokens)),
        all_token_ids=ConstantList(list(range(num_tokens))),
        num_prompt_tokens=num_tokens,
        mm_features=[],
        sampling_params=SimpleNamespace(extra_args=None),
    )
    return LMCacheMPRequestTracker(request)


def _connector() -> LMCacheMPConnector:
    connector = LMCacheMPConnector.__new__(LMCacheMPConnector)
    connector._mamba_checkpoint_groups = [(MAMBA, BLOCK, BLOCK)]
    connector._hash_block_size = BLOCK
    connector._cache_hit_alignment_tokens = BLOCK
    connector._drop_eagle_block = True
    return connector


@pytest.mark.parametrize(
    ("num_tokens", "mamba_blocks"),
    [(1000, [0, 0, 0]), (1024, [0, 0, 12, 13])],
)
def test_store_skips_displaced_checkpoint(num_tokens, mamba_blocks):
    """One MTP prefill step: columns 0-1 null, column 2 the checkpoint, the
    final state after it, one speculative block."""
    tracker = _tracker(num_tokens)
    tracker.append_block_ids(([50, 51, 52, 53], [0, 0, 12, 13, 14]), 1)
    tracker.increase_num_scheduled_tokens(num_tokens)
    _connector()._null_displaced_mamba_checkpoint(tracker, 0, num_tokens)
    meta = LMCacheMPRequestMetadata.GetStoreMetadata(tracker, BLOCK, [BLOCK, BLOCK])
    assert meta is not None
    assert meta.op.block_ids[MAMBA] == mamba_blocks
