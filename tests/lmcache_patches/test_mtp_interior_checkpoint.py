"""With MTP, the Mamba state LMCache stores for a chunk is the state at the chunk's end.

The question (LMCache#4984, wrong outputs with MTP on hybrid models): vLLM writes an
interior Mamba checkpoint inside the last prefill step; with MTP (any EAGLE-family
drafter) that checkpoint is moved one block back, and LMCache stores each chunk with
the state it finds in the chunk's last block as "the state at the chunk's end".

Which position's state is in which block (vLLM 0.33.0; 0.32.0 has the same rules,
without the hash lookahead). B = block = LMCache chunk = 256, a prompt of s tokens
prefilled in one step, align mode, MTP with one module:

- With any KV connector ``VllmConfig.num_hash_lookahead_tokens`` is 0 ("KV connectors
  keep the legacy hashes"), so the worker's ``MambaPrefillCheckpointBuilder`` sets
  ``drop_eagle_block = use_eagle_block_drop()`` (true for ``mtp``) and the scheduler's
  ``_mamba_block_aligned_split`` and ``MambaManager`` use the same flag
  (``kv_cache_coordinator``: ``drop_eagle_checkpoint_block = True`` under EAGLE).
- ``get_mamba_prefill_checkpoint_position(s, B, drop_eagle_block=True)`` is
  ``floor(s / B) * B - B``: P. ``compute_mamba_prefill_checkpoints`` writes the state
  at P (offset P into the query) into block-table column ``c = cdiv(s, B) - 2``, and
  ``MambaManager`` allocates that column a real block (``num_prefill_checkpoint_blocks
  = 1``) and re-keys it at P (``_cache_partial_tail_block``). The step's final state
  (at s) goes to column ``cdiv(s, B) - 1``.
- s a multiple of B: c = s/B - 2, P = s - B = (c + 1) * B: column c holds the state
  at its end. s not a multiple of B: c = floor(s/B) - 1, P = c * B: column c holds the
  state at its **start**, one block before its end. Without MTP,
  P = floor((s - 1)/B) * B = (c + 1) * B in both cases.
- s = 1000: P = 512, c = 2. Whole chunks 0-2; columns 0 and 1 are vLLM's null block,
  column 2 the checkpoint. LMCache (stock, and with null-recurrent-slot-not-stored,
  which skips only null slots) stores chunk 2 = tokens [512, 768) with the state at 512.

A prompt sharing those 768 tokens on an instance whose own prefix cache does not hold
them (the decode instance, or the same one after a restart, LMCache#4492) gets a
768-token LMCache hit (LMCache's scheduler side does not trim hits for EAGLE), the
retrieve writes chunk 2's Mamba page into the block the request resumes from
(column 2), and the linear-attention layers continue at 768 from the state at 512.

Answer: it reproduces. With ``--separate-object-groups`` (the layout LMCache's docs
require for hybrid models) the Mamba object of chunk 2 is stored from column 2, the
lookup of B returns 3 chunks, and the bytes B resumes from at 768 are exactly the
state at 512, on vLLM 0.33.0 (Gated-DeltaNet checkpoints) and 0.32.0 (the same spec:
Mamba2's ``mamba_mixer2`` checkpoints) with lmcache 0.5.6 and this series without
the patch below. In the
default shared layout the same chunk is stored with the same page, but in this
scenario chunks 0-1 (vLLM's null block) are not stored (null-recurrent-slot-not-stored),
so no lookup reaches it; stock LMCache stores them (null pages, never read at a
768-token resume) and serves the 768-token hit from the state at 512 there too (by
reading: stock LMCache does not register a hybrid KV cache on CPU). Nothing in it is
device-specific: the chunk-to-block mapping of the store is the one every device uses,
and vLLM writes these checkpoints on CUDA (FlashInfer's GDN prefill, ``mamba_mixer2``).

Patch: displaced-mamba-checkpoint-not-stored. LMCache's connector (scheduler side)
applies vLLM's own checkpoint rule to each step and nulls the tracked Mamba slot of a
checkpoint that is not at its column's end, so the store skips that chunk's Mamba
object (null-recurrent-slot-not-stored) and B gets no hit that resumes there. A
prompt of whole blocks (s = 1024: P = 768, column 2's end) keeps its 768-token hit
from the right state: the guard that the patch does not null every checkpoint.

What is real: vLLM's Scheduler (the host pin's) with MTP and LMCacheMPConnector
(its scheduler side against the server), which decides the step, hands out the
block table and issues the store (its block ids are what the server stores);
vLLM's ``MambaPrefillCheckpointBuilder`` (the worker's), which says which block the
checkpoint goes to and at which position; the allocation, layer binding,
registration, the server's store, lookup and retrieve (deployment.py). Stood in:
the model's states. Each linear-attention layer's state after p tokens is computed by
a gated delta rule (plain torch, the recurrence of a Gated-DeltaNet layer; the conv
state its last three inputs) over seeded token embeddings, and written where the
kernels write it (vLLM's CPU backend has no prefill checkpoint export to run).

The comparison is bitwise: the bytes in the block the request resumes from, after
LMCache's retrieve, against the state of a cold run after exactly 768 tokens
(``_state(B, 768)``). The states at 512 and 768 differ in every layer (asserted), so
a state from the wrong position cannot pass; a second guard writes the state at 768
into column 2 (what the checkpoint holds without MTP) and stores column 2's block as
the unpatched connector does, and the same comparison passes, so it does not fail for
another reason (the mutation in the other direction).
"""

import functools
import time
from types import SimpleNamespace

import pytest
import torch

from lmcache_patches import deployment
from patches import builders

N = deployment.BLOCK
HIT = 3 * N  # the prefix A and B share: A's whole chunks at S
S = 1000  # one prefill step, not a multiple of the block
S_WHOLE = 4 * N  # one prefill step of whole blocks: the checkpoint at column 2's end
PATCH = "displaced-mamba-checkpoint-not-stored"


def _prompt_a(s: int) -> list[int]:
    return builders.prompt(s, seed=11)


B = _prompt_a(S)[:HIT] + builders.prompt(200, seed=12)
CONV, SSM = deployment.STATE_SHAPES


def _embedding(layer: int, token: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(layer * 1_000_003 + token)
    return torch.randn(CONV[1], generator=gen)


@functools.cache
def _states(tokens: tuple, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The layer's (conv, ssm) state after each prefix of ``tokens`` (index p: after
    p tokens): a gated delta rule over the tokens' embeddings."""
    heads, dk, dv = SSM
    conv = torch.zeros(CONV)
    ssm = torch.zeros(SSM)
    out = [(conv.clone(), ssm.clone())]
    for token in tokens:
        x = _embedding(layer, token)
        conv = torch.cat([conv[1:], x[None]])
        k = torch.nn.functional.normalize(x[: heads * dk].view(heads, dk), dim=-1)
        v = x[heads * dk : heads * (dk + dv)].view(heads, dv)
        g = torch.sigmoid(x[-2 * heads : -heads])[:, None, None]
        beta = torch.sigmoid(x[-heads:])[:, None]
        ssm = g * ssm
        delta = beta * (v - torch.einsum("hkv,hk->hv", ssm, k))
        ssm = ssm + torch.einsum("hk,hv->hkv", k, delta)
        out.append((conv.clone(), ssm.clone()))
    return out


def _state(tokens, p: int) -> list[torch.Tensor]:
    """Every Mamba layer's state after ``p`` tokens, in the worker's dtypes, in
    the order ``Worker.read_state`` returns them."""
    result = []
    for layer in range(deployment.NUM_LAYERS):
        if layer % 4 == 3:
            continue
        conv, ssm = _states(tuple(tokens), layer)[p]
        result += [conv.to(deployment.STATE_DTYPES[0]), ssm.to(deployment.STATE_DTYPES[1])]
    return result


def _write(worker, block: dict[str, int], state: list[torch.Tensor]) -> None:
    """Write ``state`` into each Mamba layer's ``block[layer]`` through its views."""
    values = iter(state)
    for name in worker.mamba_layers:
        for view in worker.layers[name].kv_cache:
            view[block[name]].copy_(next(values))


def _read(worker, block: dict[str, int]) -> list[torch.Tensor]:
    return [
        view[block[name]].clone()
        for name in worker.mamba_layers
        for view in worker.layers[name].kv_cache
    ]


def _mtp_instance(server, max_num_batched_tokens=4 * N):
    """A worker and a scheduler of one instance, MTP with one module,
    LMCacheMPConnector, align mode; the KV cache registered with ``server``."""
    config = builders.vllm_config(
        kv_role="kv_both",
        kv_connector="LMCacheMPConnector",
        kv_connector_extra_config={
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": server.port,
            "lmcache.mp.mp_transfer_mode": "lmcache_driven",
        },
        block_size=N,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=4,
        max_model_len=8 * N,
        num_speculative_tokens=1,
        spec_method="mtp",
    )
    # What the engine resolves for a 256-token block without --prefix-match-unit,
    # and hands the worker (``gpu_worker``: cache_config.hash_block_size = ...).
    config.cache_config.hash_block_size = N
    config.cache_config.cache_hit_alignment_tokens = N
    worker = deployment.allocate_worker(
        config,
        num_blocks=64,
        mamba_spec=dict(
            num_speculative_blocks=1,  # vLLM: num_speculative_tokens
            # A Gated-DeltaNet layer that exports checkpoints (FlashInfer's prefill):
            # one checkpoint block, offsets on the prefix-cache grid.
            num_prefill_checkpoint_blocks=1,
            prefill_checkpoint_alignment=N,
        ),
    )
    deployment.register(worker, server)
    # The engine sets both on the scheduler's KV cache config too (EngineCore).
    worker.kv_cache_config.hash_block_size = N
    worker.kv_cache_config.cache_hit_alignment_tokens = N
    sched = builders.scheduler(config, worker.kv_cache_config)
    return config, worker, sched


def _prefill_one_step(config, worker, sched, a: list[int], mutate: bool):
    """Schedule ``a`` in one step and write what the model writes: the checkpoint
    where vLLM's worker-side builder says, the final state in the step's last
    column. Returns the request's block table, the checkpoint's position and
    block per layer, and the store LMCache's connector issues after the step."""
    from vllm.model_executor.layers.mamba.checkpoint import MambaPrefillCheckpointBuilder

    s = len(a)
    req = builders.request(a, block_size=N)
    sched.add_request(req)
    output = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the connector's lookup is asynchronous
        output = sched.schedule()
        if req.request_id in output.num_scheduled_tokens:
            break
        sched.update_from_output(output, builders.model_runner_output([]))
        time.sleep(0.02)
    assert output.num_scheduled_tokens[req.request_id] == s, "A is one prefill step"
    new = next(r for r in output.scheduled_new_reqs if r.req_id == req.request_id)
    block_ids = [list(ids) for ids in new.block_ids]
    store = next(
        m.op for m in output.kv_connector_metadata.requests
        if m.request_id == req.request_id and m.direction == "STORE"
    )
    checkpoint = {}
    final = {}
    position = None
    for name in worker.mamba_layers:
        group = worker.group_of(name)
        builder = MambaPrefillCheckpointBuilder(
            config, worker.kv_cache_config.kv_cache_groups[group].kv_cache_spec
        )
        meta = builder.build(
            SimpleNamespace(
                query_start_loc=torch.tensor([0, s], dtype=torch.int32),
                query_start_loc_cpu=torch.tensor([0, s], dtype=torch.int32),
                seq_lens_cpu_upper_bound=torch.tensor([s], dtype=torch.int32),
                block_table_tensor=torch.tensor([block_ids[group]], dtype=torch.int32),
            ),
            [0],
        )
        assert meta is not None, "vLLM writes an interior checkpoint in this step"
        position = meta.offsets[0]  # the query starts at 0
        checkpoint[name] = int(meta.state_indices[0])
        final[name] = block_ids[group][-(-s // N) - 1]  # column cdiv(s, N) - 1
    _write(worker, final, _state(a, s))
    _write(worker, checkpoint, _state(a, HIT if mutate else position))
    return block_ids, position, checkpoint, store


@pytest.mark.patch(PATCH)
def test_a_hit_never_resumes_from_a_checkpoint_before_its_end():
    """S = 1000: column 2 holds the state at 512; no hit of B resumes from it."""
    _run(S, mutate=False)


def test_a_checkpoint_at_its_chunk_end_keeps_its_hit():
    """S = 1024: column 2 holds the state at 768, its end; B resumes from it."""
    _run(S_WHOLE, mutate=False)


def test_guard_the_state_at_the_chunk_end_resumes_right():
    """S = 1000 with the state at 768 in column 2, stored as the unpatched
    connector stores it: B resumes right, so the comparison can pass."""
    _run(S, mutate=True)


def _run(s: int, mutate: bool) -> None:
    with deployment.lmcache_server(["--separate-object-groups"]) as server:
        config, worker, sched = _mtp_instance(server)
        try:
            prefill = _prefill_one_step(config, worker, sched, _prompt_a(s), mutate)
            _check(worker, server, *prefill, s, mutate)
        finally:
            sched.shutdown()


def _check(worker, server, block_ids, position, checkpoint, store, s, mutate):
    a = _prompt_a(s)
    # The derivation in the docstring, as vLLM computed it: floor(s / N) * N - N.
    assert position == (3 * N if s == S_WHOLE else 2 * N)
    col = HIT // N - 1
    assert all(block_ids[worker.group_of(n)][col] == b for n, b in checkpoint.items())
    assert (store.start, store.end) == (0, s // N * N)
    stored_block_ids = [list(ids) for ids in store.block_ids]
    if mutate:  # what the unpatched connector sends: column 2's checkpoint block
        for name, block in checkpoint.items():
            stored_block_ids[worker.group_of(name)][col] = block
    # What the connector's store sends the server (the worker forwards it as is).
    stored = server.store(a[: store.end], stored_block_ids)
    # The decode instance (or this one after a restart): its prefix cache is empty.
    hit = server.lookup(B, "b")
    if not stored[col] or any(
        stored_block_ids[worker.group_of(n)][col] == 0 for n in worker.mamba_layers
    ):
        # The chunk whose Mamba page is not its end state is not stored as one.
        assert s % N, "a checkpoint at its column's end is stored"
        assert hit < HIT // N
        return
    assert hit == HIT // N
    # B's blocks on that instance (align mode: only the hit's last column holds a
    # Mamba block; the groups share one block pool), cleared first; the request
    # resumes at HIT from that column.
    mamba_groups = {worker.group_of(n) for n in worker.mamba_layers}
    fresh = [
        [0] * (hit - 1) + [56 + g] if g in mamba_groups
        else [40 + i for i in range(hit)]
        for g in range(len(block_ids))
    ]
    resume = {n: fresh[worker.group_of(n)][hit - 1] for n in worker.mamba_layers}
    _write(worker, resume, [torch.zeros_like(t) for t in _state(B, 0)])
    assert server.retrieve(B[:HIT], fresh, "b-load")
    loaded = _read(worker, resume)
    want = _state(B, HIT)  # a cold run of B after exactly HIT tokens
    wrong = _state(a, 2 * N)  # the checkpoint of a one-step prefill of S tokens
    assert all(not torch.equal(w, x) for w, x in zip(want, wrong))
    from_position = all(torch.equal(l, x) for l, x in zip(loaded, wrong))
    assert all(torch.equal(l, w) for l, w in zip(loaded, want)), (
        f"B resumes at {HIT} from the state at "
        f"{2 * N if from_position else 'an unknown position'}"
    )
