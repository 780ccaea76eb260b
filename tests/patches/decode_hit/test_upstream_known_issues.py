"""vLLM bugs on hybrid models that this patch series does not fix (yet).

Each test reproduces the bug on a real Scheduler and is a strict xfail: it
fails while the bug is there, on stock and patched builds alike, and turns red
(XPASS) the day a pin carries a fix, so the exclusion it justifies elsewhere
can be removed. (The synchronous load over a local hit on a full pool, found
here first, is fixed by mamba-align-admission-counts-sync-load:
tests/patches/scheduler/test_sync_load_admission.py.)
"""

import pytest
from packaging.specifiers import SpecifierSet

from vllm.v1.request import RequestStatus

from ..builders import BLOCK_SIZE
from ..mamba_state import Deadlock, DecoderStatePastPrompt

#: Releases whose scheduler admits an async KV load without reserving the
#: blocks the request needs to resume once it lands (its next token and its
#: speculative lookahead). Loads that fill the pool then wait at the head of
#: the waiting queue for blocks only they hold: nothing runs, nothing is
#: preempted, the engine hangs. Later releases reserve them at admission
#: (``_inflight_prefill_reserved_blocks`` + ``_spec_decode_step_blocks``,
#: "to avoid deadlock"). test_mamba_state_property.py counts such a workload
#: as this bug on these releases, and fails on any other. Upstream: reported as
#: https://github.com/vllm-project/vllm/issues/45387 and /issues/45388 (closed),
#: fixed by https://github.com/vllm-project/vllm/pull/44560 (async loads may not
#: take blocks that in-flight prefills need); the speculative-decoding part
#: (lookahead blocks allocated only once the load landed) by /pull/57104.
#: Measured: the property test hangs so on v0.20.2 and v0.21.0; v0.23.0 is the
#: first sdist whose scheduler has ``_inflight_prefill_reserved_blocks`` (v0.22.0
#: has none).
KV_HOLDING_DEADLOCK = SpecifierSet("<0.23")

#: The shrunk workload test_mamba_state_property.py found (v0.20.2, NIXL): three
#: remote prefills land in a 40-block pool with 2-token speculative decoding.
DEADLOCK_WORKLOAD = {
    "kv_role": "kv_both", "num_blocks": 40, "engine": "spec2", "window": None,
    "seed": 0, "stored": [],
    "requests": [
        *[{"prefix": 0, "prefix_blocks": 1, "suffix": 0, "remote": False,
           "load_fails": False, "max_tokens": 1, "arrival": 2}] * 3,
        {"prefix": 0, "prefix_blocks": 1, "suffix": 17, "remote": True,
         "load_fails": False, "max_tokens": 1, "arrival": 1},
        {"prefix": 0, "prefix_blocks": 2, "suffix": 15, "remote": True,
         "load_fails": False, "max_tokens": 1, "arrival": 1},
        {"prefix": 0, "prefix_blocks": 4, "suffix": 0, "remote": True,
         "load_fails": False, "max_tokens": 1, "arrival": 1},
    ],
}


@pytest.mark.vllm_versions(str(KV_HOLDING_DEADLOCK))
@pytest.mark.xfail(
    strict=True,
    raises=Deadlock,
    reason=(
        "vLLM bug: async KV loads are admitted without the blocks they need to "
        "resume; once they fill the pool, the request at the head of the waiting "
        "queue cannot allocate, nothing runs and nothing is preempted"
    ),
)
def test_async_loads_that_fill_the_pool_deadlock():
    from .test_mamba_state_property import _run

    _run("nixl", DEADLOCK_WORKLOAD)


#: Releases whose scheduler keeps multi-module MTP's prefill lookahead (it ends
#: no prefill chunk fewer than ``num_spec`` tokens before the prompt's end) next
#: to the Mamba align rule (a chunk that starts inside a block ends at that
#: block's end or at the prompt's end). NIXL's prefiller stops ``num_spec - 1``
#: tokens short, so with 3 or more MTP modules a remote prefill can resume inside
#: a block that ends fewer than ``num_spec`` tokens before the prompt does (a
#: prompt one token past a block boundary, with 3). The only chunk the align
#: rule allows is then one the lookahead forbids: the scheduler cuts it to
#: nothing, the request never runs, and as the head of the waiting queue it
#: blocks every request behind it. No fix in a release yet. Upstream: the
#: lookahead came with https://github.com/vllm-project/vllm/pull/50062
#: (scheduler support for multi-module MTP), whose chunk-boundary rule does not
#: meet the Mamba align rule; not reported yet.
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


#: The shrunk workload test_mamba_state_property.py found (v0.32.0 and v0.33.0,
#: stock and patched, NIXL, 3 MTP modules): one remote prefill of a 17-token
#: prompt. NIXL loads 15 tokens; the align rule allows the chunk 15..16 only,
#: which ends 1 token before the prompt does.
MTP_LOOKAHEAD_WORKLOAD = {
    "kv_role": "kv_both", "num_blocks": 400, "engine": "mtp3", "window": None,
    "seed": 0, "stored": [],
    "requests": [
        {"prefix": 0, "prefix_blocks": 1, "suffix": 1, "remote": True,
         "load_fails": False, "max_tokens": 1, "arrival": 0},
    ],
}


@pytest.mark.vllm_versions(str(MTP_LOOKAHEAD_HANG))
@pytest.mark.xfail(
    strict=True,
    raises=MtpLookaheadHang,
    reason=(
        "vLLM bug: with multi-module MTP (3+ modules) a NIXL remote prefill one "
        "token past a block boundary resumes inside the last full block; the Mamba "
        "align rule and the MTP prefill lookahead together leave it no chunk to "
        "schedule, and it never runs"
    ),
)
def test_multi_module_mtp_remote_prefill_past_a_block_boundary_hangs():
    from .test_mamba_state_property import _run

    _run("nixl", MTP_LOOKAHEAD_WORKLOAD)


#: Releases whose scheduler keeps a request among its in-flight prefills after
#: its async KV load failed with nothing valid (kv_load_failure_policy
#: "recompute": the blocks are freed and the request waits again). When the
#: request is admitted for another async load (a hash store such as the
#: OffloadingConnector's CPU tier still offers the chunks), the reservation the
#: scheduler keeps for in-flight prefills includes the request's own remaining
#: blocks: it must fit twice. In a pool too small for that it is never
#: admitted, though nothing else runs. Found with multi-module MTP (whose
#: lookahead blocks make the reservation larger), not specific to it. Upstream:
#: the stall behind the head of the queue is what
#: https://github.com/vllm-project/vllm/pull/57841 (open) addresses, for a head
#: that holds no blocks; its own limits name kv_load_failure_policy="recompute".
#: /issues/35541 reports a head-of-queue stall after a failed load (a fix was
#: tried in /pull/35570).
FAILED_LOAD_SELF_RESERVATION = SpecifierSet(">=0.32")


class SelfReservationHang(AssertionError):
    """A hang of :data:`FAILED_LOAD_SELF_RESERVATION`'s kind."""


def failed_load_self_reservation(sched, reqs) -> bool:
    """Whether nothing runs while an unfinished request waits holding no
    computed tokens, still counted among the in-flight prefills whose remaining
    blocks the scheduler reserves before admitting an async load."""
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


#: The same hang with NIXL alone (v0.33.0 stock and patched, n-gram drafts, a
#: sliding window, a 40-block pool): the 97-token remote prefill's load fails and
#: it waits at the head of the queue on its own reservation, so the remote
#: prefill behind it, whose load landed, is never promoted.
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


@pytest.mark.vllm_versions(str(FAILED_LOAD_SELF_RESERVATION))
@pytest.mark.xfail(
    strict=True,
    raises=SelfReservationHang,
    reason=(
        "vLLM bug: a request whose async KV load failed stays among the in-flight "
        "prefills; its next async load must fit beside its own reservation and, in "
        "a small pool, is never admitted"
    ),
)
@pytest.mark.parametrize("kind,workload", [
    pytest.param("nixl+offloading", SELF_RESERVATION_WORKLOAD, id="offloading-mtp3"),
    pytest.param("nixl", SELF_RESERVATION_NIXL_WORKLOAD, id="nixl-spec2"),
])
def test_retried_load_after_a_failed_one_reserves_its_own_blocks_and_hangs(kind, workload):
    from .test_mamba_state_property import _run

    _run(kind, workload)


#: Releases whose NIXL (bidirectional KV transfer) pulls the decoder's blocks for a
#: prefill instance's request of a hybrid model although the decoder's tokens reach
#: the prompt as NIXL truncated it: the pull covers the whole prompt, the request
#: resumes before its last token, and the decoder's Mamba state, loaded with the
#: pull, belongs at the decoder's tokens. divergent-hybrid-hit-resume-point gives no
#: resume point there, but the pull itself is stock's
#: (``NixlPullConnectorScheduler.get_num_new_matched_tokens``). Found by review;
#: not reported upstream yet. Bidirectional KV transfer is v0.32+'s.
DECODER_PULL_PAST_PROMPT = SpecifierSet(">=0.32")


@pytest.mark.vllm_versions(str(DECODER_PULL_PAST_PROMPT))
@pytest.mark.xfail(
    strict=True,
    raises=DecoderStatePastPrompt,
    reason=(
        "vLLM bug: NIXL pulls the decoder's blocks for a hybrid prompt the "
        "decoder's tokens cover; the request resumes on a Mamba state that "
        "belongs to another position"
    ),
)
@pytest.mark.parametrize("extra", [0, BLOCK_SIZE], ids=["whole-prompt", "past-prompt"])
def test_prefill_side_pull_of_the_whole_prompt_resumes_on_the_decoders_state(extra):
    from .test_mamba_state import (
        PREFIX,
        _decoder_blocks_params,
        _prefill_instance_with_prefix,
        _serve,
    )
    from ..builders import prompt, request

    sched, checker = _prefill_instance_with_prefix("nixl")
    tokens = PREFIX + prompt(2 * BLOCK_SIZE, seed=12)
    # NIXL truncates the prompt by its back-off (one token) on arrival.
    req = request(tokens, kv_transfer_params=_decoder_blocks_params(
        len(tokens) - 1 + extra))
    _serve(sched, checker, req)
