"""The decode-side hybrid hit with the connector sets people deploy.

Patch: divergent-hybrid-hit-per-request (v0.32+: the scheduler asks
``get_divergent_hit_resume_point`` before the local lookup and keeps a
diverged hit only behind a load whose matched child restores every Mamba
group). Stock vLLM takes the per-group (attention deeper than Mamba) hit only
when every connector declares ``supports_divergent_local_hybrid_hits``, which
neither vLLM's OffloadingConnector nor lmcache's LMCacheMPConnector does: with
NIXL beside either of them, a decode instance gets the hit every group agrees
on, 0.

Sets: MultiConnector[NIXL, LMCacheMP], [LMCacheMP, NIXL], [NIXL, Offloading],
[Offloading, NIXL], with real vLLM schedulers and connectors:

- LMCacheMPConnector is lmcache's own class (what vLLM resolves when lmcache
  is importable); only its ZMQ client is stood in, answering from a fake
  server that holds whole token-prefix chunks (``hash_stores``).
- OffloadingConnector runs its real scheduler side and vLLM's real CPU
  offloading manager; its GPU worker is stood in by ``OffloadingWorker``,
  which completes every transfer job within the step. Its chunks come from
  its own store path: a request computed on the instance.

Every admission is checked by :class:`MambaStateChecker`; a load by a
hash-store child passes only if what it brings to the resume point is the
request's own Mamba state: the Offloading load carries, for every Mamba
group, the stored key of the request's own block hash at the resume block;
the LMCache load ends at a stored chunk of the request's own token prefix.
(Whether LMCache's stored chunk-end Mamba page is the genuine state depends
on the server's object groups, which no scheduler-level test sees.)
"""

import pytest

from ..builders import (
    BLOCK_SIZE,
    cached_hit_tokens,
    connectors,
    hybrid_kv_cache_config,
    prefill_side_params,
    prompt,
    remote_prefill_params,
    request,
    scheduler,
    vllm_config,
)
from ..hash_stores import (
    FakeLMCacheServer,
    HashStoreLoads,
    OffloadingWorker,
    child,
    hash_store_step,
    lmcache_adapter_stub,
    lmcache_mp_unavailable,
    offload_key,
)
from ..mamba_state import MambaStateChecker

PER_REQUEST = "divergent-hybrid-hit-per-request"
PREFIX = prompt(4 * BLOCK_SIZE, seed=1)
SETS = ["nixl+lmcachemp", "lmcachemp+nixl", "nixl+offloading", "offloading+nixl"]
ROLES = ["kv_consumer", "kv_both"]

# lmcache's class and the OffloadingConnector's Mamba (align-mode) chunks exist
# from v0.32 on; v0.20.2 only collects this file.
pytestmark = [pytest.mark.patch(PER_REQUEST), pytest.mark.vllm_versions(">=0.32")]


class Instance:
    """A decode instance with a connector set, its checker, and the hash-store
    child's storage (the Offloading worker's record, or the LMCache server)."""

    def __init__(self, kind, kv_role):
        self.kind = kind
        self.server = FakeLMCacheServer()
        if "lmcachemp" in kind:
            # Before the config: vLLM resolves the class while validating it.
            reason = lmcache_mp_unavailable()
            if reason is not None:
                pytest.skip(reason)
        config = vllm_config(**connectors(kind, kv_role))
        if "lmcachemp" in kind:
            with lmcache_adapter_stub(self.server):
                self.sched = scheduler(config, hybrid_kv_cache_config())
        else:
            self.sched = scheduler(config, hybrid_kv_cache_config())
        self.worker = OffloadingWorker(self.sched) if "offloading" in kind else None
        # What each hash-store child's load brings to the resume point, from
        # what it moves (see the module docstring).
        loads = HashStoreLoads(self.sched, self.server, self.worker)
        self.checker = MambaStateChecker(self.sched, load_checks=loads.checks())

    @property
    def hash_store(self) -> str:
        return "LMCacheMPConnector" if "lmcachemp" in self.kind else "OffloadingConnector"

    def step(self):
        return hash_store_step(self.sched, self.checker, self.worker)

    def serve(self, req):
        """Admit ``req`` and drive it until its prompt is computed."""
        self.sched.add_request(req)
        for _ in range(4 * req.num_prompt_tokens):
            self.step()
            if req.num_computed_tokens >= req.num_prompt_tokens:
                return
        raise AssertionError(f"{req.request_id} did not get through its prompt")

    def finish(self, req):
        for _ in range(4 * req.max_tokens):
            if req.is_finished():
                break
            self.step()
        assert req.is_finished()
        for _ in range(2):  # the stores handed off when it finished complete
            self.step()

    def store(self, tokens):
        """Put the whole chunks of ``tokens`` into the hash-store child: LMCache
        by recording them on its server; Offloading through its own store path,
        a plain request computed here, whose blocks then leave the instance's
        prefix cache (as under memory pressure)."""
        if self.worker is None:
            self.server.store(tokens)
            return
        req = request(tokens)
        self.serve(req)
        self.finish(req)
        assert self.sched.reset_prefix_cache(), "the prefix cache did not reset"
        stored = [
            i for i in range(len(req.block_hashes))
            if all(offload_key(req, i, g) in self.worker.stored
                   for g in self.checker.mamba_group_ids)
        ]
        assert stored, "the OffloadingConnector stored no Mamba chunk"

    def admission(self, req):
        return next(a for a in self.checker.admissions if a.request_id == req.request_id)


def _decode_instance(kind, kv_role, stored=None):
    """A decode instance that served one remote prefill whose prompt starts with
    PREFIX (its attention blocks are cached, its Mamba groups hold no state
    inside PREFIX); with ``stored``, the hash-store child holds its chunks."""
    inst = Instance(kind, kv_role)
    # The Offloading tier is filled by this instance, before its prefix cache
    # is dropped; the LMCache server is shared and filled by another instance,
    # after ``first`` (which would otherwise load PREFIX, Mamba state included,
    # from it: LMCache's default single object group ends a hit at any chunk).
    if stored is not None and inst.worker is not None:
        inst.store(stored)
    first = request(PREFIX + prompt(2 * BLOCK_SIZE, seed=2),
                    kv_transfer_params=remote_prefill_params(6))
    inst.serve(first)
    assert inst.admission(first).serving_connector.startswith("Nixl")
    if stored is not None and inst.worker is None:
        inst.store(stored)
    return inst


@pytest.mark.parametrize("kv_role", ROLES)
@pytest.mark.parametrize("kind", SETS)
def test_remote_prefill_keeps_the_attention_hit(kind, kv_role):
    # Nothing in the hash store for this prompt: the prefix comes from D's own
    # cache, NIXL pulls the rest and the Mamba state at its end, in both
    # orders. Stock: the hash-store child does not declare the capability, so
    # D takes the hit every group agrees on (0) and NIXL pulls everything.
    inst = _decode_instance(kind, kv_role)
    req = request(PREFIX + prompt(2 * BLOCK_SIZE, seed=3),
                  kv_transfer_params=remote_prefill_params(6))
    inst.serve(req)
    adm = inst.admission(req)
    assert adm.serving_connector.startswith("Nixl")
    assert adm.resume_point - adm.external_tokens == len(PREFIX)


@pytest.mark.parametrize("kv_role", ROLES)
@pytest.mark.parametrize("kind", SETS)
def test_hash_store_with_deeper_chunks_serves_when_first(kind, kv_role):
    # The hash store holds PREFIX plus two more blocks of this prompt, with the
    # Mamba state at their end; D's own cache holds PREFIX's attention only.
    # First in the order, the hash store matches and loads from the local hit
    # to its stored Mamba chunk (checked: the request's own state); second,
    # NIXL matches first and pulls up to the prefiller's end.
    shared = PREFIX + prompt(2 * BLOCK_SIZE, seed=5)
    inst = _decode_instance(kind, kv_role, stored=shared + [9])
    req = request(shared + prompt(BLOCK_SIZE, seed=6),
                  kv_transfer_params=remote_prefill_params(7))
    inst.serve(req)
    adm = inst.admission(req)
    assert adm.resume_point - adm.external_tokens == len(PREFIX)
    if kind.startswith("nixl"):
        assert adm.serving_connector.startswith("Nixl")
        assert adm.resume_point == len(req.prompt_token_ids) - 1
    else:
        assert adm.serving_connector == inst.hash_store
        assert adm.resume_point == len(shared)


@pytest.mark.parametrize("stored", [False, True], ids=["empty-store", "stored"])
@pytest.mark.parametrize("kv_role", ROLES)
@pytest.mark.parametrize("kind", SETS)
def test_plain_request_gets_no_stateless_hit(kind, kv_role, stored):
    # A router sends a prompt straight to the decode pool: NIXL has nothing to
    # load, so no connector gives a resume point and the attention-only hit on
    # PREFIX is not taken (the checker raises on a stateless resume). With its
    # chunks in the hash store, it is loaded from 0 with the stored Mamba
    # state at the end, in either order.
    shared = PREFIX + prompt(2 * BLOCK_SIZE, seed=4)
    inst = _decode_instance(
        kind, kv_role, stored=shared + [9] if stored else None
    )
    plain = request(shared + prompt(BLOCK_SIZE, seed=7))
    inst.serve(plain)
    adm = inst.admission(plain)
    assert adm.resume_point - adm.external_tokens == 0
    if stored:
        assert adm.serving_connector == inst.hash_store
        assert adm.resume_point == len(shared)
    else:
        assert adm.resume_point == 0


@pytest.mark.parametrize("kind", SETS)
def test_prefill_side_request_takes_the_agreed_hit(kind):
    # A prefill instance (kv_both) that holds PREFIX's attention blocks without
    # the Mamba state inside it, and whose hash-store child holds two more
    # blocks of this prompt. NIXL will not load for the prefill side's request
    # (do_remote_decode), so no child gives a resume point and the request
    # takes stock's local hit, the one every group agrees on; a hash-store
    # load then starts there. Before the fix NIXL answered request.num_tokens
    # for it: the request took the attention-only hit on PREFIX and the
    # hash-store child loaded over it.
    shared = PREFIX + prompt(2 * BLOCK_SIZE, seed=5)
    inst = _decode_instance(kind, "kv_both", stored=shared + [9])
    req = request(shared + prompt(BLOCK_SIZE, seed=8),
                  kv_transfer_params=prefill_side_params())
    agreed = cached_hit_tokens(inst.sched, req)
    assert agreed < len(PREFIX)  # the attention-only hit is deeper
    inst.serve(req)
    adm = inst.admission(req)
    assert adm.resume_point - adm.external_tokens == agreed
