"""Memory another connector registered before LMCache stays the KV cache (known issue).

``MultiConnector[NixlConnector, LMCacheMPConnector]`` registers the KV cache with NIXL
first. On a CPU engine NIXL registers the tensors' memory itself (``kv_buffer_device:
cpu``, ``use_host_buffer: False``), and then LMCache's CPU registration copies that
storage into a new POSIX shared-memory segment and re-points vLLM's tensors at it. NIXL
keeps transferring into the old memory, which the model no longer reads: measured in
the CPU e2e (v0.32.0, ``--connector nixl+lmcache``), every remote prefill decoded
garbage from its first token while LMCache-served plain requests were right. With
LMCache first (``lmcache+nixl``) NIXL registers the shared memory and PD is right.

The fix belongs in LMCache's CPU registration: share the pages vLLM already has instead
of moving the KV cache (for example by mapping the segment over the storage's own
pages). Until a patch does, this is a strict xfail: it turns red when one does, and the
test then names that patch.
"""

import pytest

from lmcache_patches import deployment


@pytest.mark.xfail(strict=True, reason="LMCache's CPU registration moves the KV cache")
def test_memory_registered_before_lmcache_stays_the_kv_cache(server):
    worker = deployment.allocate_worker(deployment.vllm_config(server.port))
    registered = {name: kv.data_ptr() for name, kv in worker.kv_caches.items()}  # NIXL's view
    deployment.register(worker, server)
    moved = [n for n, kv in worker.kv_caches.items() if kv.data_ptr() != registered[n]]
    assert not moved, f"LMCache moved the KV cache of {moved} away from registered memory"
