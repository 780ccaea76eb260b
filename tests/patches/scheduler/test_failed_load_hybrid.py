"""A failed KV load of a hybrid model is never taken as a success (v0.20.2).

Patch: scheduler-mamba-external-kv. Under the hybrid allocator v0.20.2's NIXL
worker reported no invalid blocks for a failed transfer, so the request
finished its "load" and decoded from unwritten KV and Mamba state. Now NIXL
reports the request's blocks in every KV cache group, and the scheduler
recomputes from 0 whenever a group is not full attention (Mamba state cannot
be rewound; a sliding-window group may hold only null blocks below a shorter
prefix). In v0.32.0 and v0.33.0 upstream reports such failures per request
(failed_recving) and recomputes from 0 itself.
"""

import threading

import pytest
import torch

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import RequestStatus

from ..builders import (
    BLOCK_SIZE,
    prompt,
    remote_prefill_params,
    request,
    scheduler,
    step,
    vllm_config,
)

PATCH = "scheduler-mamba-external-kv"


class _Wrapper:
    """Stands in for the NIXL agent (a process/device boundary)."""

    def release_xfer_handle(self, handle):
        pass


class _Stats:
    def record_failed_transfer(self):
        pass


def _hma_worker(local_block_ids):
    """vLLM's NIXL worker with just the state its failure path reads, for a
    hybrid (several KV cache groups) request that is loading."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import (
        NixlConnectorWorker,
    )

    worker = object.__new__(NixlConnectorWorker)
    worker._is_hma_required = True
    worker._invalid_block_ids = set()
    worker._recving_metadata = {
        "req-hma": type("Meta", (), {"local_block_ids": local_block_ids})()
    }
    worker.nixl_wrapper = _Wrapper()
    worker.xfer_stats = _Stats()
    worker._failed_recv_reqs = set()
    worker._handshake_lock = threading.Lock()
    return worker


@pytest.mark.patch(PATCH)
@pytest.mark.vllm_versions("<0.23")
def test_nixl_reports_every_group_of_a_failed_hybrid_load():
    # One attention group and three Mamba groups, as in Qwen3.5.
    local_block_ids = ([1, 2, 3], [10], [11], [12])
    worker = _hma_worker(local_block_ids)

    worker._handle_failed_transfer("req-hma", handle=0)

    assert worker.get_block_ids_with_load_errors() == {1, 2, 3, 10, 11, 12}


def _sliding_window_config(num_blocks=1000):
    full = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    window = SlidingWindowSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32,
        sliding_window=2 * BLOCK_SIZE,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["attn.0"], full),
            KVCacheGroupSpec(["swa.0"], window),
        ],
    )


@pytest.mark.patch(PATCH)
@pytest.mark.vllm_versions("<0.23")
def test_failed_load_with_sliding_window_group_recomputes_from_zero():
    # Blocks below the window of a shorter prefix are null in the sliding-
    # window group: resuming from the first failed block would read them.
    config = vllm_config(
        kv_role="kv_both", mamba_cache_mode="none", kv_load_failure_policy="recompute"
    )
    sched = scheduler(config, _sliding_window_config())
    first = request(prompt(10 * BLOCK_SIZE), kv_transfer_params=remote_prefill_params(10))
    sched.add_request(first)
    step(sched)

    attention_blocks = sched.kv_cache_manager.get_block_ids(first.request_id)[0]
    step(sched, finished_recving={first.request_id},
         invalid_block_ids={attention_blocks[7]})
    output = step(sched)

    assert first.status == RequestStatus.RUNNING
    assert output.num_scheduled_tokens[first.request_id] == 10 * BLOCK_SIZE
