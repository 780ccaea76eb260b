"""LMCache's CPU path takes a vLLM hybrid worker's KV cache at all.

Patches: cpu-hybrid-kv-views (strided Mamba views through shared memory and the
server's non-CUDA copy kernel) and cpu-hybrid-transfer-mode (``auto`` does not pick a
transfer mode that refuses several KV groups). Measured on stock lmcache 0.5.6 with
vLLM 0.32.0's CPU worker (CONTEXT §6): vLLM does not start. The default mode refuses
"multiple KV transfer groups"; the shared-memory mode refuses the padded Mamba pages
("requires a contiguous tensor"), and past that the server's copy kernel refuses their
block stride.

The worker here is vLLM's own allocation and binding of a Qwen3.5-like layout
(deployment.py); the server and the connector are the tree's own.
"""

import pytest
import torch

from lmcache_patches import deployment

STRIDED = "cpu-hybrid-kv-views"
AUTO_MODE = "cpu-hybrid-transfer-mode"


def _registered_views(worker):
    """The tensors LMCache registered for each layer (its edited views)."""
    return worker.connector.worker_adapter.kv_caches


@pytest.mark.patch(STRIDED)
def test_padded_mamba_pages_round_trip(server):
    worker = deployment.allocate_worker(deployment.vllm_config(server.port))
    mamba = worker.mamba_layers[0]
    page = worker.kv_caches[mamba]
    assert not page.is_contiguous(), "vLLM pads each Mamba page: a strided view"
    deployment.register(worker, server)  # stock: "requires a contiguous tensor"

    views = _registered_views(worker)
    src = [[1, 2], [3, 4], [6, 7], [8, 9]]
    dst = [[10, 11], [12, 13], [14, 15], [16, 17]]
    gen = torch.Generator().manual_seed(0)
    for name, view in views.items():
        for block in src[worker.group_of(name)]:
            view[block].copy_(torch.randint(-100, 100, view[block].shape, generator=gen))
    tokens = list(range(1, 2 * deployment.BLOCK + 1))
    assert server.store(tokens, src) == [True, True]
    assert server.lookup(tokens, "rt") == 2
    assert server.retrieve(tokens, dst, "rt")
    for name, view in views.items():
        group = worker.group_of(name)
        for a, b in zip(src[group], dst[group]):
            assert torch.equal(view[a], view[b]), f"{name}: block {a} -> {b}"


@pytest.mark.patch(AUTO_MODE)
def test_default_transfer_mode_registers_a_hybrid_worker(server):
    config = deployment.vllm_config(server.port)
    del config.kv_transfer_config.kv_connector_extra_config["lmcache.mp.mp_transfer_mode"]
    worker = deployment.allocate_worker(config)
    # stock: "engine-driven transfer does not support multiple KV transfer groups now"
    deployment.register(worker, server)
    assert len(worker.kv_cache_config.kv_cache_groups) == 4
    assert type(worker.connector.worker_adapter.transfer_ctx).__name__ == (
        "LMCacheDrivenTransferContext"
    )
