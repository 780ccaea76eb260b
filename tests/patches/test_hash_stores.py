"""The LMCache stand-in stores what LMCache would, from the real connector.

:class:`hash_stores.LMCacheWorker` stores the STORE operations that lmcache's
real ``LMCacheMPConnector`` scheduler side hands its worker, at the step that
hands them, with the object groups LMCache documents for hybrid models: a chunk
whose last Mamba block is vLLM's null block (a column inside a prefill step that
spans several blocks) gets no Mamba object (LMCache with
``null-recurrent-slot-not-stored``), so no hit ends there. Not a patch test: it
holds the stand-in the bench and the property test use to what it models.
"""

import pytest

from .builders import (
    BLOCK_SIZE,
    connectors,
    hybrid_kv_cache_config,
    model_runner_output,
    prompt,
    request,
    scheduler,
    vllm_config,
)
from .hash_stores import (
    FakeLMCacheServer,
    LMCacheWorker,
    lmcache_adapter_stub,
    lmcache_mp_unavailable,
)

pytestmark = pytest.mark.vllm_versions(">=0.32")


def _step(sched, worker):
    output = sched.schedule()
    reqs = [sched.requests[rid] for rid in output.num_scheduled_tokens]
    result = model_runner_output(reqs)
    worker.report(output, result)
    sched.update_from_output(output, result)


def test_one_step_prefill_stores_a_mamba_object_only_at_its_end():
    reason = lmcache_mp_unavailable()
    if reason is not None:
        pytest.skip(reason)
    server = FakeLMCacheServer(BLOCK_SIZE)
    config = vllm_config(**connectors("lmcachemp+nixl", "kv_both"))
    with lmcache_adapter_stub(server):
        sched = scheduler(config, hybrid_kv_cache_config())
    worker = LMCacheWorker(sched, server)
    tokens = prompt(3 * BLOCK_SIZE + 1, seed=31)
    req = request(tokens, max_tokens=4)
    sched.add_request(req)

    _step(sched, worker)  # its three whole blocks in one step (align mode)

    # Stored at the step that computed them, before the request finished.
    assert req.num_computed_tokens == 3 * BLOCK_SIZE and not req.is_finished()
    assert all(server.holds(tokens, e) is (e == 3 * BLOCK_SIZE)
               for e in (BLOCK_SIZE, 2 * BLOCK_SIZE, 3 * BLOCK_SIZE))
    # A prompt sharing only the first two chunks gets no hit; one sharing the
    # three gets them, the Mamba state at their end included.
    assert server.lookup(tokens[: 2 * BLOCK_SIZE] + [1] * BLOCK_SIZE, 3 * BLOCK_SIZE) == 0
    assert server.lookup(tokens, 3 * BLOCK_SIZE) == 3 * BLOCK_SIZE
