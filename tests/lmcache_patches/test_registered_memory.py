"""Memory another connector registered before LMCache stays the KV cache the model reads.

Patch: cpu-shm-kv-cache-allocation. ``MultiConnector[NixlConnector,
LMCacheMPConnector]`` registers the KV cache with NIXL first. On a CPU engine NIXL
registers the tensors' memory itself (``kv_buffer_device: cpu``, ``use_host_buffer:
False``). On stock, LMCache's CPU registration then copies that storage into a new POSIX
shared-memory segment and re-points vLLM's tensors at it, and NIXL keeps transferring
into the old memory: measured in the CPU e2e (v0.32.0, ``--connector nixl+lmcache``),
every remote prefill decoded garbage from its first token, while LMCache-served plain
requests were right. Patched, the connector gives vLLM's worker a memory pool context
(``get_mem_pool_context``, which vLLM 0.32's CPU worker allocates the KV cache in) that
allocates it in shared memory, and registration shares it in place.

Asserted on vLLM's own allocation and views (deployment.py): the addresses NIXL
registered are still the KV cache after LMCache registers, and a Mamba state written
there (a NIXL read of a remote prefill's state) is what the model reads.
"""

import pytest
import torch

from lmcache_patches import deployment

BLOCKS = [[1, 2], [3, 4], [6, 7], [8, 9]]  # per KV cache group: 3 Mamba, then attention


@pytest.mark.patch("cpu-shm-kv-cache-allocation")
def test_memory_registered_before_lmcache_stays_the_kv_cache(server):
    worker = deployment.allocate_worker(deployment.vllm_config(server.port))
    # What NIXL holds after registering first: the KV cache's addresses, i.e. views of
    # the memory as allocated (tensors of their own, which LMCache does not re-point).
    registered = {name: kv.data_ptr() for name, kv in worker.kv_caches.items()}
    nixl_views = {
        name: [state.detach() for state in worker.layers[name].kv_cache]
        for name in worker.mamba_layers
    }
    deployment.register(worker, server)

    moved = [n for n, kv in worker.kv_caches.items() if kv.data_ptr() != registered[n]]
    assert not moved, f"LMCache moved the KV cache of {moved} away from registered memory"
    gen = torch.Generator().manual_seed(3)
    for name, states in nixl_views.items():
        block = BLOCKS[worker.group_of(name)][1]
        for nixl_state, model_state in zip(states, worker.layers[name].kv_cache):
            value = torch.randn(nixl_state[block].shape, generator=gen).to(nixl_state.dtype)
            nixl_state[block].copy_(value)  # a remote prefill's state, written by NIXL
            assert torch.equal(model_state[block], value), (
                f"{name}: the model does not read the state written at the memory "
                "NIXL registered"
            )
