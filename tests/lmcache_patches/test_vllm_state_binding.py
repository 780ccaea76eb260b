"""The Mamba state LMCache stores and loads on CPU is the one vLLM computes with.

Patch: cpu-shm-vllm-state-binding. On CPU, registration moves vLLM's KV cache
storage into a POSIX shared-memory segment and re-points only the tensors it is
handed. vLLM's Mamba layers compute with their own conv/ssm views of that storage
(made by ``MambaBase.bind_kv_cache`` before the connector registers), and LMCache is
handed new page views: on stock, LMCache stores and loads a state vLLM never writes or
reads. Measured end to end on vLLM 0.32.0 (CONTEXT §6): a repeat prompt's 512-token
LMCache hit gave wrong greedy tokens from the first one, with no error.

Asserted here on vLLM's own views (deployment.py): a state the model wrote into its
block is what LMCache stores, and what LMCache loads into another block is what the
model reads there. Attention KV, which LMCache is handed as vLLM's own tensor, is
shared on stock too (a guard, no patch named).
"""

import pytest
import torch

from lmcache_patches import deployment

SRC = [[1, 2], [3, 4], [6, 7], [8, 9]]  # per KV cache group: 3 Mamba, then attention
DST = [[10, 11], [12, 13], [14, 15], [16, 17]]
TOKENS = list(range(1, 2 * deployment.BLOCK + 1))


def _worker(server):
    # Allocated outside the connector's memory pool context, as vLLM releases whose
    # CPU worker does not ask the connector allocate it (0.20.2): registration then
    # moves the KV cache (cpu-shm-kv-cache-allocation covers the others).
    worker = deployment.allocate_worker(
        deployment.vllm_config(server.port), pool_context=False
    )
    deployment.register(worker, server)
    return worker


@pytest.mark.patch("cpu-shm-vllm-state-binding")
def test_model_reads_the_state_lmcache_loads(server):
    worker = _worker(server)
    written = worker.write_state(SRC, chunk=1, seed=1)
    assert server.store(TOKENS, SRC) == [True, True]
    assert server.lookup(TOKENS, "load") == 2
    assert server.retrieve(TOKENS, DST, "load")
    read = worker.read_state(DST, chunk=1)
    assert all(torch.equal(w, r) for w, r in zip(written, read)), (
        "the model reads a state other than the one it wrote before the store"
    )


def test_attention_kv_is_shared(server):
    worker = _worker(server)
    attn = next(n for n in worker.layers if n not in worker.mamba_layers)
    group = worker.group_of(attn)
    kv = worker.layers[attn].kv_cache
    for block in SRC[group]:
        kv[block].copy_(torch.randn(kv[block].shape).to(kv.dtype))
    assert server.store(TOKENS, SRC) == [True, True]
    assert server.lookup(TOKENS, "load") == 2
    assert server.retrieve(TOKENS, DST, "load")
    for a, b in zip(SRC[group], DST[group]):
        assert torch.equal(kv[a], kv[b])
