"""vLLM bugs on hybrid models that this patch series does not fix (yet).

Each test reproduces the bug on a real Scheduler and is a strict xfail: it
fails while the bug is there, on stock and patched builds alike, and turns red
(XPASS) the day a pin carries a fix, so the exclusion it justifies elsewhere
can be removed. (The synchronous load over a local hit on a full pool, found
here first, is fixed by mamba-align-admission-counts-sync-load:
tests/patches/scheduler/test_sync_load_admission.py; a failed async load's
retry that waited on its own reservation, by failed-load-retry-admission:
test_scheduler_hangs.py; a multi-module MTP remote prefill past a block
boundary, by mamba-align-mtp-lookahead-chunk: test_scheduler_hangs.py.)
"""

import pytest
from packaging.specifiers import SpecifierSet

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
#: has none). Not backported to v0.20.2: #44560 is not a small change there (a
#: reservation parameter through ``KVCacheManager.allocate_slots``, the set of
#: in-flight prefills kept at admission, promotion, preemption and finish, the
#: remaining-block count per request through the coordinator, whose v0.20.2
#: signature differs), and this workload's speculative-decoding part needs #57104
#: on top; this series' v0.32.0 and v0.33.0 pins have both
#: (``_inflight_prefill_reserved_blocks``, ``_spec_decode_step_blocks``).
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


#: Releases whose NIXL (bidirectional KV transfer) pulls the decoder's blocks for a
#: prefill instance's request of a hybrid model although the decoder's tokens reach
#: the prompt as NIXL truncated it: the pull covers the whole prompt, the request
#: resumes before its last token, and the decoder's Mamba state, loaded with the
#: pull, belongs at the decoder's tokens. divergent-hybrid-hit-resume-point gives no
#: resume point there, but the pull itself is stock's
#: (``NixlPullConnectorScheduler.get_num_new_matched_tokens``). Found by review;
#: the upstream bug report: docs/upstream-issues/vllm-nixl-decoder-pull-covers-hybrid-prompt.md. Bidirectional KV transfer is v0.32+'s.
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
