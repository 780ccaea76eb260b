"""LMCacheConnectorV1 serves hybrid models and fails closed without state.

Patch: lmcache-connector-hma. The connector runs for real inside a real
Scheduler; only LMCache's engine is a stand-in (see fake_engine.py).
"""

import pytest

from vllm.v1.kv_cache_interface import FullAttentionSpec
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
from .fake_engine import install

PATCH = "lmcache-connector-hma"


def _lmcache_scheduler(monkeypatch, kv_cache_config=None, **engine_attributes):
    engine_cls = install(monkeypatch, **engine_attributes)
    sched = scheduler(
        vllm_config(kv_role="kv_both", kv_connector="LMCacheConnectorV1"),
        kv_cache_config,
    )
    (engine,) = engine_cls.instances
    return sched, engine


def _assert_attention_blocks(block_ids, num_prompt_blocks):
    """The block table of a full-attention group: one block per 16 tokens
    and no null blocks (which in align mode only Mamba groups hold)."""
    assert len(block_ids) >= num_prompt_blocks
    assert 0 not in block_ids


def _finish(sched, req):
    """Run ``req`` to its end (its prompt, then max_tokens decode steps)."""
    sched.add_request(req)
    while req.status != RequestStatus.FINISHED_LENGTH_CAPPED:
        step(sched)


@pytest.mark.patch(PATCH)
def test_engine_reads_kv_cache_config_from_connector(monkeypatch):
    config = hybrid_kv_cache_config()
    _, engine = _lmcache_scheduler(monkeypatch, config)
    assert engine.seen_kv_cache_config is config


@pytest.mark.patch(PATCH)
def test_finished_request_forwards_attention_group_blocks(monkeypatch):
    sched, engine = _lmcache_scheduler(monkeypatch)
    req = request(prompt(4 * BLOCK_SIZE), max_tokens=2)
    _finish(sched, req)

    # Group 0 is the full-attention group of the hybrid layout: LMCache gets
    # its blocks, not a Mamba group's.
    ((req_id, block_ids),) = engine.finished
    assert req_id == req.request_id
    _assert_attention_blocks(block_ids, num_prompt_blocks=4)


@pytest.mark.patch(PATCH)
def test_engine_selected_group_is_forwarded(monkeypatch):
    # A layout where the attention group is not group 0.
    config = hybrid_kv_cache_config()
    config.kv_cache_groups.reverse()
    assert isinstance(config.kv_cache_groups[3].kv_cache_spec, FullAttentionSpec)
    sched, engine = _lmcache_scheduler(monkeypatch, config, kv_cache_group_id=3)
    req = request(prompt(4 * BLOCK_SIZE), max_tokens=2)
    _finish(sched, req)

    ((_, block_ids),) = engine.finished
    _assert_attention_blocks(block_ids, num_prompt_blocks=4)


@pytest.mark.patch(PATCH)
def test_invalid_selected_group_is_rejected(monkeypatch):
    sched, _ = _lmcache_scheduler(monkeypatch, kv_cache_group_id=1)  # a Mamba group
    req = request(prompt(2 * BLOCK_SIZE), max_tokens=1)
    with pytest.raises(ValueError, match="not an attention group"):
        _finish(sched, req)


@pytest.mark.patch(PATCH)
def test_hybrid_model_reports_no_external_hit_without_state_restore(monkeypatch):
    sched, engine = _lmcache_scheduler(monkeypatch, matched_tokens=3 * BLOCK_SIZE)
    req = request(prompt(4 * BLOCK_SIZE))
    sched.add_request(req)

    sched.schedule()

    # Attention KV without its Mamba state would corrupt the output: no
    # external hit is taken and LMCache is not asked for one.
    assert sched.connector_prefix_cache_stats.hits == 0
    assert engine.lookups == []


@pytest.mark.patch(PATCH)
def test_hybrid_model_reports_external_hit_with_state_restore(monkeypatch):
    sched, engine = _lmcache_scheduler(
        monkeypatch,
        matched_tokens=3 * BLOCK_SIZE,
        supports_hybrid_state_restore=True,
    )
    req = request(prompt(4 * BLOCK_SIZE))
    sched.add_request(req)

    sched.schedule()

    # LMCache restores 3 blocks (KV + Mamba state): only the rest is computed.
    assert engine.lookups == [0]
    assert sched.connector_prefix_cache_stats.hits == 3 * BLOCK_SIZE
