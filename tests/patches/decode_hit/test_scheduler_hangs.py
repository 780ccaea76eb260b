"""vLLM hangs on v0.32+ that the series fixes, each found by test_mamba_state_property.py.

Patch: failed-load-retry-admission. vLLM keeps a request among its in-flight
prefills, and in the queue of waiting requests that hold KV (drained first),
after its async KV load failed with nothing valid (kv_load_failure_policy
"recompute": the blocks are freed and the request waits again). When the
request is admitted for another async load (a hash store such as the
OffloadingConnector's CPU tier still offers the chunks), the reservation the
scheduler keeps for in-flight prefills includes the request's own remaining
blocks: it must fit twice. In a pool too small for that it is never admitted,
though nothing else runs (found with multi-module MTP, whose lookahead blocks
make the reservation larger, not specific to it). With that fixed alone, a
retry that does not fit yet still waits at the head of the KV-holding queue,
ahead of a remote prefill whose load landed and whose blocks it waits for.

Patch: mamba-align-mtp-lookahead-chunk. With multi-module MTP (3 or more
modules) a NIXL remote prefill 1 to ``num_spec - 2`` tokens past a block
boundary resumes inside its last full block; the Mamba align rule (a chunk that
starts inside a block ends at that block's end) and the MTP prefill lookahead
(no chunk ends fewer than ``num_spec`` tokens before the prompt does) together
leave it no chunk, and it never runs. Without a KV connector, a prefill where no
trailing cached block is dropped (``disable_eagle_block_drop``) reaches the same
state from its own chunking.

Each hang is detected as it happens (:func:`failed_load_self_reservation`, or
``mamba_state.deadlock``, after the workload's 600 scheduler steps):
red on stock, and patched the request is served (re-admitted once the pool
holds it, every request finished, every admission checked for its Mamba state).
"""

import functools

import pytest
import vllm
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from vllm.v1.request import RequestStatus

from ..builders import BLOCK_SIZE
from ..mamba_state import Deadlock

FAILED_LOAD_PATCH = "failed-load-retry-admission"
MTP_LOOKAHEAD_PATCH = "mamba-align-mtp-lookahead-chunk"

#: Releases whose scheduler reserves blocks for in-flight prefills
#: (``_inflight_prefill_reserved_blocks``, vllm-project/vllm#44560, v0.23) and
#: that this series ports: the failed load's retry can hang there on stock.
FAILED_LOAD_SELF_RESERVATION = SpecifierSet(">=0.32")


class SelfReservationHang(AssertionError):
    """A hang of :data:`FAILED_LOAD_SELF_RESERVATION`'s kind."""


def failed_load_self_reservation(sched, reqs) -> bool:
    """Whether nothing runs while an unfinished request waits holding no
    computed tokens, still counted among the in-flight prefills whose remaining
    blocks the scheduler reserves before admitting an async load.

    It fires on both stock mechanisms (it cannot tell them apart): the retry
    that must fit beside its own reservation, and the block-less retry at the
    head of the KV-holding queue; with only the discard from the in-flight
    prefills, the second is a plain ``Deadlock``."""
    inflight = getattr(sched, "_inflight_prefills", None)
    if sched.running or not inflight:
        return False
    return any(
        not r.is_finished() and r in inflight and r.num_computed_tokens == 0
        and r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        for r in reqs
    )


#: The shrunk workload test_mamba_state_property.py found (v0.32.0 and v0.33.0,
#: NIXL beside the OffloadingConnector, 3 MTP modules, a sliding window, a
#: 40-block pool): the 4-block request is preempted, loads 2 blocks back from
#: the CPU tier, the load fails, and the retry needs its own reservation too.
SELF_RESERVATION_WORKLOAD = {
    "kv_role": "kv_both", "num_blocks": 40, "engine": "mtp3", "window": 32,
    "seed": 0, "stored": [],
    "requests": [
        *[{"prefix": 0, "prefix_blocks": blocks, "suffix": 0, "remote": False,
           "load_fails": False, "max_tokens": 1, "arrival": 0} for blocks in (1, 1, 3)],
        {"prefix": 0, "prefix_blocks": 4, "suffix": 0, "remote": False,
         "load_fails": True, "max_tokens": 1, "arrival": 0},
    ],
}


#: The head-of-queue hang with NIXL alone (v0.33.0 stock, n-gram drafts, a
#: sliding window, a 40-block pool): the 97-token remote prefill's load fails;
#: NIXL offers no second load, so its retry is no async load and its own
#: reservation plays no part. It waits at the head of the KV-holding queue for
#: blocks it does not get, so the remote prefill behind it, whose load landed
#: and whose blocks it waits for, is never promoted. This case guards the move
#: to the waiting queue: with only the discard from the in-flight prefills it
#: is a plain ``Deadlock`` (req-6 WAITING 0/97 ahead of req-8, loaded 46/47).
SELF_RESERVATION_NIXL_WORKLOAD = {
    "kv_role": "kv_both", "num_blocks": 40, "engine": "spec2", "window": 32,
    "seed": 0, "stored": [],
    "requests": [
        *[{"prefix": 0, "prefix_blocks": 1, "suffix": 0, "remote": False,
           "load_fails": False, "max_tokens": 1, "arrival": 0}] * 4,
        {"prefix": 0, "prefix_blocks": 6, "suffix": 1, "remote": True,
         "load_fails": True, "max_tokens": 1, "arrival": 0},
        {"prefix": 1, "prefix_blocks": 2, "suffix": 15, "remote": True,
         "load_fails": False, "max_tokens": 1, "arrival": 0},
    ],
}


@functools.cache
def self_reservation_hangs() -> bool:
    """Whether the vLLM under test has this hang: its scheduler hangs on
    :data:`SELF_RESERVATION_NIXL_WORKLOAD` (stock v0.32+; not with
    failed-load-retry-admission). The property test counts the hang
    as known only where it does."""
    if Version(vllm.__version__) not in FAILED_LOAD_SELF_RESERVATION:
        return False
    from .test_mamba_state_property import _run

    try:
        _run("nixl", SELF_RESERVATION_NIXL_WORKLOAD)
    except SelfReservationHang:
        return True
    return False


@pytest.mark.patch(FAILED_LOAD_PATCH)
@pytest.mark.vllm_versions(str(FAILED_LOAD_SELF_RESERVATION))
@pytest.mark.parametrize("kind,workload", [
    # The retry's own reservation (a second async load from the CPU tier).
    pytest.param("nixl+offloading", SELF_RESERVATION_WORKLOAD, id="offloading-mtp3"),
    # The block-less retry at the head of the KV-holding queue.
    pytest.param("nixl", SELF_RESERVATION_NIXL_WORKLOAD, id="nixl-spec2"),
])
def test_retried_load_after_a_failed_one_is_admitted(kind, workload):
    from .test_mamba_state_property import _run

    # Stock: raises SelfReservationHang (nothing runs; the failed request, still
    # among the in-flight prefills, waits: on its own reservation, or at the
    # head of the KV-holding queue). Patched: every request finishes, each admission
    # checked for its Mamba state, each remote prefill's for where it resumes.
    checker, reqs = _run(kind, workload)

    (failed,) = [r for r, s in zip(reqs, workload["requests"]) if s["load_fails"]]
    admissions = [a for a in checker.admissions if a.request_id == failed.request_id]
    # Admitted with its load, which failed, then again once the pool held it once.
    loads = [i for i, a in enumerate(admissions) if a.external_tokens > 0]
    assert loads, admissions
    assert loads[0] < len(admissions) - 1, admissions
    assert failed.is_finished()


@pytest.mark.patch(FAILED_LOAD_PATCH)
@pytest.mark.vllm_versions(str(FAILED_LOAD_SELF_RESERVATION))
def test_failed_load_waits_out_a_pause_of_new_requests():
    """pause(mode="wait") (PauseState.PAUSED_NEW) admits only the requests that
    hold KV blocks. A request whose async load failed with nothing valid holds
    none: it now waits until the engine resumes, as a preempted request does,
    and the drain ends without it (stock recomputed it during the drain)."""
    from vllm.v1.core.sched.interface import PauseState

    from ..builders import (
        hybrid_kv_cache_config,
        model_runner_output,
        prompt,
        remote_prefill_params,
        request,
        scheduler,
        step,
        vllm_config,
    )

    config = vllm_config(kv_load_failure_policy="recompute")
    sched = scheduler(config, hybrid_kv_cache_config(num_blocks=400))
    req = request(prompt(3 * BLOCK_SIZE + 1),
                  kv_transfer_params=remote_prefill_params(4), max_tokens=2)
    sched.add_request(req)
    step(sched)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert req in sched._inflight_prefills

    sched.set_pause_state(PauseState.PAUSED_NEW)
    # The worker reports the load failed as a whole: nothing valid, blocks freed.
    output = sched.schedule()
    assert not output.num_scheduled_tokens
    sched.update_from_output(output, model_runner_output(
        [], finished_recving={req.request_id}, failed_recving={req.request_id}))

    output = sched.schedule()
    # Stock: scheduled during the drain, recomputing its whole prompt.
    assert req.request_id not in output.num_scheduled_tokens, output.num_scheduled_tokens
    # It went to the head of the queue of requests that hold no KV, holding no
    # blocks and reserving none; the drain counts nothing left.
    assert req.status == RequestStatus.WAITING
    assert req.num_computed_tokens == 0
    assert sched.waiting.peek_request() is req
    assert req not in sched.kv_holding_waiting
    assert req not in sched._inflight_prefills
    assert sched.get_num_unfinished_requests() == 0

    # Resumed: admitted as a new request (NIXL offers its load once) and served.
    sched.set_pause_state(PauseState.UNPAUSED)
    output = step(sched)
    assert output.num_scheduled_tokens.get(req.request_id), output.num_scheduled_tokens
    for _ in range(4):
        step(sched)
    assert req.is_finished() and req.num_output_tokens == 2


#: Releases whose scheduler keeps multi-module MTP's prefill lookahead (it ends
#: no prefill chunk fewer than ``num_spec`` tokens before the prompt's end,
#: vllm-project/vllm#50062) next to the Mamba align rule (a chunk that starts
#: inside a block ends at that block's end or at the prompt's end). NIXL's
#: prefiller stops ``num_spec - 1`` tokens short, so with 3 or more MTP modules
#: a remote prefill can resume inside a block that ends fewer than ``num_spec``
#: tokens before the prompt does (a prompt one token past a block boundary,
#: with 3). The only chunk the align rule allows is then one the lookahead
#: forbids: the scheduler cuts it to nothing and the request never runs, keeping
#: its blocks (v0.33.0 passes over it each step; on v0.32.0 a waiting one also
#: stops the waiting queue behind it).
MTP_LOOKAHEAD_HANG = SpecifierSet(">=0.32")


class MtpLookaheadHang(Deadlock):
    """A hang of :data:`MTP_LOOKAHEAD_HANG`'s kind (see :func:`mtp_lookahead_hang`)."""


def mtp_lookahead_hang(reqs, num_spec: int, block_size: int = BLOCK_SIZE) -> bool:
    """Whether an unfinished request of ``reqs`` waits where the two rules of
    :data:`MTP_LOOKAHEAD_HANG` leave it no chunk: inside a prompt block that ends
    fewer than ``num_spec`` tokens before the prompt does."""
    for r in reqs:
        if r.is_finished() or r.status not in (RequestStatus.WAITING,
                                               RequestStatus.PREEMPTED):
            continue
        start = r.num_computed_tokens
        block_end = -(-start // block_size) * block_size
        if start % block_size and 0 < r.num_prompt_tokens - block_end < num_spec:
            return True
    return False


def mtp_lookahead_workload(prefix_blocks: int) -> dict:
    """The shrunk workload test_mamba_state_property.py found (v0.32.0 and
    v0.33.0, NIXL, 3 MTP modules; ``prefix_blocks`` 1): one remote prefill of a
    prompt one token past ``prefix_blocks`` blocks. NIXL loads it less 2 tokens;
    the align rule allows only the chunk to the block's end, 1 token before the
    prompt's."""
    return {
        "kv_role": "kv_both", "num_blocks": 400, "engine": "mtp3", "window": None,
        "seed": 0, "stored": [],
        "requests": [
            {"prefix": 0, "prefix_blocks": prefix_blocks, "suffix": 1, "remote": True,
             "load_fails": False, "max_tokens": 1, "arrival": 0},
        ],
    }


@functools.cache
def mtp_lookahead_hangs() -> bool:
    """Whether the vLLM under test has this hang (stock v0.32+; not with
    mamba-align-mtp-lookahead-chunk): the property test counts it as known only
    where it does."""
    if Version(vllm.__version__) not in MTP_LOOKAHEAD_HANG:
        return False
    from .test_mamba_state_property import _run

    try:
        _run("nixl", mtp_lookahead_workload(1))
    except MtpLookaheadHang:
        return True
    return False


@pytest.mark.patch(MTP_LOOKAHEAD_PATCH)
@pytest.mark.vllm_versions(str(MTP_LOOKAHEAD_HANG))
@pytest.mark.parametrize("prefix_blocks", [1, 4])
def test_multi_module_mtp_remote_prefill_past_a_block_boundary_is_served(prefix_blocks):
    from .test_mamba_state_property import _run

    # Stock: raises MtpLookaheadHang (the request waits, never scheduled, inside
    # its last full block). Patched: it finishes, its admission checked for its
    # Mamba state (NIXL's load restores it at the end of the loaded tokens).
    checker, (req,) = _run("nixl", mtp_lookahead_workload(prefix_blocks))

    # Served from its NIXL load, once: it resumed where the prefiller stopped
    # (the prompt less NIXL's back-off of num_spec - 1 = 2 tokens), inside its
    # last full block, and recomputed only the 2 tokens the prefiller left.
    (adm,) = [a for a in checker.admissions if a.request_id == req.request_id]
    assert adm.prefiller_end == req.num_prompt_tokens - 2 == prefix_blocks * BLOCK_SIZE - 1
    assert adm.external_tokens == adm.prefiller_end
    assert adm.serving_connector is not None and "Nixl" in adm.serving_connector
    assert req.is_finished() and req.num_output_tokens == 1


#: Steps of :func:`test_multi_module_mtp_prefill_past_a_block_boundary_runs`: a
#: 34-token prompt, block size 16, 3 MTP modules (lookahead 3), no KV connector,
#: nothing cached. The first chunk would end on the block boundary at 32, which
#: the lookahead cuts to 31 (2 tokens would be left); the next must end at 32
#: again (align rule), 2 tokens before the prompt's end, and is cut to nothing.
#: Patched it is kept: 1 token, then the last 2.
MTP_LOOKAHEAD_NO_CONNECTOR_STEPS = [31, 1, 2]


@pytest.mark.patch(MTP_LOOKAHEAD_PATCH)
@pytest.mark.vllm_versions(str(MTP_LOOKAHEAD_HANG))
def test_multi_module_mtp_prefill_past_a_block_boundary_runs():
    """Without a KV connector: a prefill where no trailing cached block is
    dropped (disable_eagle_block_drop) reaches the same state from its own
    chunking. Stock: 31 tokens, then none, every step (the request keeps
    running with its blocks and never finishes its prefill)."""
    from ..builders import (
        hybrid_kv_cache_config,
        model_runner_output,
        prompt,
        request,
        scheduler,
        vllm_config,
    )

    config = vllm_config(kv_role=None, num_speculative_tokens=3, spec_method="mtp",
                         mtp_modules=3, disable_eagle_block_drop=True)
    # A real MTP speculative config with 3 modules: the lookahead is 3.
    assert config.speculative_config.method == "mtp"
    assert config.num_prefill_lookahead_tokens == 3
    sched = scheduler(config, hybrid_kv_cache_config(num_blocks=400,
                                                     num_speculative_blocks=3))
    assert sched.need_mamba_block_aligned_split
    req = request(prompt(2 * BLOCK_SIZE + 2), max_tokens=1)
    sched.add_request(req)

    steps = []
    for _ in range(len(MTP_LOOKAHEAD_NO_CONNECTOR_STEPS) + 2):
        output = sched.schedule()
        steps.append(output.num_scheduled_tokens.get(req.request_id, 0))
        # A partial prefill samples nothing; the step that ends it samples a token.
        sampled = {rid for rid in output.num_scheduled_tokens
                   if not sched.requests[rid].is_prefill_chunk}
        sched.update_from_output(output, model_runner_output(
            [sched.requests[rid] for rid in output.num_scheduled_tokens],
            sampling=sampled))
        if req.is_finished():
            break

    # Stock: [31, 0, 0, 0, 0].
    assert steps == MTP_LOOKAHEAD_NO_CONNECTOR_STEPS, steps
    assert req.is_finished() and req.num_output_tokens == 1
