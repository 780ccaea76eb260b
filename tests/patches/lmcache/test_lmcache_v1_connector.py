"""LMCacheConnectorV1 on the series: stock vLLM's fail-safe behaviour is kept.

The series carries no LMCache patch (``lmcache-connector-hma`` is dropped on every
pin; its record says why). LMCacheConnectorV1 does not implement SupportsHMA, so vLLM
turns the hybrid memory allocator off for it (v0.20.2 does for every connector unless
asked not to). What that gives, and what these tests hold the patched build to:

- a model with Mamba layers is refused at start-up, where vLLM groups the model's
  KV cache, before any request is served;
- a model with sliding-window layers gets one KV cache group, the only group LMCache's
  vLLM adapter tracks (it builds its slot mappings from ``block_ids[0]``);
- plain and sliding-window models go through preemption and resumption with
  LMCache's real vLLM adapter (lmcache 0.5.6, from the test environment's lmcache
  layer: ``hybridpd.proof.testenv.LAYERS``), whose scheduler side asserts that every resumed
  request went through its lookup and resumes where the lookup said.

Only what needs a GPU below the adapter is faked: LMCache's compiled device ops and
its ``LMCacheManager`` (the engine, and a lookup client that answers lookups).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    SlidingWindowSpec,
)

from ..builders import (
    BLOCK_SIZE,
    connectors,
    hybrid_kv_cache_config,
    prompt,
    request,
    scheduler,
    step,
    vllm_config,
)

try:  # v0.33.0 moved the grouping to kv_cache_planning
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
except ImportError:
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups


def _full() -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
    )


def _layers(model: str) -> dict:
    """The KV cache spec of each layer, as a model runner reports it."""
    if model == "plain":
        return {"attn.0": _full(), "attn.1": _full()}
    if model == "sliding-window":
        swa = SlidingWindowSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=1,
            head_size=1,
            dtype=torch.float32,
            sliding_window=2 * BLOCK_SIZE,
        )
        return {"attn.0": _full(), "swa.1": swa}
    if model == "hybrid":  # Qwen3.5: three Gated-DeltaNet layers per attention layer
        mamba = MambaSpec(
            block_size=BLOCK_SIZE,
            shapes=((1, 1),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align",
        )
        return {"attn.0": _full(), **{f"linear_attn.{i}": mamba for i in range(3)}}
    raise ValueError(model)


def _config(**kwargs):
    """``vllm_config`` with the KV cache layout resolved, as the engine core resolves
    it before it groups the KV cache (unresolved, the grouping raises its own
    ValueError, which a refusal test must not take for a refusal)."""
    config = vllm_config(**kwargs)
    if hasattr(config.cache_config, "kv_cache_layout"):  # v0.32+
        config.cache_config.kv_cache_layout = "NHD"
    return config


#: The start-up error when vLLM cannot put a model's layers in one KV cache group
#: (v0.20.2: "Hybrid KV cache manager is disabled but failed to convert the KV cache
#: specs to one unified type."; v0.32.0/v0.33.0: "Failed to promote local KV cache
#: specs to one unified type.").
NOT_ONE_GROUP = r"KV cache specs to one unified type"


def _lmcache_is_not_hma():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    cls = KVConnectorFactory.get_connector_class_by_name("LMCacheConnectorV1")
    assert not supports_hma(cls), (
        "LMCacheConnectorV1 implements SupportsHMA: see the dropped record of "
        "lmcache-connector-hma in patches/series.toml"
    )


@pytest.mark.parametrize("kind", ["lmcache", "nixl+lmcache", "lmcache+nixl"])
def test_a_model_with_mamba_layers_is_refused_at_startup(kind):
    """LMCache's adapter stores one KV cache group and no Mamba state: an engine
    that started would either crash at the first finished request (the scheduler
    asserts one group for a connector without SupportsHMA) or serve prefixes without
    the Mamba state behind them. Left to decide, vLLM turns the hybrid allocator off
    (v0.32+: for a connector without SupportsHMA; v0.20.2: for every connector) and
    refuses the model while it groups its KV cache."""
    _lmcache_is_not_hma()
    config = _config(**connectors(kind))
    assert config.scheduler_config.disable_hybrid_kv_cache_manager
    with pytest.raises(ValueError, match=NOT_ONE_GROUP):
        get_kv_cache_groups(config, _layers("hybrid"))


@pytest.mark.parametrize("kind", ["lmcache", "nixl+lmcache", "lmcache+nixl"])
def test_the_connector_is_refused_when_the_hybrid_allocator_is_asked_for(kind):
    """With ``--no-disable-hybrid-kv-cache-manager`` (the flag hybridpd's servers
    pass), vLLM refuses to create the connector: the MultiConnector itself where it
    checks its children at configuration (v0.32+) or does not support HMA (stock
    v0.20.2), its LMCache child where the MultiConnector checks them on creation
    (v0.20.2 with multi-connector-hma), or the MultiConnector's own assertion on its
    children (v0.21.0, the first release whose MultiConnector supports HMA)."""
    _lmcache_is_not_hma()
    config = _config(**connectors(kind), hybrid_kv_cache_manager=True)
    name = "LMCacheConnectorV1" if kind == "lmcache" else "(LMCacheConnectorV1|MultiConnector)"
    with pytest.raises(
        (ValueError, AssertionError),
        match=rf"Connector {name} does not support HMA but HMA is enabled"
        r"|HMA should not be enabled unless all sub-connectors support it",
    ):
        scheduler(config, hybrid_kv_cache_config())


def _lmcache_adapter(monkeypatch):
    """LMCache's vLLM adapter module, its compiled device ops stubbed (CUDA only)
    for this test."""

    class _Stub(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return lambda *args, **kwargs: None

    stubs = {name: _Stub(f"lmcache.{name}") for name in ("device_ops", "c_ops")}
    for name, stub in stubs.items():
        monkeypatch.setitem(sys.modules, f"lmcache.{name}", stub)
    import lmcache

    for name, stub in stubs.items():
        monkeypatch.setattr(lmcache, name, stub, raising=False)
    from lmcache.integration.vllm import vllm_v1_adapter

    return vllm_v1_adapter


class _LookupClient:
    """LMCache holds the first ``hit`` tokens of every prompt."""

    def __init__(self, hit: int):
        self.hit = hit
        self.lookups: list[str] = []

    def lookup(self, token_ids, lookup_id, request_configs=None):
        self.lookups.append(lookup_id)
        return min(self.hit, len(token_ids))

    def lookup_cache(self, lookup_id):
        return -1

    def clear_lookup_status(self, lookup_id):
        pass

    def cancel_lookup(self, lookup_id):
        pass

    def supports_producer_reuse(self):
        return False


def _manager_with_lookup(client: _LookupClient):
    """A stand-in for LMCache's LMCacheManager: no engine (that needs a GPU), the
    given lookup client, no services."""

    class _Manager:
        def __init__(self, config, service_factory, connector):
            self.lookup_client = client
            self.lmcache_engine = None
            self.lmcache_engine_metadata = None
            self.lookup_server = None

        def start_services(self):
            pass

        def post_init(self):
            pass

        def stop_services(self):
            pass

        def shutdown(self):
            pass

    return _Manager


@pytest.mark.parametrize("model", ["plain", "sliding-window"])
def test_preempted_requests_resume_through_the_real_adapter(monkeypatch, model):
    _lmcache_is_not_hma()
    adapter = _lmcache_adapter(monkeypatch)
    client = _LookupClient(hit=2 * BLOCK_SIZE)
    monkeypatch.setattr(adapter, "LMCacheManager", _manager_with_lookup(client))
    config = _config(**connectors("lmcache"))
    groups = get_kv_cache_groups(config, _layers(model))
    # Every layer's KV is in the one group LMCache's adapter stores and loads: with
    # the hybrid allocator off, a sliding-window layer is kept as full attention.
    assert len(groups) == 1
    assert type(groups[0].kv_cache_spec) is FullAttentionSpec
    sched = scheduler(
        config, KVCacheConfig(num_blocks=24, kv_cache_tensors=[], kv_cache_groups=groups)
    )
    reqs = [request(prompt(6 * BLOCK_SIZE, seed=10 + i), max_tokens=40) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(400):
        step(sched)
        if all(r.is_finished() for r in reqs):
            break
    assert all(r.is_finished() for r in reqs)
    assert any(r.num_preemptions > 0 for r in reqs), "the pool was too large to preempt"
    # A resumed request is looked up again: LMCache was asked for each request at
    # least once more than it was preempted. (The lookup answers a block-aligned hit;
    # v0.33's paths that zero an external hit after the lookup are not exercised.)
    for r in reqs:
        assert client.lookups.count(r.request_id) >= 1 + r.num_preemptions
