"""LMCacheConnectorV1 on a hybrid model, driven through LMCache's real vLLM adapter.

PROTOTYPE (issue 10): lmcache 0.5.6 comes from the test environment's lmcache layer
(``hybridpd.testenv.LAYERS``). Red on patched v0.32.0 until the gate is fixed. Only what needs a GPU below the adapter is faked: LMCache's compiled
device ops, and the LMCacheManager (engine, lookup client: a fake that answers
lookups).
"""

import sys
import types

import pytest

from ..builders import BLOCK_SIZE, hybrid_kv_cache_config, prompt, request, scheduler, vllm_config
from ..mamba_state import MambaStateChecker, checked_step


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *a, **k: None


def _adapter():
    for name in ("lmcache.device_ops", "lmcache.c_ops"):
        sys.modules.setdefault(name, _Stub(name))
    import lmcache

    lmcache.device_ops = sys.modules["lmcache.device_ops"]
    lmcache.c_ops = sys.modules["lmcache.c_ops"]
    from lmcache.integration.vllm import vllm_v1_adapter

    return vllm_v1_adapter


class _LookupClient:
    """LMCache holds every request's prompt up to ``hit`` tokens."""

    def __init__(self, hit):
        self.hit = hit
        self.lookups = []

    def lookup(self, token_ids, lookup_id, request_configs=None):
        self.lookups.append(lookup_id)
        return min(self.hit, len(token_ids))

    def lookup_cache(self, lookup_id):
        return -1

    def clear_lookup_status(self, lookup_id):
        pass

    def cancel_lookup(self, lookup_id):
        pass


def _fake_manager(hit):
    class _Manager:
        def __init__(self, config, service_factory, connector):
            self.lookup_client = _LookupClient(hit)
            self.lmcache_engine = None
            self.lmcache_engine_metadata = None
            self.lookup_server = None

        def start_services(self):
            pass

        def post_init(self):
            pass

        def shutdown(self):
            pass

    return _Manager


@pytest.mark.patch("lmcache-connector-hma")
@pytest.mark.vllm_versions(">=0.23")  # where the lmcache layer is (testenv.LAYERS)
def test_preempted_request_on_a_hybrid_model_resumes(monkeypatch):
    adapter = _adapter()
    monkeypatch.setattr(adapter, "LMCacheManager", _fake_manager(hit=0))
    sched = scheduler(
        vllm_config(kv_connector="LMCacheConnectorV1", kv_role="kv_both"),
        hybrid_kv_cache_config(num_blocks=48),
    )
    checker = MambaStateChecker(sched)
    reqs = [request(prompt(6 * BLOCK_SIZE, seed=10 + i), max_tokens=40) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    preempted = False
    for _ in range(400):
        checked_step(sched, checker)
        preempted |= any(r.num_preemptions > 0 for r in reqs)
        if all(r.is_finished() for r in reqs):
            break
    assert preempted, "the pool was not small enough to preempt"
    assert all(r.is_finished() for r in reqs)
