"""Decode-side hits of hybrid models keep the Mamba-state invariant.

Patches: coordinator-consumer-skips-mamba-hit and
kv-manager-remote-prefill-skip-mamba. A decode instance that served a
remote-prefill request holds the attention blocks of its prefix but no Mamba
state inside it. A later request sharing the prefix may take the attention
hit only if its KV load restores the Mamba state at the end (NIXL does);
every other request (plain requests sent straight to the decode instance,
prompts one token longer than the cached prefix, requests a non-restoring
MultiConnector child serves, requests resumed after preemption) must fall
back to the hit every group agrees on. Each test runs a real Scheduler with
real connectors, checks every admission with :class:`MambaStateChecker`
(which state the model will read), and then the hit it expects.
"""

import pytest

from ..builders import (
    BLOCK_SIZE,
    connectors,
    hybrid_kv_cache_config,
    prompt,
    remote_prefill_params,
    request,
    scheduler,
    vllm_config,
)
from ..mamba_state import (
    STATE_RESTORING_CONNECTORS,
    MambaStateChecker,
    checked_step,
)

CONSUMER = "coordinator-consumer-skips-mamba-hit"
PER_REQUEST = "kv-manager-remote-prefill-skip-mamba"
PREFIX = prompt(4 * BLOCK_SIZE, seed=1)


def _patches(fn):
    return pytest.mark.patch(CONSUMER)(pytest.mark.patch(PER_REQUEST)(fn))


def _serve(sched, checker, req):
    """Admit ``req`` and drive it until its prompt is computed (loads finish
    one step after they start)."""
    sched.add_request(req)
    for _ in range(4 * req.num_prompt_tokens):
        checked_step(sched, checker)
        if req.num_computed_tokens >= req.num_prompt_tokens:
            return
    raise AssertionError(f"{req.request_id} did not get through its prompt")


def _decode_instance(kind, kv_role, num_blocks=1000, kv_load_failure_policy="fail"):
    """A decode instance that served one remote-prefill request whose prompt
    starts with PREFIX: its attention blocks are cached, its Mamba groups hold
    no state inside PREFIX."""
    sched = scheduler(
        vllm_config(**connectors(kind, kv_role), kv_load_failure_policy=kv_load_failure_policy),
        hybrid_kv_cache_config(num_blocks=num_blocks),
    )
    checker = MambaStateChecker(sched)
    first = request(PREFIX + prompt(2 * BLOCK_SIZE, seed=2),
                    kv_transfer_params=remote_prefill_params(6))
    _serve(sched, checker, first)
    return sched, checker


def _admission(checker, req):
    return next(a for a in checker.admissions if a.request_id == req.request_id)


@_patches
@pytest.mark.parametrize("kind", ["nixl", "nixl+decodebench"])
@pytest.mark.parametrize("kv_role", ["kv_consumer", "kv_both"])
def test_remote_prefill_keeps_attention_hit_and_loads_the_state(kind, kv_role):
    # The seed's effect: the prefix comes from the local cache, NIXL pulls the
    # rest and the Mamba state at its end. NIXL alone: upstream's behaviour from
    # v0.28 (parity); with DecodeBench configured too, stock v0.32+ has no hit.
    sched, checker = _decode_instance(kind, kv_role)
    second = request(PREFIX + prompt(2 * BLOCK_SIZE, seed=3),
                     kv_transfer_params=remote_prefill_params(6))
    _serve(sched, checker, second)
    adm = _admission(checker, second)
    assert adm.resume_point - adm.external_tokens == len(PREFIX)
    assert adm.serving_connector in STATE_RESTORING_CONNECTORS


@_patches
@pytest.mark.parametrize("kind", ["nixl", "nixl+decodebench"])
@pytest.mark.parametrize("kv_role", ["kv_consumer", "kv_both"])
def test_plain_request_on_decode_instance_gets_no_stateless_hit(kind, kv_role):
    # A router sends a short prompt straight to the decode pool: no load brings
    # a Mamba state (NIXL loads nothing; DecodeBench does not restore one).
    sched, checker = _decode_instance(kind, kv_role)
    plain = request(PREFIX + prompt(2 * BLOCK_SIZE, seed=4))
    _serve(sched, checker, plain)  # the checker raises on a stateless resume
    adm = _admission(checker, plain)
    assert adm.resume_point - adm.external_tokens == 0


@_patches
@pytest.mark.parametrize("kind", ["nixl", "nixl+decodebench"])
@pytest.mark.parametrize("kv_role", ["kv_consumer", "kv_both"])
def test_prompt_one_token_past_the_cached_prefix_falls_back(kind, kv_role):
    # Local hit = prompt length - 1: NIXL has nothing left to load, so no
    # Mamba state arrives at the resume point.
    sched, checker = _decode_instance(kind, kv_role)
    req = request(PREFIX + [5], kv_transfer_params=remote_prefill_params(5))
    _serve(sched, checker, req)
    adm = _admission(checker, req)
    assert adm.external_tokens == 0
    assert adm.resume_point == 0


@_patches
@pytest.mark.parametrize("kv_role", ["kv_consumer", "kv_both"])
def test_non_restoring_child_first_falls_back(kv_role):
    # MultiConnector(DecodeBench, NIXL): DecodeBench matches first and serves
    # the remote-prefill request, but restores no Mamba state, so the deeper
    # attention hit is not taken.
    sched, checker = _decode_instance("decodebench+nixl", kv_role)
    req = request(PREFIX + prompt(2 * BLOCK_SIZE, seed=5),
                  kv_transfer_params=remote_prefill_params(6))
    _serve(sched, checker, req)
    adm = _admission(checker, req)
    assert adm.resume_point - adm.external_tokens == 0


# On v0.20.2 DecodeBench does not support the hybrid allocator: MultiConnector
# asserts a single KV cache group when a request it served finishes.
FINISHING_KINDS = [
    "nixl",
    pytest.param("nixl+decodebench", marks=pytest.mark.vllm_versions(">=0.23")),
]


@_patches
@pytest.mark.parametrize("kind", FINISHING_KINDS)
def test_preempted_request_resumes_only_where_state_is_cached(kind):
    # A small pool: the decode instance admits remote-prefill requests sharing
    # PREFIX with the attention hit, then runs out of blocks while they decode
    # and preempts. A preempted request has no load any more (NIXL clears
    # do_remote_prefill after the first allocation): it must resume from the
    # hit every group agrees on.
    sched, checker = _decode_instance(kind, "kv_consumer", num_blocks=48)
    reqs = [
        request(PREFIX + prompt(2 * BLOCK_SIZE, seed=10 + i),
                kv_transfer_params=remote_prefill_params(6), max_tokens=40)
        for i in range(4)
    ]
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
    # Every preemption was re-admitted, and checked, once more.
    readmitted = [a for a in checker.admissions if a.request_id in {r.request_id for r in reqs}]
    assert len(readmitted) > len(reqs)


@_patches
@pytest.mark.parametrize("kind", FINISHING_KINDS)
@pytest.mark.parametrize("kv_role", ["kv_consumer", "kv_both"])
def test_failed_load_over_the_attention_hit_recomputes_from_zero(kind, kv_role):
    # The second request takes the attention hit and NIXL's load of the rest
    # (and of the Mamba state) fails. Retried, NIXL has nothing to load any
    # more, and the attention hit alone has no Mamba state at its end: the
    # retry starts from 0 (or from what DecodeBench loads from 0, where it is
    # configured).
    sched, checker = _decode_instance(kind, kv_role, kv_load_failure_policy="recompute")
    req = request(PREFIX + prompt(2 * BLOCK_SIZE, seed=6),
                  kv_transfer_params=remote_prefill_params(6))
    sched.add_request(req)
    checked_step(sched, checker, failing={req.request_id})
    for _ in range(8 * req.num_prompt_tokens):
        checked_step(sched, checker)
        if req.num_computed_tokens >= req.num_prompt_tokens:
            break
    first, retry = [a for a in checker.admissions if a.request_id == req.request_id]
    assert first.resume_point - first.external_tokens == len(PREFIX)
    assert first.serving_connector in STATE_RESTORING_CONNECTORS
    assert retry.resume_point - retry.external_tokens == 0
    assert retry.serving_connector in (None, "DecodeBenchConnector")
    assert req.num_computed_tokens >= req.num_prompt_tokens
