"""Which Mamba state NIXL's worker moves on a decode-side local hybrid hit.

Patches: divergent-hybrid-hit-per-request and nixl-mamba-prefix-cache-read.
The series keeps a decode instance's local attention hit behind a NIXL load
because NIXL brings the prefiller's running Mamba state to the resume point.
This file checks the state itself, at NIXL's worker. On v0.32.0/v0.33.0 it is
about what stock NIXL already does (the series relies on it and does not
change NIXL's worker), so it passes on stock and on the series alike; it goes
red if NIXL's pairing of remote and local blocks ever moves. On v0.20.2 the
worker asserted on the Mamba descriptor counts (the prefiller's list holds
null placeholders ahead of its running state, the decode side's only real
blocks), with or without a local hit: nixl-mamba-prefix-cache-read pairs the
tail: the cold-decode test below is its red->green proof, and the
local-hit test (needing both patches there) passes on the series.

Scenario, all on real vLLM objects except the NIXL agent:
- a prefill instance P (real Scheduler + NixlConnector, no local hit) computes
  the prompt up to NIXL's back-off; its ``request_finished`` hands out the
  ``remote_block_ids`` a decode instance reads;
- a decode instance D (real Scheduler + NixlConnector) served an earlier
  remote-prefill request sharing a 4-block prefix, so it holds that prefix's
  attention blocks (L = 64 tokens) and no Mamba state there; the new request
  takes the local hit and NIXL's scheduler side queues the receive
  (``local_block_ids``, from the scheduler output's connector metadata);
- NIXL's worker ``_read_blocks`` then runs for that receive with a recording
  NIXL wrapper.

Asserted: the remote Mamba block holding P's running state (P's block at
(T-1)//block_size of its block table, T = prompt - back-off, the tokens P
computed) is read into D's Mamba block at (T-1)//block_size, the block the
model reads at the resume point (``preprocess_mamba``: (num_computed - 1) //
block_size); and attention's remote blocks land in D's uncached suffix blocks
only, paired position by position (remote block i -> local block i), never
over the L-token local hit.

Stood in (labelled below): the NIXL agent (a recorder) and the descriptor-id
arithmetic (``_compute_desc_ids`` / ``_get_block_descs_ids``), replaced by an
encoder of (group, block id) pairs, so that the recorded READ reads back as
block pairs. The pairing under test (``_apply_prefix_caching`` on 0.32/0.33,
the per-group trim on 0.20.2, and the order both lists are handed to NIXL in)
is vLLM's own code.
"""

import contextlib
from collections import defaultdict
from types import SimpleNamespace
from unittest.mock import MagicMock

import numpy as np
import pytest
import vllm
from packaging.version import Version

from ..builders import (
    BLOCK_SIZE,
    connectors,
    hybrid_kv_cache_config,
    model_runner_output,
    prompt,
    receive_remote_prefill,
    remote_prefill_params,
    request,
    scheduler,
    vllm_config,
)

PER_REQUEST = "divergent-hybrid-hit-per-request"
NIXL_READ = "nixl-mamba-prefix-cache-read"
PREFIX = prompt(4 * BLOCK_SIZE, seed=1)
NEW_VLLM = Version(vllm.__version__) >= Version("0.28")
# v0.21-v0.27 keep v0.20's worker class and read through a ReadSpec.
READ_SPEC_VLLM = Version(vllm.__version__) >= Version("0.21")
ATTN, MAMBA = 0, 1  # hybrid_kv_cache_config: group 0 attention, 1.. Mamba
ENC = 1_000_000  # desc-id encoding: group * ENC + block id


class _RecordingNixl:
    """Stand-in for the NIXL agent (after vLLM's tests/v1/kv_connector/unit/
    test_nixl_desc_geometry.py::_RecordingNixl, reduced to what _read_blocks
    calls): records every prepared transfer."""

    def __init__(self):
        self.xfers = []

    def make_prepped_xfer(self, op, local_handle, local_ids, remote_handle,
                          remote_ids, notif_msg=None):
        self.xfers.append((op, list(local_ids), list(remote_ids)))
        return len(self.xfers)

    def transfer(self, handle):
        pass

    def send_notif(self, agent, notif_msg=None):
        self.xfers.append(("NOTIF", [], []))


def _encode_desc_ids(block_ids, *args, **kwargs):
    """Stand-in for the descriptor-id arithmetic: one id per (group, block) in
    the order vLLM lays descriptors out (group-major)."""
    return np.asarray(
        [g * ENC + b for g, blocks in enumerate(block_ids) for b in blocks],
        dtype=np.int64,
    )


def _raise(*args, **kwargs):
    raise AssertionError(f"NIXL worker reported a failure: {args} {kwargs}")


def _prefill_instance(prompt_ids):
    """P: compute the prompt (NIXL truncates it by its back-off) and return
    (remote_block_ids P hands out, P's Mamba block at its running state, T)."""
    sched = scheduler(vllm_config(**connectors("nixl", "kv_producer")),
                      hybrid_kv_cache_config())
    req = request(prompt_ids, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False})
    sched.add_request(req)
    for _ in range(8):  # align mode cuts the prefill at block boundaries
        output = sched.schedule()
        assert req.request_id in output.num_scheduled_tokens, (
            req.status, req.num_computed_tokens, req.num_prompt_tokens)
        if req.num_computed_tokens >= req.num_prompt_tokens:
            break
        partial = model_runner_output([req])
        partial.sampled_token_ids = [[]]  # a partial prefill samples nothing
        sched.update_from_output(output, partial)
    computed = req.num_computed_tokens
    assert computed == len(prompt_ids) - 1  # NIXL's back-off of 1 for Mamba
    p_blocks = sched.kv_cache_manager.get_block_ids(req.request_id)
    state_block = p_blocks[MAMBA][(computed - 1) // BLOCK_SIZE]
    outs = sched.update_from_output(output, model_runner_output([req]))
    params = next(o.kv_transfer_params for eco in outs.values()
                  for o in eco.outputs if o.request_id == req.request_id)
    assert params is not None and params.get("remote_block_ids")
    return params["remote_block_ids"], state_block, computed, p_blocks


@contextlib.contextmanager
def _scheduler_admits_external_kv():
    """A release whose scheduler refuses external KV on a Mamba-align model (stock
    v0.20.2 and v0.21.0, before scheduler-mamba-external-kv) never reaches NIXL's
    worker: the test cannot say anything about the worker there, so it skips (on
    the trees with that patch it runs)."""
    try:
        yield
    except AssertionError as exc:
        if "External KV connector is not verified yet" not in str(exc):
            raise
        pytest.skip("the scheduler refuses external KV on a Mamba-align model before "
                    "NIXL's worker is reached (needs scheduler-mamba-external-kv)")


@_scheduler_admits_external_kv()
def _decode_recv(prompt_ids, remote_block_ids, warm=True):
    """D: (when ``warm``) serve a remote-prefill request sharing PREFIX, then
    admit the new one with P's block ids; return (its recv metadata, D's block
    table, L, T)."""
    sched = scheduler(vllm_config(**connectors("nixl", "kv_consumer")),
                      hybrid_kv_cache_config())
    if warm:
        first = request(PREFIX + prompt(2 * BLOCK_SIZE, seed=2),
                        kv_transfer_params=remote_prefill_params(6))
        receive_remote_prefill(sched, first)
        assert first.num_computed_tokens >= first.num_prompt_tokens

    params = remote_prefill_params(0)
    params["remote_block_ids"] = remote_block_ids
    req = request(prompt_ids, kv_transfer_params=params)
    sched.add_request(req)
    output = sched.schedule()
    meta = output.kv_connector_metadata.reqs_to_recv[req.request_id]
    # the tokens the connector was not queried for (builders.local_hit_tokens)
    local_hit = req.num_tokens - sched.connector_prefix_cache_stats.queries
    assert req.num_computed_tokens == len(prompt_ids) - 1  # hit + NIXL's load
    d_blocks = sched.kv_cache_manager.get_block_ids(req.request_id)
    resume = len(prompt_ids) - 1
    return meta, d_blocks, local_hit, resume


def _worker_v033(kv_cache_config):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    w = object.__new__(NixlPullConnectorWorker)
    w.kv_cache_config = kv_cache_config
    w._has_mamba = True
    w._group_spec_types = tuple(
        MambaSpec if isinstance(g.kv_cache_spec, MambaSpec) else FullAttentionSpec
        for g in kv_cache_config.kv_cache_groups)
    w._physical_blocks_per_logical_kv_block = 1
    w.dcp_size = 1
    w.engine_id = "decode-engine"
    remote_info = SimpleNamespace(remote_block_size=BLOCK_SIZE,
                                  remote_physical_blocks_per_logical=1,
                                  remote_dcp_size=1)
    w.transfer_topo = MagicMock()
    w.transfer_topo.get_engine_info.return_value = remote_info
    w.transfer_topo.block_size_ratio.return_value = 1
    w._remote_agents = {"prefill-engine": {(0, 0): "remote-agent"}}
    w.dst_num_blocks = defaultdict(int)
    w.dst_region_num_blocks = {}
    w.dst_region_group_ids = {}
    w.dst_uses_region_group_mapping = defaultdict(bool)
    w.region_group_ids = []
    w.num_regions = 1
    w._uses_region_group_mapping = False
    w._mixed_mem_types = False
    w._recving_transfers = defaultdict(list)
    w._log_failure = _raise
    w._compute_desc_ids = _encode_desc_ids  # stand-in, see module docstring
    return w


def _read_v033(w, local_ids, remote_ids):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import ReadSpec

    posted = w._read_blocks(
        read_spec=ReadSpec(remote_rank=0, local_block_ids=local_ids,
                           remote_block_ids=remote_ids),
        dst_engine_id="prefill-engine", request_id="req", remote_request_id="p",
        local_xfer_side_handle=1, local_dram_handle=None,
        remote_xfer_side_handle=2, expected_consumers=1, awaiting_kvs=True)
    assert posted


def _worker_v020(kv_cache_config):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import (
        NixlConnectorWorker,
    )
    from vllm.v1.kv_cache_interface import MambaSpec

    w = object.__new__(NixlConnectorWorker)
    w.kv_cache_config = kv_cache_config
    w._is_mamba_group = [isinstance(g.kv_cache_spec, MambaSpec)
                         for g in kv_cache_config.kv_cache_groups]
    w._is_hma_required = True
    w.world_size = 1
    w.engine_id = "decode-engine"
    remote_info = SimpleNamespace(remote_block_size=BLOCK_SIZE)
    w.transfer_topo = MagicMock()
    w.transfer_topo.get_engine_info.return_value = remote_info
    w.transfer_topo.block_size_ratio.return_value = 1
    w._remote_agents = {"prefill-engine": {0: "remote-agent"}}
    w._recving_transfers = defaultdict(list)
    w._log_failure = _raise
    # stand-in, see module docstring
    w._get_block_descs_ids = (
        lambda engine_id, block_ids, block_size_ratio=None:
        _encode_desc_ids(block_ids))
    return w


def _read_v020(w, local_ids, remote_ids):
    w._read_blocks(local_block_ids=local_ids, remote_block_ids=remote_ids,
                   dst_engine_id="prefill-engine", request_id="req",
                   remote_request_id="p", remote_rank=0,
                   local_xfer_side_handle=1, remote_xfer_side_handle=2)


def _worker_v021(kv_cache_config):
    w = _worker_v020(kv_cache_config)
    w.transfer_topo.get_engine_info.return_value = SimpleNamespace(
        remote_block_size=BLOCK_SIZE, remote_physical_blocks_per_logical=1)
    w.dst_num_blocks = defaultdict(int)
    w._physical_blocks_per_logical_kv_block = 1
    w._compute_desc_ids = _encode_desc_ids  # stand-in, see module docstring
    return w


def _read_v021(w, local_ids, remote_ids):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import ReadSpec

    w._read_blocks(
        read_spec=ReadSpec(remote_rank=0, local_block_ids=local_ids,
                           remote_block_ids=remote_ids),
        dst_engine_id="prefill-engine", request_id="req", remote_request_id="p",
        local_xfer_side_handle=1, remote_xfer_side_handle=2)


def _pairs(nixl):
    """The recorded READ as {group: [(remote block, local block), ...]}."""
    reads = [x for x in nixl.xfers if x[0] == "READ"]
    assert len(reads) == 1, nixl.xfers
    _, local, remote = reads[0]
    assert len(local) == len(remote)
    pairs = defaultdict(list)
    for lo, re in zip(local, remote):
        assert lo // ENC == re // ENC, "a read crosses KV cache groups"
        pairs[lo // ENC].append((re % ENC, lo % ENC))
    return pairs


def _read_pairs(kv_cache_config, meta, remote_ids):
    """NIXL's worker posts the READ of ``meta``'s receive; the READ as pairs."""
    if NEW_VLLM:
        w, read = _worker_v033(kv_cache_config), _read_v033
    elif READ_SPEC_VLLM:
        w, read = _worker_v021(kv_cache_config), _read_v021
    else:
        w, read = _worker_v020(kv_cache_config), _read_v020
    w.nixl_wrapper = nixl = _RecordingNixl()
    read(w, [list(g) for g in meta.local_block_ids], [list(g) for g in remote_ids])
    return _pairs(nixl)


def _assert_prefiller_state_lands_in(pairs, kv_cache_config, p_blocks, p_computed,
                                     p_state_block, local_block):
    """Exactly one state moves per Mamba group: P's running state (its block at
    (T-1)//block_size) into ``local_block(g)``."""
    for g in range(MAMBA, len(kv_cache_config.kv_cache_groups)):
        assert pairs[g] == [(p_blocks[g][(p_computed - 1) // BLOCK_SIZE],
                             local_block(g))], (g, pairs[g])
    assert pairs[MAMBA][0][0] == p_state_block


@pytest.mark.patch(NIXL_READ)
@pytest.mark.parametrize("suffix_blocks", [1, 3])
def test_nixl_worker_reads_prefiller_state_without_local_hit(suffix_blocks):
    """A remote prefill on a cold decode instance: the prefiller's list holds
    null placeholders ahead of its running state, D's list its one state
    block. The READ must pair P's running state with D's block at the resume
    point and every attention block position by position."""
    prompt_ids = PREFIX + prompt(suffix_blocks * BLOCK_SIZE + 5, seed=9)
    remote_ids, p_state_block, p_computed, p_blocks = _prefill_instance(prompt_ids)
    meta, d_blocks, local_hit, resume = _decode_recv(
        prompt_ids, remote_ids, warm=False)
    assert local_hit == 0
    resume_block = (resume - 1) // BLOCK_SIZE
    kv_cache_config = hybrid_kv_cache_config()
    for g in range(MAMBA, len(kv_cache_config.kv_cache_groups)):
        assert len(meta.local_block_ids[g]) == 1, meta.local_block_ids[g]
        if not NEW_VLLM:
            # The case under test: P hands out null placeholders ahead of its
            # state (v0.23+ clips them at the exchange).
            assert len(remote_ids[g]) > 1, remote_ids[g]

    pairs = _read_pairs(kv_cache_config, meta, remote_ids)
    _assert_prefiller_state_lands_in(pairs, kv_cache_config, p_blocks, p_computed,
                                     p_state_block, lambda g: d_blocks[g][resume_block])
    num_blocks = -(-resume // BLOCK_SIZE)
    assert pairs[ATTN] == [(p_blocks[ATTN][i], d_blocks[ATTN][i])
                           for i in range(num_blocks)]


@pytest.mark.patch(PER_REQUEST)
@pytest.mark.parametrize("suffix_blocks", [2, 3])
def test_nixl_worker_reads_prefiller_state_into_resume_block(suffix_blocks):
    prompt_ids = PREFIX + prompt(suffix_blocks * BLOCK_SIZE + 5, seed=7)
    remote_ids, p_state_block, p_computed, p_blocks = _prefill_instance(prompt_ids)
    meta, d_blocks, local_hit, resume = _decode_recv(prompt_ids, remote_ids)

    assert local_hit == len(PREFIX)  # the divergent hit: attention only
    assert p_computed == resume  # P's state sits where D resumes
    resume_block = (resume - 1) // BLOCK_SIZE

    kv_cache_config = hybrid_kv_cache_config()
    local_ids = [list(g) for g in meta.local_block_ids]
    for g in range(MAMBA, len(kv_cache_config.kv_cache_groups)):
        # Both ends name the right blocks: P's list ends at its running state,
        # D's list holds the resume block.
        assert remote_ids[g][-1] == p_blocks[g][(p_computed - 1) // BLOCK_SIZE]
        assert d_blocks[g][resume_block] in local_ids[g]
    pairs = _read_pairs(kv_cache_config, meta, remote_ids)

    # Mamba: P's running state into D's block at the resume point.
    _assert_prefiller_state_lands_in(pairs, kv_cache_config, p_blocks, p_computed,
                                     p_state_block, lambda g: d_blocks[g][resume_block])

    # Attention: remote block i -> local block i for the uncached suffix only.
    first_uncached = local_hit // BLOCK_SIZE
    num_blocks = -(-resume // BLOCK_SIZE)
    assert pairs[ATTN] == [
        (p_blocks[ATTN][i], d_blocks[ATTN][i])
        for i in range(first_uncached, num_blocks)
    ]
    hit_blocks = set(d_blocks[ATTN][:first_uncached])
    assert not hit_blocks & {lo for _, lo in pairs[ATTN]}
