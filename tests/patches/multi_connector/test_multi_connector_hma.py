"""MultiConnector works with the hybrid memory allocator.

Patch: multi-connector-hma. A common hybrid PD set-up combines NIXL (PD
transfer) with a KV reuse connector (an offloading connector) in one
MultiConnector.
"""

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.v1.request import RequestStatus

from ..builders import (
    BLOCK_SIZE,
    hybrid_kv_cache_config,
    prompt,
    request,
    scheduler,
    step,
    vllm_config,
)
PATCH = "multi-connector-hma"


class HMARecorder(ExampleConnector, SupportsHMA):
    """A second child that supports the hybrid allocator (vLLM's example
    connector, which finds nothing to load) and records the block ids it is
    handed when a request finishes."""

    finished: list = []

    def request_finished_all_groups(self, request, block_ids):
        type(self).finished.append((request.request_id, block_ids))
        return False, None


def _child(name: str) -> dict:
    if name == "HMARecorder":
        return {
            "kv_connector": name,
            "kv_connector_module_path": __name__,
            "kv_role": "kv_both",
        }
    return {"kv_connector": name, "kv_role": "kv_both"}


def _multi_config(*children: str):
    # As a server started with --no-disable-hybrid-kv-cache-manager (v0.20.2 turns
    # the hybrid allocator off for every connector unless asked not to).
    return vllm_config(
        kv_role="kv_both",
        kv_connector="MultiConnector",
        kv_connector_extra_config={"connectors": [_child(n) for n in children]},
        hybrid_kv_cache_manager=True,
    )


@pytest.mark.patch(PATCH)
def test_finished_request_reaches_every_child_with_all_groups(monkeypatch):
    monkeypatch.setattr(HMARecorder, "finished", [])
    nixl_finished = []
    NixlConnector = KVConnectorFactory.get_connector_class_by_name("NixlConnector")
    nixl_request_finished = NixlConnector.request_finished_all_groups

    def record_nixl(self, request, block_ids):
        nixl_finished.append((request.request_id, block_ids))
        return nixl_request_finished(self, request, block_ids)

    monkeypatch.setattr(NixlConnector, "request_finished_all_groups", record_nixl)
    kv_cache_config = hybrid_kv_cache_config()
    sched = scheduler(_multi_config("NixlConnector", "HMARecorder"), kv_cache_config)
    req = request(prompt(4 * BLOCK_SIZE), max_tokens=2)
    sched.add_request(req)

    while req.status != RequestStatus.FINISHED_LENGTH_CAPPED:
        step(sched)

    # Each child got the request's blocks of every KV cache group.
    ((req_id, block_ids),) = HMARecorder.finished
    assert req_id == req.request_id
    assert len(block_ids) == len(kv_cache_config.kv_cache_groups)
    attention_blocks = block_ids[0]
    assert len(attention_blocks) >= 4 and 0 not in attention_blocks
    assert nixl_finished == [(req_id, block_ids)]


@pytest.mark.patch(PATCH)
@pytest.mark.vllm_versions("<0.21")
def test_child_without_hma_is_rejected_when_hma_is_enabled():
    # DecodeBenchConnector supports HMA itself from v0.21 on.
    config = _multi_config("NixlConnector", "DecodeBenchConnector")
    # As on a GPU platform started with --no-disable-hybrid-kv-cache-manager
    # (the CPU platform turns the hybrid allocator off at config time).
    config.scheduler_config.disable_hybrid_kv_cache_manager = False

    with pytest.raises(ValueError, match="DecodeBenchConnector does not support HMA"):
        MultiConnector(config, KVConnectorRole.SCHEDULER, hybrid_kv_cache_config())
