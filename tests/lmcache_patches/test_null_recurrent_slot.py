"""A chunk whose Mamba slot holds vLLM's null block is never stored as a state.

Patch: null-recurrent-slot-not-stored. In align mode vLLM puts its null block in the
Mamba slots of the blocks a multi-block prefill step skips; only the step's last
block holds a real state. Without ``--separate-object-groups`` (the server default)
attention and Mamba share one stored object per chunk, and stock LMCache skips a chunk
only when every block of it is null, so the chunk is stored with the null block's
bytes as its state. A later prompt sharing a prefix that ends in that chunk then
resumes from it. Measured end to end on vLLM 0.32.0 (CONTEXT §6): with
``--max-num-batched-tokens 2048``, a 600-token prompt A prefilled in one step, then a
prompt sharing 300 tokens with A got a 256-token LMCache hit and wrong tokens from the
first one. Nothing in it is device-specific.

Asserted with the server's own store and lookup (deployment.py): every chunk LMCache
would load ends on a real recurrent state. The guards (no patch named) keep the hits
that are right on stock: prefill steps of one chunk, and ``--separate-object-groups``.
"""

import pytest

from lmcache_patches import deployment

N = deployment.BLOCK
A = list(range(1, 2 * N + 1))
B = A[:300] + list(range(10_000, 10_060))  # shares chunk 0 with A and ends inside chunk 1
# A in one prefill step: the Mamba groups' block table holds the null block (0) at
# chunk 0; attention holds real blocks everywhere.
ONE_STEP = [[0, 2], [0, 4], [0, 7], [8, 9]]
# A in two steps of one chunk: a real state at every chunk.
TWO_STEPS = [[1, 2], [3, 4], [6, 7], [8, 9]]


def _registered(server):
    worker = deployment.allocate_worker(deployment.vllm_config(server.port, 8 * N))
    deployment.register(worker, server)
    return worker


@pytest.mark.patch("null-recurrent-slot-not-stored")
def test_no_hit_resumes_on_a_null_state(server):
    _registered(server)
    stored = server.store(A, ONE_STEP)
    assert stored[1], "chunk 1 holds a real state: it is stored"
    # stock: chunk 0 stored with the null block as its state, and B takes it
    assert server.lookup(B, "b") == 0
    assert not stored[0]


def test_one_chunk_steps_keep_their_hits(server):
    _registered(server)
    assert server.store(A, TWO_STEPS) == [True, True]
    assert server.lookup(A, "a") == 2
    assert server.lookup(B, "b") == 1


def test_separate_object_groups_keep_the_full_hit():
    with deployment.lmcache_server(["--separate-object-groups"]) as server:
        _registered(server)
        server.store(A, ONE_STEP)
        assert server.lookup(A, "a") == 2
        assert server.lookup(B, "b") == 0


@pytest.mark.patch("null-recurrent-slot-not-stored")
def test_a_chunk_of_two_blocks_ending_on_a_null_state_is_not_served():
    """A hit ending at a chunk resumes from the state in the chunk's last block. With
    a chunk of two blocks (--chunk-size 512, a multiple of vLLM's 256 as LMCache allows),
    a local hit of block 0 then a multi-block step leaves chunk 0 as [real, null] in the
    Mamba groups: not all null, and still no state to resume from at its end."""
    with deployment.lmcache_server(["--chunk-size", str(2 * N)]) as server:
        _registered(server)
        a = list(range(1, 4 * N + 1))
        b = a[: 2 * N + 100] + list(range(20_000, 20_060))  # its only whole chunk is 0
        # Per Mamba group: block 0 real (the earlier local hit), 1-2 null, 3 the state
        # the step ended on; attention holds real blocks everywhere.
        block_ids = [[1, 0, 0, 2], [7, 0, 0, 8], [9, 0, 0, 10], [3, 4, 5, 6]]
        stored = server.store(a, block_ids)
        assert stored[1], "chunk 1 ends on a real state: it is stored"
        assert server.lookup(b, "b") == 0


@pytest.mark.patch("null-recurrent-slot-not-stored")
def test_separate_object_groups_with_two_blocks_per_chunk_serve_no_null_state():
    """The layout LMCache's hybrid-model docs require (--separate-object-groups) with
    --chunk-size two blocks and --max-num-batched-tokens three: the prefill steps
    cover blocks 0-2 and 3-5, and only each step's last block (2, 5) holds a Mamba
    state. Chunk 1 is [real, null] in the Mamba groups: stock stores its Mamba object,
    and a prompt sharing chunks 0-1 resumes from the null block."""
    with deployment.lmcache_server(
        ["--separate-object-groups", "--chunk-size", str(2 * N)]
    ) as server:
        _registered(server)
        a = list(range(1, 6 * N + 1))
        b = a[: 4 * N + 100] + list(range(30_000, 30_060))  # whole chunks 0-1 of a
        block_ids = [[0, 0, 1, 0, 0, 2], [0, 0, 3, 0, 0, 4], [0, 0, 5, 0, 0, 6],
                     [11, 12, 13, 14, 15, 16]]
        server.store(a, block_ids)
        assert server.lookup(a, "a") == 3, "chunk 2 ends on a real state: a keeps its hit"
        assert server.lookup(b, "b") == 0
