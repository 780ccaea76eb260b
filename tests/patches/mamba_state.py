"""The Mamba-state invariant, checked on a real Scheduler after every step.

A request on a hybrid model may start computing at a position p > 0 only if
the Mamba state at p is available:

- a cached Mamba block at the end of its local hit, holding the state of this
  request's own prefix (its block hash is the request's hash at that block), or
- a KV load for the request that leaves the request's own Mamba state at the
  resume point. What each connector leaves there is checked from what it
  moves, never from its class alone (:data:`LOAD_STATE_CHECKS`): NIXL moves
  the prefiller's running state, which belongs where the prefiller stopped
  (the prompt less NIXL's back-off), so a NIXL load must end exactly there.

A prefill instance's request (``do_remote_decode``: it computes the prompt and
keeps its KV for the decode instance to pull) is loaded by no NIXL pull, so it
takes exactly the local hit every KV cache group agrees on, as stock vLLM does
(:func:`prefill_side`); a load by another connector may then start there.

Breaking this is silent in a real engine: the linear-attention layers read a
state that belongs to no prefix of the request and the request returns wrong
tokens.

``MambaStateChecker`` observes the scheduler from outside: it wraps the
connector's ``get_num_new_matched_tokens`` (where the hit is decided: it
records the cached Mamba states the request finds then) and
``update_state_after_alloc`` (called once per admission, with the request's
blocks and the external tokens the scheduler took) and, after
``schedule()``, derives each admitted request's resume point from the real
request. It copies no vLLM logic: the state sources it accepts are the ground
truth of what each connector moves, not what the code under test believes.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from vllm.v1.core.kv_cache_utils import get_block_hash
from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec
from vllm.v1.request import RequestStatus

NIXL_CONNECTORS = frozenset({"NixlConnector", "NixlPullConnector", "NixlPushConnector"})


@dataclasses.dataclass
class Admission:
    """One admission of a request: what the scheduler handed the connector."""

    request_id: str
    external_tokens: int
    serving_connector: str | None  # class name of the connector that loads
    # where the state a NIXL remote prefill transfers belongs (the tokens the
    # prefiller computes), or None for a request that is not a remote prefill
    prefiller_end: int | None = None
    # per Mamba group: block index -> hash of the cached block found for the
    # request's own prefix at that index when it was admitted (the state a
    # hit there reads; releases up to v0.2x hand that block to the request,
    # later ones copy its state into a fresh block)
    cached_states: list[dict[int, Any]] = dataclasses.field(default_factory=list)
    resume_point: int | None = None
    # for a prefill instance's request (prefill_side), the local hit every KV
    # cache group agreed on when the connector was asked; else None
    agreed_hit: int | None = None
    # a prefill instance's pull of the decoder's blocks where the decoder's
    # tokens (and its Mamba state) reach the prompt: NIXL pulls the whole
    # prompt, and no resume point has the decoder's state
    decoder_past_prompt: bool = False


class MambaStateViolation(AssertionError):
    pass


class DecoderStatePastPrompt(MambaStateViolation):
    """A prefill instance pulled the decoder's blocks although the decoder's
    tokens reach the prompt: the request resumes on the decoder's Mamba state,
    which belongs to another position (a vLLM bug, stock and patched:
    test_upstream_known_issues.py)."""


class AgreedHitViolation(AssertionError):
    """A prefill instance's request took a local hit other than the one every KV
    cache group agrees on (stock's): nothing it is owed restores a deeper one."""


def prefill_side(request: Any) -> bool:
    """Whether ``request`` is a prefill instance's request of a PD pair: it
    computes its prompt and keeps the KV for the decode instance to pull
    (``do_remote_decode``). One that also pulls KV the decode instance holds
    (NIXL's bidirectional transfer, ``remote_block_ids``) is not."""
    params = request.kv_transfer_params or {}
    return bool(params.get("do_remote_decode") and not params.get("do_remote_prefill")
                and not params.get("remote_block_ids"))


class Deadlock(AssertionError):
    """The scheduler can make no progress: nothing runs, and every unfinished
    request waits holding KV blocks (see :func:`deadlock`)."""


def deadlock(sched: Any, reqs: Any) -> str | None:
    """Why ``sched`` is stuck with ``reqs`` unfinished, or None if it is not in
    that state: no request runs and every unfinished one holds the KV of a load
    or of its own computed tokens while it waits for blocks, which only a
    running request (or a preemption of a waiting one, which vLLM never does)
    could free."""
    stuck = [r for r in reqs if not r.is_finished()]
    if not stuck or sched.running:
        return None
    holding = [r for r in stuck if r.num_computed_tokens > 0
               or r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
    if not holding:
        return None
    free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    return (f"nothing runs, {free} free blocks, waiting: " + ", ".join(
        f"{r.request_id} ({r.status.name}, {r.num_computed_tokens}/{r.num_tokens})"
        for r in stuck))


class RecomputeViolation(AssertionError):
    """A remote prefill recomputes prompt tokens that NIXL would have loaded."""


def _serving_connector(connector: Any, request_id: str) -> str | None:
    children = getattr(connector, "_connectors", None)
    if children is None:
        return type(connector).__name__
    chosen = connector._requests_to_connector.get(request_id)
    return None if chosen is None else type(children[chosen]).__name__


def _prefiller_end(connector: Any, request: Any) -> int | None:
    """Where the Mamba state of ``request``'s remote prefill belongs: the
    prefiller computes the prompt less NIXL's back-off (one token on releases
    without ``_prefill_backoff``) and transfers its running state there; or,
    for a prefill instance's request with the decoder's blocks, where the
    decoder's Mamba state is."""
    params = request.kv_transfer_params
    if params and params.get("do_remote_decode") and params.get("remote_block_ids"):
        # A prefill instance's pull of the decoder's blocks (bidirectional KV
        # transfer) brings the decoder's Mamba state, which is at the decoder's
        # tokens: at the prompt or past it, no resume point of the request has
        # it (decoder_past_prompt flags that case).
        return params.get("remote_num_tokens") or 0
    if not (params and params.get("do_remote_prefill")):
        return None
    nixl = next(
        (c for c in getattr(connector, "_connectors", [connector])
         if type(c).__name__ in NIXL_CONNECTORS),
        None,
    )
    if nixl is None:
        return None
    backoff_fn = getattr(nixl.connector_scheduler, "_prefill_backoff", None)
    backoff = backoff_fn() if backoff_fn is not None else 1
    n = len(request.prompt_token_ids)
    return n - backoff if backoff and n > backoff else n


def decoder_past_prompt(request: Any) -> bool:
    """Whether ``request`` is a prefill instance's request whose decoder holds
    blocks (and its Mamba state) for at least its whole prompt, as NIXL
    truncated it: a pull of them ends before the decoder's state."""
    params = request.kv_transfer_params
    return bool(params and params.get("do_remote_decode")
                and params.get("remote_block_ids")
                and (params.get("remote_num_tokens") or 0) >= len(request.prompt_token_ids))


def _nixl_state_problem(adm: Admission) -> str | None:
    if adm.prefiller_end is None:
        return "NIXL loaded for a request that is not a remote prefill"
    if adm.decoder_past_prompt:
        return (f"the decoder's state is at {adm.prefiller_end}, at or past the "
                "prompt: a pull of the whole prompt resumes the request elsewhere")
    if adm.resume_point != adm.prefiller_end:
        return (f"the transferred state belongs at {adm.prefiller_end}, "
                f"not at the resume point")
    return None


# What the load of each connector leaves at the resume point, from what it
# moves: a check returns why that is not the request's own state, or None.
# DecodeBench writes every group it loads (the Mamba block at the resume point
# included) with dummy values: it proves nothing about outputs, and its loads
# are taken as restoring what it declares. A connector not listed here may
# load only on top of a local hit whose own Mamba state is cached.
LOAD_STATE_CHECKS = {
    **{name: _nixl_state_problem for name in NIXL_CONNECTORS},
    "DecodeBenchConnector": lambda adm: None,
}


class MambaStateChecker:
    """Checks every admission of ``sched`` against the invariant.

    Call :meth:`after_schedule` with each ``SchedulerOutput`` (the
    :func:`checked_step` helper does). ``admissions`` keeps every checked
    admission, so a test can also assert *which* state a request resumed from.

    ``load_checks``: the load checks of connectors beyond
    :data:`LOAD_STATE_CHECKS` (a hash store's, which needs its stored keys).
    ``check_recompute``: also the cost side (:meth:`recompute_problem`).
    """

    def __init__(self, sched: Any, load_checks: dict | None = None,
                 check_recompute: bool = False):
        self.sched = sched
        self.load_checks = {**LOAD_STATE_CHECKS, **(load_checks or {})}
        self.check_recompute = check_recompute
        self.admitted: set[str] = set()
        # Per request, the KV loads the scheduler started (admissions with
        # external tokens).
        self.load_starts: collections.Counter[str] = collections.Counter()
        self.block_size = sched.block_size
        groups = sched.kv_cache_config.kv_cache_groups
        self.mamba_group_ids = [
            i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)
        ]
        # Sliding-window groups, with their window: a resumed request must find
        # its own blocks for the window before the resume point (see check()).
        self.window_groups = {
            i: g.kv_cache_spec.sliding_window for i, g in enumerate(groups)
            if isinstance(g.kv_cache_spec, SlidingWindowSpec)
        }
        self.pending: dict[str, Admission] = {}
        self.admissions: list[Admission] = []
        # Requests whose async load was checked when it started: the request
        # is admitted again once the load finished, at the loaded position.
        self.loaded: dict[str, int] = {}
        # The cached Mamba states each request found when the connector was
        # asked for its external tokens: the moment the hit is decided. A load
        # on top of a local hit is checked against these (allocate_slots may
        # free, and reuse, the local Mamba block the load makes redundant); a
        # local hit alone against what is cached after allocate_slots.
        self._at_match: dict[str, list[dict[int, Any]]] = {}
        self._prefiller_end: dict[str, int | None] = {}
        self._agreed: dict[str, int] = {}
        connector = sched.connector
        if connector is not None:
            original_match = connector.get_num_new_matched_tokens
            original = connector.update_state_after_alloc

            def get_num_new_matched_tokens(request, num_computed_tokens):
                self._at_match[request.request_id] = self._cached_states(request)
                self._prefiller_end[request.request_id] = _prefiller_end(
                    connector, request
                )
                if prefill_side(request):
                    # The lookup stock makes (a lookup only: nothing is allocated).
                    self._agreed[request.request_id] = (
                        sched.kv_cache_manager.get_computed_blocks(request)[1]
                    )
                return original_match(request, num_computed_tokens)

            def update_state_after_alloc(request, blocks, num_external_tokens):
                if num_external_tokens > 0:
                    self.load_starts[request.request_id] += 1
                cached = self._at_match.pop(request.request_id, None)
                if num_external_tokens == 0 or cached is None:
                    cached = self._cached_states(request)
                self.pending[request.request_id] = Admission(
                    request_id=request.request_id,
                    external_tokens=num_external_tokens,
                    serving_connector=(
                        _serving_connector(connector, request.request_id)
                        if num_external_tokens > 0
                        else None
                    ),
                    prefiller_end=self._prefiller_end.pop(request.request_id, None),
                    decoder_past_prompt=decoder_past_prompt(request),
                    cached_states=cached,
                    agreed_hit=self._agreed.pop(request.request_id, None),
                )
                return original(request, blocks, num_external_tokens)

            connector.get_num_new_matched_tokens = get_num_new_matched_tokens
            connector.update_state_after_alloc = update_state_after_alloc
        self._before: dict[str, RequestStatus] = {}

    def _cached_states(self, req: Any) -> list[dict[int, Any]]:
        pool = self.sched.kv_cache_manager.block_pool
        out = []
        for gid in self.mamba_group_ids:
            found = {}
            for i, h in enumerate(req.block_hashes):
                cached = pool.get_cached_block(h, [gid])
                if cached is not None and cached[0].block_hash is not None:
                    found[i] = get_block_hash(cached[0].block_hash)
            out.append(found)
        return out

    def before_schedule(self) -> None:
        self._before = {rid: r.status for rid, r in self.sched.requests.items()}

    def after_schedule(self, output: Any) -> None:
        for rid, adm in list(self.pending.items()):
            req = self.sched.requests.get(rid)
            if req is None:
                del self.pending[rid]
                continue
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                adm.resume_point = req.num_computed_tokens
                self.loaded[rid] = adm.resume_point
            elif rid in output.num_scheduled_tokens:
                adm.resume_point = (
                    req.num_computed_tokens - output.num_scheduled_tokens[rid]
                )
            else:  # admitted, then not scheduled after all (no room)
                continue
            del self.pending[rid]
            if self.loaded.get(rid) == adm.resume_point and adm.external_tokens == 0:
                del self.loaded[rid]  # scheduled after its load: checked then
                continue
            self.admissions.append(adm)
            self.check(req, adm)
        # Without a connector nothing is loaded: admissions are found by status.
        if self.sched.connector is None:
            for rid in output.num_scheduled_tokens:
                req = self.sched.requests[rid]
                if self._before.get(rid) in (RequestStatus.RUNNING, None):
                    continue
                adm = Admission(
                    rid, 0, None, self._cached_states(req),
                    req.num_computed_tokens - output.num_scheduled_tokens[rid],
                )
                self.admissions.append(adm)
                self.check(req, adm)

    def check(self, req: Any, adm: Admission) -> None:
        assert adm.resume_point is not None
        first = req.request_id not in self.admitted
        self.admitted.add(req.request_id)
        if adm.agreed_hit is not None:
            local = adm.resume_point - adm.external_tokens
            if local != adm.agreed_hit:
                raise AgreedHitViolation(
                    f"{req.request_id} (do_remote_decode) resumes at "
                    f"{adm.resume_point} on a local hit of {local} "
                    f"({adm.external_tokens} external from {adm.serving_connector}), "
                    f"not on the hit every group agrees on ({adm.agreed_hit})"
                )
        if self.check_recompute and first:
            problem = self.recompute_problem(adm)
            if problem:
                raise RecomputeViolation(f"{req.request_id}: {problem}")
        if adm.resume_point and self.window_groups:
            problem = self.window_problem(req, adm)
            if problem:
                raise MambaStateViolation(
                    f"{req.request_id} resumes at {adm.resume_point} (local hit "
                    f"{adm.resume_point - adm.external_tokens}, {adm.external_tokens} "
                    f"external from {adm.serving_connector}): {problem}"
                )
        if adm.resume_point == 0 or not self.mamba_group_ids:
            return
        local = adm.resume_point - adm.external_tokens
        load_check = self.load_checks.get(adm.serving_connector or "")
        if adm.external_tokens > 0 and load_check is not None:
            problem = load_check(adm)
        elif local == 0:
            return  # a load on top of no local hit brings its own state
        else:
            problem = self.local_state_problem(req, local, adm)
        if problem:
            violation = (DecoderStatePastPrompt if adm.decoder_past_prompt
                         and adm.external_tokens > 0 else MambaStateViolation)
            raise violation(
                f"{req.request_id} resumes at {adm.resume_point} (local hit {local}, "
                f"{adm.external_tokens} external from {adm.serving_connector}): "
                f"{problem}"
            )

    @staticmethod
    def recompute_problem(adm: Admission) -> str | None:
        """The cost side of the invariant, on a remote prefill's first admission:
        the prefiller computed the prompt up to ``prefiller_end`` and NIXL moves
        its KV and the Mamba state there, so resuming earlier recomputes tokens a
        restoring load would have delivered (a local hit of length - 1 included).
        A MultiConnector child before NIXL that matches serves instead, by the
        MultiConnector's order: that is the operator's choice, not a lost load."""
        if adm.prefiller_end is None or adm.resume_point >= adm.prefiller_end:
            return None
        if adm.external_tokens > 0 and adm.serving_connector not in NIXL_CONNECTORS:
            return None
        return (f"resumes at {adm.resume_point} ({adm.external_tokens} external from "
                f"{adm.serving_connector}), recomputing "
                f"{adm.prefiller_end - adm.resume_point} tokens up to "
                f"{adm.prefiller_end} that NIXL would have loaded with their Mamba state")

    def window_problem(self, req: Any, adm: Admission) -> str | None:
        """Why a sliding-window group lacks the request's own KV inside the window
        before the resume point, or None. The token at the resume point attends to
        the ``window - 1`` tokens before it. The load writes the blocks of its
        external tokens; NIXL writes every unhashed block it is handed, which for a
        sliding-window group is the tail of the request's blocks (the per-group hit
        can leave a window group's hit shorter than full attention's). Any other
        block there must be a cached block of this request's own prefix. A null
        block there is KV the model reads and nobody writes."""
        bs = self.block_size
        local = adm.resume_point - adm.external_tokens
        nixl = adm.external_tokens > 0 and adm.serving_connector in NIXL_CONNECTORS
        blocks = self.sched.kv_cache_manager.get_blocks(req.request_id).blocks
        for gid, window in self.window_groups.items():
            first = max(0, adm.resume_point - (window - 1)) // bs
            # NIXL's clip of a window group: the last cdiv(window, bs) + 1 blocks.
            nixl_tail = -(-adm.resume_point // bs) - (-(-window // bs) + 1)
            for i in range(first, -(-adm.resume_point // bs)):
                block = blocks[gid][i]
                if block.is_null:
                    return (f"sliding-window group {gid} block {i} inside the window "
                            "is the null block")
                if i >= -(-local // bs):
                    continue  # the load's own blocks
                if block.block_hash is None and nixl and i >= nixl_tail:
                    continue
                if block.block_hash is None:
                    return (f"sliding-window group {gid} has no cached block {i} "
                            "inside the window")
                if get_block_hash(block.block_hash) != req.block_hashes[i]:
                    return (f"sliding-window group {gid} block {i} holds another "
                            "prefix's KV")
        return None

    def local_state_problem(self, req: Any, local: int, adm: Admission) -> str | None:
        """Why the Mamba state at the end of a local hit of ``local`` tokens is
        not the request's own, or None when every Mamba group holds it."""
        if local % self.block_size:
            return f"the local hit ends inside a block ({local} % {self.block_size})"
        index = local // self.block_size - 1
        want = req.block_hashes[index]
        for gid, cached in zip(self.mamba_group_ids, adm.cached_states):
            state = cached.get(index)
            if state is None:
                return f"Mamba group {gid} has no cached state at block {index}"
            if state != want:
                return f"Mamba group {gid} block {index} holds another prefix's state"
        return None


def checked_schedule(sched: Any, checker: MambaStateChecker):
    checker.before_schedule()
    output = sched.schedule()
    checker.after_schedule(output)
    return output


def _load_failure(sched: Any, failing: set[str]) -> dict[str, Any]:
    """How the worker reports that the async KV loads of ``failing`` failed:
    per request where the release has ``failed_recving`` (it rejects
    block-level reports for several KV cache groups), else the blocks the load
    was writing, in every group (what NIXL reports under the hybrid allocator
    once fixed): the request's blocks not cached yet, not the local hit it
    shares with others."""
    from vllm.v1.outputs import KVConnectorOutput

    if not failing:
        return {}
    if "failed_recving" in {f.name for f in dataclasses.fields(KVConnectorOutput)}:
        return {"failed_recving": set(failing)}
    manager = sched.kv_cache_manager
    return {
        "invalid_block_ids": {
            b.block_id
            for rid in failing
            for group in manager.get_blocks(rid).blocks
            for b in group
            if b.block_hash is None and not b.is_null
        }
    }


def checked_step(sched: Any, checker: MambaStateChecker, failing=frozenset()):
    """One engine step checked by ``checker``: the worker samples a token for every
    scheduled request and finishes every KV load in flight; the loads of the
    requests in ``failing`` fail."""
    from .builders import model_runner_output

    output = checked_schedule(sched, checker)
    reqs = [sched.requests[rid] for rid in output.num_scheduled_tokens]
    loading = {
        rid for rid, r in sched.requests.items()
        if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    }
    sched.update_from_output(
        output,
        model_runner_output(
            reqs, loading or None, **_load_failure(sched, loading & set(failing))
        ),
    )
    return output


class Driver:
    """Drives a checked scheduler the way vLLM's engine core does.

    One batch at a time (``EngineCore.step``), or with ``async_scheduling`` two in
    flight: the next batch is scheduled before the previous one's output is applied
    (``EngineCore.step_with_batch_queue``, queue size 2). The worker samples one
    token per scheduled request, finishes every KV load in flight (the first
    load of each request in ``failing`` fails), and with ``num_spec`` drafts it
    proposes that many draft tokens for every running request after each step
    and accepts a random number of those it was scheduled (``rng``), as a real
    verifier may. N-gram and MTP drafts reach the scheduler the same way after a
    synchronous step (``EngineCore.post_step``: ``take_draft_token_ids`` then
    ``update_draft_token_ids``, which drops a prefill chunk's drafts).
    ``worker``: a hash-store connector's stand-in worker
    (:class:`~.hash_stores.OffloadingWorker`, which completes the transfer jobs
    of each batch in that batch's output, or :class:`~.hash_stores.LMCacheWorker`,
    which completes the stores of finished requests).

    On a prefill instance, a finished :func:`prefill_side` request keeps its
    blocks (NIXL's ``request_finished`` holds them for the decode instance's
    pull) until the worker reports it in ``finished_sending``: the pull
    completes a random number of steps later (``rng``), and the report of a
    MultiConnector waits for it (a request is reported once, when every child
    is done with it). The scheduler runs steps while blocks are held, as
    vLLM's engine core does for a connector's delayed frees.
    """

    def __init__(self, sched: Any, checker: MambaStateChecker, failing=frozenset(),
                 num_spec: int = 0, async_scheduling: bool = False, rng: Any = None,
                 worker: Any = None):
        import random

        self.sched, self.checker, self.failing = sched, checker, set(failing)
        self.worker = worker
        self.num_spec, self.async_scheduling = num_spec, async_scheduling
        self.rng = rng or random.Random(0)
        self.in_flight: collections.deque = collections.deque()
        # Per request, the loads whose end a worker output reported: a load ends
        # once (with two batches in flight, it is still waiting when the next one
        # is scheduled), and a request may start another (a failed load recomputed
        # from a hit another connector then loads, even within one schedule()).
        self.reported: dict[str, int] = {}
        # Prefill-side requests whose decode instance's pull completed.
        self.pulled: set[str] = set()

    def held(self) -> set[str]:
        """Finished requests whose blocks a connector still holds."""
        return {rid for rid, r in self.sched.requests.items() if r.is_finished()}

    def step(self) -> None:
        if self.sched.has_requests() or self.held():
            output = checked_schedule(self.sched, self.checker)
            self.in_flight.appendleft((output, self._worker_output(output)))
            if self.async_scheduling and len(self.in_flight) < 2:
                return
        if self.in_flight:
            output, result = self.in_flight.pop()
            self.sched.update_from_output(output, result)
            self._propose_drafts()

    def _worker_output(self, output: Any) -> Any:
        from .builders import model_runner_output

        reqs = [self.sched.requests[rid] for rid in output.num_scheduled_tokens]
        waiting = {
            rid for rid, r in self.sched.requests.items()
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        }
        loading = {rid for rid in waiting
                   if self.checker.load_starts[rid] > self.reported.get(rid, 0)}
        self.reported.update((rid, self.checker.load_starts[rid]) for rid in loading)
        accepted = {
            rid: self.rng.randint(0, len(drafts))
            for rid, drafts in (getattr(output, "scheduled_spec_decode_tokens", {}) or {}).items()
        }
        # As the model runner: a batch that leaves a request short of its tokens
        # (a prompt chunk, or a resumed request's recompute that stops at a
        # Mamba-aligned point before its earlier outputs end) samples nothing.
        sampling = {r.request_id for r in reqs if not r.is_prefill_chunk}
        # A request's first load fails (a transfer that breaks); the load that
        # recovers it, from whatever hit it then finds, goes through.
        failed = loading & self.failing
        self.failing -= failed
        result = model_runner_output(
            reqs, loading or None, num_accepted=accepted, sampling=sampling,
            **_load_failure(self.sched, failed),
        )
        if self.worker is not None:
            self.worker.report(output, result)
        self._report_pulls(result)
        return result

    def _report_pulls(self, result: Any) -> None:
        """Complete the decode instance's pull of some held prefill-side requests
        (each at most once) in ``result``; one not pulled yet is not reported
        finished by any other child's report either."""
        from vllm.v1.outputs import KVConnectorOutput

        waiting = {rid for rid in self.held() - self.pulled
                   if prefill_side(self.sched.requests[rid])}
        if not waiting:
            return
        pulled = {rid for rid in sorted(waiting) if self.rng.random() < 0.5}
        self.pulled |= pulled
        if result.kv_connector_output is None:
            result.kv_connector_output = KVConnectorOutput()
        out = result.kv_connector_output
        out.finished_sending = (set(out.finished_sending or ()) - waiting) | pulled

    def _propose_drafts(self) -> None:
        if not self.num_spec:
            return
        from vllm.v1.outputs import DraftTokenIds

        ids = [r.request_id for r in self.sched.running if not r.is_finished()]
        self.sched.update_draft_token_ids(
            DraftTokenIds(ids, [[8] * self.num_spec for _ in ids]))

