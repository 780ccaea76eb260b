"""MultiConnector works with the hybrid memory allocator.

Patch: multi-connector-hma. A common hybrid PD set-up combines NIXL (PD
transfer) with LMCache (KV reuse) in one MultiConnector.
"""

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
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
from ..lmcache.fake_engine import install

PATCH = "multi-connector-hma"


def _multi_config(*children: str):
    return vllm_config(
        kv_role="kv_both",
        kv_connector="MultiConnector",
        kv_connector_extra_config={
            "connectors": [
                {"kv_connector": name, "kv_role": "kv_both"} for name in children
            ]
        },
    )


@pytest.mark.patch(PATCH)
def test_finished_request_reaches_every_child_with_all_groups(monkeypatch):
    engine_cls = install(monkeypatch)
    sched = scheduler(_multi_config("NixlConnector", "LMCacheConnectorV1"))
    req = request(prompt(4 * BLOCK_SIZE), max_tokens=2)
    sched.add_request(req)

    while req.status != RequestStatus.FINISHED_LENGTH_CAPPED:
        step(sched)

    # The LMCache child got the attention group's blocks of the request.
    (engine,) = engine_cls.instances
    ((req_id, block_ids),) = engine.finished
    assert req_id == req.request_id
    assert len(block_ids) >= 4 and 0 not in block_ids


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
