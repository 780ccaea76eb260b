"""What vLLM's KV events tell a router about a hybrid model (align mode).

A prefix-aware router (vllm-router's ``kv_aware``, llm-d, Dynamo) learns which
instance holds which prefix from the ``BlockStored`` / ``BlockRemoved`` events
the scheduler publishes. These tests record the batches the real Scheduler
hands its event publisher, for a hybrid KV cache (one full-attention group and
Mamba groups in ``mamba_cache_mode="align"``), and say exactly what they carry
on every pin:

- every group publishes its own events (``group_idx``; ``kv_cache_spec_kind``
  from v0.32), with ``block_size`` the group's block size: the scheduler's
  (realigned) block size, which a router's ``--kv-event-block-size`` must equal;
- a Mamba group caches only the blocks that hold a state (the block where a
  scheduled chunk ended). Stock lists those hashes alone in a ``BlockStored``
  whose ``token_ids`` still span every block of the range, the skipped ones too
  (vllm#44451): a consumer that pairs ``block_hashes[i]`` with the i-th
  ``block_size`` chunk of ``token_ids`` pairs the state's hash with the
  prompt's first tokens. With ``kv-events-stored-per-block-run`` the pool
  publishes one ``BlockStored`` per run of consecutive cached blocks: each
  hash with its own tokens, the run's parent the hash of the block before it;
- the full-attention group announces every prefix block, also those inside
  which no Mamba state is cached: a router that scores on them predicts a hit
  vLLM does not have (it resumes only where a Mamba state is cached). Read per
  group and intersected (a prefix counts up to its last block whose hash is in
  every Mamba group), the hashes give vLLM's own hit.
"""

from __future__ import annotations

import pytest

from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.request import RequestStatus

from ..builders import (
    BLOCK_SIZE,
    cached_hit_tokens,
    hybrid_kv_cache_config,
    prompt,
    request,
    run_local_prefill,
    scheduler,
    vllm_config,
)

#: The patch that makes every ``BlockStored`` pair each hash with its own tokens.
PER_RUN = "kv-events-stored-per-block-run"
NUM_MAMBA_GROUPS = 3
#: The first prompt: five full blocks and three tokens, prefilled in one chunk.
PROMPT_BLOCKS = 5


class EventLog:
    """The KV event batches the scheduler publishes, in order (its publisher is
    vLLM's null publisher; only ``publish`` is recorded)."""

    def __init__(self, sched) -> None:
        self.events: list = []
        sched.kv_event_publisher.publish = lambda batch: self.events.extend(batch.events)

    def take(self) -> list:
        events, self.events = self.events, []
        return events


def events_scheduler(num_blocks: int = 200, max_num_batched_tokens: int = 1024):
    """A hybrid instance without a KV connector, KV events on, and its log."""
    config = vllm_config(kv_role=None, max_num_batched_tokens=max_num_batched_tokens)
    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    sched = scheduler(
        config, hybrid_kv_cache_config(num_blocks=num_blocks, num_mamba_groups=NUM_MAMBA_GROUPS)
    )
    return sched, EventLog(sched)


def stored_by_group(events) -> dict[int, list[BlockStored]]:
    out: dict[int, list[BlockStored]] = {}
    for event in events:
        if isinstance(event, BlockStored):
            out.setdefault(event.group_idx, []).append(event)
    return out


def external_hashes(req) -> list:
    """The request's block hashes as events publish them."""
    return [maybe_convert_block_hash(h) for h in req.block_hashes]


def first_prefill():
    sched, log = events_scheduler()
    req = request(prompt(PROMPT_BLOCKS * BLOCK_SIZE + 3))
    run_local_prefill(sched, req)
    return sched, log, req


def test_each_group_publishes_its_blocks_at_the_schedulers_block_size():
    sched, log, req = first_prefill()
    stored = stored_by_group(log.take())
    hashes = external_hashes(req)

    assert sorted(stored) == list(range(1 + NUM_MAMBA_GROUPS))
    [attention] = stored[0]
    assert attention.block_hashes == hashes[:PROMPT_BLOCKS]
    assert attention.token_ids == req.prompt_token_ids[: PROMPT_BLOCKS * BLOCK_SIZE]
    assert attention.parent_block_hash is None
    # The block size every group's events carry is the scheduler's: the one a
    # router must chunk prompts by (--kv-event-block-size).
    assert sched.block_size == BLOCK_SIZE
    for group, events in stored.items():
        for event in events:
            assert event.block_size == sched.block_size
            assert event.medium == "GPU"
            if hasattr(event, "kv_cache_spec_kind"):  # v0.32+; v0.20.2 has group_idx only
                assert event.kv_cache_spec_kind == ("full_attention" if group == 0 else "mamba")


@pytest.mark.patch(PER_RUN)
def test_a_mamba_group_publishes_its_state_block_with_its_own_tokens_and_parent():
    """A Mamba group publishes one hash, the block holding the state at the end
    of the chunk. Stock sends it with the tokens of all five blocks and no
    parent, and no field says which chunk the hash belongs to (vllm#44451);
    patched, the event holds that block's tokens alone and its parent is the
    hash of the block before it (not cached in the Mamba group), so a consumer
    chains it to the attention group's run."""
    _, log, req = first_prefill()
    stored = stored_by_group(log.take())
    hashes = external_hashes(req)
    last = PROMPT_BLOCKS - 1

    for group in range(1, 1 + NUM_MAMBA_GROUPS):
        [mamba] = stored[group]
        assert mamba.block_hashes == [hashes[last]]
        assert mamba.token_ids == req.prompt_token_ids[last * BLOCK_SIZE : PROMPT_BLOCKS * BLOCK_SIZE]
        assert mamba.parent_block_hash == hashes[last - 1]
        assert mamba.parent_block_hash in stored[0][0].block_hashes


def _chunk_owner_mismatches(events, req) -> list[tuple[int, int, int]]:
    """(group, i, block) for each ``block_hashes[i]`` whose ``block_size`` chunk
    of ``token_ids`` is not that block's tokens: what a consumer that pairs them
    (vllm-router's index keys a block by the sha256 of that chunk) would get
    wrong. The chunk is the i-th, or ``block_offsets[i]`` where the event says
    (the optional field vllm#44488 proposes)."""
    by_hash = {h: j for j, h in enumerate(external_hashes(req))}
    tokens = req.all_token_ids
    wrong = []
    for event in events:
        if not isinstance(event, BlockStored):
            continue
        bs = event.block_size
        offsets = getattr(event, "block_offsets", None) or range(len(event.block_hashes))
        for i, block_hash in zip(offsets, event.block_hashes):
            j = by_hash[block_hash]
            if event.token_ids[i * bs : (i + 1) * bs] != tokens[j * bs : (j + 1) * bs]:
                wrong.append((event.group_idx, i, j))
    return wrong


def test_full_attention_events_pair_each_hash_with_its_tokens():
    _, log, req = first_prefill()
    events = [e for e in log.take() if isinstance(e, BlockStored) and e.group_idx == 0]
    assert events and _chunk_owner_mismatches(events, req) == []


@pytest.mark.patch(PER_RUN)
def test_every_stored_hash_is_paired_with_its_own_tokens():
    """vllm#44451: on stock a Mamba group's BlockStored lists only the blocks
    holding a state while its token_ids span the skipped blocks too, so
    block_hashes[i] is not the i-th chunk of token_ids."""
    _, log, req = first_prefill()
    assert _chunk_owner_mismatches(log.take(), req) == []


@pytest.mark.patch(PER_RUN)
@pytest.mark.parametrize("chunk_blocks", [None, 2], ids=["one-chunk", "chunks-of-2-blocks"])
def test_each_group_chains_its_stored_hashes_to_their_logical_parents(chunk_blocks):
    """A consumer that links every stored hash to its parent (the event's
    parent for its first hash, the hash before it in the event for the others)
    rebuilds the prompt's own hash chain in every group: a Mamba group's state
    blocks, skipped blocks between them, hang under the hashes the
    full-attention group announces for the blocks before them. On stock a Mamba
    group's hash hangs under the hash before the whole range (or none)."""
    max_tokens = 1024 if chunk_blocks is None else chunk_blocks * BLOCK_SIZE
    sched, log = events_scheduler(max_num_batched_tokens=max_tokens)
    req = request(prompt(PROMPT_BLOCKS * BLOCK_SIZE + 3))
    run_local_prefill(sched, req)
    hashes = external_hashes(req)
    logical_parent = {h: (hashes[j - 1] if j else None) for j, h in enumerate(hashes)}

    stored = stored_by_group(log.take())
    assert sorted(stored) == list(range(1 + NUM_MAMBA_GROUPS))
    for group, events in stored.items():
        linked = {}
        for event in events:
            parent = event.parent_block_hash
            for block_hash in event.block_hashes:
                linked[block_hash] = parent
                parent = block_hash
        assert linked, group
        assert linked == {h: logical_parent[h] for h in linked}, group
        if chunk_blocks is not None:
            # A state block after every chunk: runs with skipped blocks between.
            assert len(events) > 1 and len(linked) > 1, group
    assert set().union(*(s.block_hashes for s in stored[0])) == set(hashes[:PROMPT_BLOCKS])


def announced_by_group(events) -> dict[int, set]:
    """The hashes each group holds by its events, in order: stored, then removed."""
    announced: dict[int, set] = {}
    for event in events:
        if isinstance(event, BlockStored):
            announced.setdefault(event.group_idx, set()).update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            announced.setdefault(event.group_idx, set()).difference_update(event.block_hashes)
    return announced


def _router_hits(announced: dict[int, set], req) -> tuple[int, int]:
    """Two readings of the published hashes, in tokens of ``req``'s prompt:
    attention only (the longest run of its blocks the full-attention group
    announced, what a router that ignores the groups or keeps group 0 scores),
    and per group (that run, cut back to its last block whose hash every Mamba
    group announced: where vLLM can resume)."""
    hashes = external_hashes(req)[: (req.num_tokens - 1) // BLOCK_SIZE]
    run = 0
    while run < len(hashes) and hashes[run] in announced.get(0, ()):
        run += 1
    hybrid = run
    while hybrid and not all(
        hashes[hybrid - 1] in announced.get(g, ()) for g in range(1, 1 + NUM_MAMBA_GROUPS)
    ):
        hybrid -= 1
    return run * BLOCK_SIZE, hybrid * BLOCK_SIZE


@pytest.mark.parametrize(
    ("shared_blocks", "tail", "vllm_hit_blocks"),
    [
        # Three of the five cached blocks: the attention blocks are there, no
        # Mamba state inside them is: vLLM recomputes from 0.
        (3, 5, 0),
        # The whole prefix and more: the state at block 5 is cached.
        (PROMPT_BLOCKS, 2 * BLOCK_SIZE, PROMPT_BLOCKS),
    ],
)
def test_attention_events_announce_prefixes_without_their_mamba_state(
    shared_blocks, tail, vllm_hit_blocks
):
    sched, log, _ = first_prefill()
    announced = announced_by_group(log.take())
    follower = request(prompt(shared_blocks * BLOCK_SIZE + tail))

    attention_only, per_group = _router_hits(announced, follower)
    assert attention_only == shared_blocks * BLOCK_SIZE
    assert cached_hit_tokens(sched, follower) == vllm_hit_blocks * BLOCK_SIZE
    # Read per group, the events give vLLM's own hit.
    assert per_group == vllm_hit_blocks * BLOCK_SIZE


def test_evictions_are_removed_per_group_and_the_per_group_reading_follows_them():
    # A pool of 20 blocks: a second prompt of other tokens evicts one of the
    # first prompt's cached attention blocks; its Mamba state stays cached and
    # announced, behind the gap, and is of no use.
    sched, log = events_scheduler(num_blocks=20)
    first = request(prompt(4 * BLOCK_SIZE + 3))
    run_local_prefill(sched, first)
    sched.finish_requests(first.request_id, RequestStatus.FINISHED_ABORTED)
    history = log.take()
    published = announced_by_group(history)
    run_local_prefill(sched, request(prompt(6 * BLOCK_SIZE + 3, seed=1)))
    events = log.take()
    removed = [e for e in events if isinstance(e, BlockRemoved)]

    # Only the first prompt's attention blocks go, tail first (v0.20.2's Mamba
    # groups hold more blocks: all four go there, one on v0.32/v0.33); its Mamba
    # states stay cached, announced and of no use.
    assert {e.group_idx for e in removed} == {0}
    assert all(e.medium == "GPU" for e in removed)
    gone = [external_hashes(first).index(h) for e in removed for h in e.block_hashes]
    kept = min(gone)
    assert sorted(gone) == list(range(kept, 4))
    assert all(published[g] == {external_hashes(first)[3]} for g in range(1, 4))

    follower = request(prompt(4 * BLOCK_SIZE + BLOCK_SIZE))
    attention_only, per_group = _router_hits(announced_by_group(history + events), follower)
    # The blocks before the gap are still announced and hold no Mamba state.
    assert attention_only == kept * BLOCK_SIZE
    assert per_group == cached_hit_tokens(sched, follower) == 0
