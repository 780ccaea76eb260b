"""hybridpd explain's driver: runs inside a pin's test environment (stdlib, vLLM and,
for the decode-side question, the series' patch tests ``tests/patches``), with the vLLM
tree under test first on ``PYTHONPATH``; answers one or more
deployments (cases) in one process and prints the answers, a JSON list, on a line of
stdout that starts with ``HYBRIDPD-EXPLAIN``.

It answers from vLLM's own code, as a GPU engine would reach it, without weights and
without a GPU:

- ``start``: ``EngineArgs(...).create_engine_config()`` (vLLM's config checks, the
  per-architecture hooks, the hybrid allocator's decision);
- ``groups``: the model built on the meta device (no memory, no weights), its layers'
  own KV cache specs, then the engine core's own ``_initialize_kv_caches`` over an
  executor that reports those specs and a fixed memory budget: vLLM's grouping, block
  size and page padding as the engine core computes them, here for this machine's
  platform (CPU: its attention backend's kernel block sizes, which a GPU's differ from);
- ``scheduler``: vLLM's ``Scheduler`` built on that KV cache config, with the
  deployment's KV connector (the connector factory's checks run there; lmcache's
  LMCacheMPConnector with its server client stood in, as the patch tests do);
- ``decode_hit``: which requests keep a local prefix hit on a decode instance and
  which Mamba state each resumes from, measured on fresh schedulers of the same build
  (:func:`decode_hits`).

Each step that raises is reported with the exception's text and the vLLM frame that
raised it, and the later steps are skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import time
import traceback


def _frame(f) -> str:
    path = f.filename.replace("\\", "/")
    # From the package's root: vLLM's, or lmcache's (whose vLLM adapter sits under
    # lmcache/integration/vllm/).
    root = "/lmcache/" if "/lmcache/" in path else "/vllm/"
    path = path[path.rfind(root) + 1:] if root in path else path
    return f"{path}:{f.lineno}"


#: vLLM files that only a CPU engine runs: what they refuse, a GPU engine never meets.
_CPU_ONLY = ("vllm/platforms/cpu.py", "/cpu_attn", "/cpu/", "cpu_worker", "cpu_model_runner")


def _error(exc: BaseException) -> dict:
    """vLLM's refusal: its text and the innermost vLLM frame that raised it. Marked
    ``unknown`` when vLLM's verdict it is not: raised in this driver (a stand-in lacks
    what vLLM asked of it), in a file only a CPU engine runs, or by a module the test
    environment lacks (a GPU environment has it)."""
    frames = traceback.extract_tb(exc.__traceback__)
    inside = [f for f in frames if "/vllm/" in f.filename.replace("\\", "/")]
    text = str(exc).strip().splitlines()
    out = {"error": f"{type(exc).__name__}: {' '.join(t.strip() for t in text[:6])}"[:1200],
           "raised_at": _frame((inside or frames)[-1])}
    chain, seen = exc, set()
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        if isinstance(chain, ModuleNotFoundError):
            out["unknown"] = (f"the test environment lacks {chain.name}, which vLLM imported "
                              "for this model (a GPU environment has it)")
            return out
        chain = chain.__cause__ or chain.__context__
    if "failed to be inspected" in out["error"]:
        # vLLM inspects the architecture in a subprocess: its cause (in the log) is
        # not in this exception's chain; an inspection that fails is an import that
        # fails, where a GPU environment imports (torchvision for Qwen3.5 on 0.20.2).
        out["unknown"] = ("vLLM's model inspection subprocess failed (the driver's log "
                          "says why: usually a module the test environment lacks)")
    elif frames and frames[-1].filename == __file__:
        out["unknown"] = ("explain's stand-in for the engine's worker lacks what vLLM asked "
                          "of it here (explain cannot answer this configuration yet)")
    elif any(mark in out["raised_at"] for mark in _CPU_ONLY):
        out["unknown"] = "raised by vLLM's CPU platform, which a GPU engine does not run"
    return out


def _executor(vllm_config, specs: dict, memory_bytes: int):
    """vLLM's own ``Executor`` (its methods are the real ones, each a collective RPC)
    over one in-process worker: vLLM's ``WorkerBase`` answering from the meta-device
    model (its KV cache specs) and a fixed memory budget (no profiling), and doing
    nothing where a worker would allocate or compile."""
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.worker.worker_base import WorkerBase

    class Worker(WorkerBase):
        def __init__(self):  # WorkerBase's would bind a device
            self.vllm_config = vllm_config

        def get_kv_cache_spec(self):
            return specs

        def determine_available_memory(self):
            return memory_bytes

        def initialize_from_config(self, kv_cache_configs) -> None:
            return None

        def compile_or_warm_up_model(self):
            return None

        def update_max_model_len(self, *args, **kwargs) -> None:
            return None

    class OneWorker(Executor):
        def __init__(self):  # Executor's would start workers
            self.vllm_config = vllm_config
            self.worker = Worker()

        def _init_executor(self) -> None:
            return None

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None, **_):
            fn = getattr(self.worker, method) if isinstance(method, str) else (
                lambda *a, **k: method(self.worker, *a, **k))
            result = fn(*args, **(kwargs or {}))
            return [] if result is None and method == "compile_or_warm_up_model" else [result]

        def check_health(self) -> None:
            return None

    OneWorker.__abstractmethods__ = frozenset()
    return OneWorker()


class _EngineCore:
    """The attributes ``EngineCore._initialize_kv_caches`` uses of its engine core."""

    def __init__(self, executor):
        self.model_executor = executor
        self.available_gpu_memory_for_kv_cache = -1

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, **_):
        return self.model_executor.collective_rpc(method, timeout, args, kwargs)


@contextlib.contextmanager
def _tensor_parallel_rank(size: int):
    """This process as rank 0 of a tensor-parallel group of ``size`` while the model's
    layers are built and asked for their KV cache specs: the process holds one rank
    (:func:`_init_distributed`), and a layer reads only its group's size and rank to
    divide its heads and its Mamba state; nothing communicates on the meta device."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    saved = group.world_size, group.rank_in_group
    group.world_size, group.rank_in_group = size, 0
    try:
        yield
    finally:
        group.world_size, group.rank_in_group = saved


def _build_model(vllm_config) -> None:
    """The model as vLLM's loader initializes it (``BaseModelLoader.load_model``: the
    model's dtype as the default, ``initialize_model``, which also configures
    quantization), on the meta device: its layers register in the config's forward
    context as a loaded model's do; no memory, no weights."""
    import torch
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("meta"):
        initialize_model(vllm_config=vllm_config)


def _layer_specs(vllm_config) -> dict:
    """The model's per-layer KV cache specs, from the model runner's own function
    (``vllm.v1.worker.gpu.attn_utils.get_kv_cache_spec``: the layers' specs, the
    backends' customization, KV sharing)."""
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    return get_kv_cache_spec(vllm_config)


def _speculative(sched) -> dict:
    """What vLLM's scheduler does with the speculative config, read from its objects:
    the method and tokens, the MTP modules the draft has, the lookahead slots each
    running request gets, the prefill lookahead, NIXL's prefill back-off (where the set
    has NIXL) and whether the KV cache manager drops a hit's last matched block."""
    spec = sched.vllm_config.speculative_config
    coordinator = sched.kv_cache_manager.coordinator
    connector = getattr(sched, "connector", None)
    nixl = next((c.connector_scheduler for c in [connector, *getattr(connector, "_connectors",
                                                                      ())]
                 if type(c).__name__.startswith("Nixl")
                 and getattr(c, "connector_scheduler", None) is not None), None)
    multi = getattr(spec, "use_multi_module_mtp", None)
    return {
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        # vLLM's own reading: one draft module per token, or one reused (None: the
        # release does not tell them apart).
        "multi_module_mtp": multi() if callable(multi) else None,
        "lookahead_slots": getattr(sched, "num_lookahead_tokens", None),
        "prefill_lookahead_tokens": getattr(sched.vllm_config,
                                            "num_prefill_lookahead_tokens", None),
        "nixl_prefill_backoff": (nixl._prefill_backoff()
                                 if nixl is not None and hasattr(nixl, "_prefill_backoff")
                                 else None),
        "drops_last_matched_block": drops_last_matched_block(coordinator),
    }


def kv_events(sched) -> list[dict]:
    """Per KV cache group, what its ``BlockStored`` events say: the block size the
    block pool is given for it (``cache_full_blocks(block_size=manager.block_size)``),
    which a router must chunk prompts by (vllm-router's ``--kv-event-block-size``),
    its spec, and for a Mamba group its cache mode: in align mode it caches, and
    announces, only the blocks holding a state, with ``token_ids`` over the whole
    range (vllm#44451)."""
    groups = []
    for manager in sched.kv_cache_manager.coordinator.single_type_managers:
        spec = manager.kv_cache_spec
        groups.append({"group_idx": manager.kv_cache_group_id,
                       "type": type(spec).__name__, "block_size": manager.block_size,
                       **({"mamba_cache_mode": spec.mamba_cache_mode}
                          if hasattr(spec, "mamba_cache_mode") else {})})
    return groups


#: The probe's synthetic group: block i is cached where the layout has "x", a null block
#: where "-" (a Mamba group in align mode caches only the block where a chunk ended).
SKIPPING_LAYOUT = "--x"
PROBE_BLOCK_SIZE = 4


def block_stored_runs() -> dict:
    """What this tree's ``BlockPool.cache_full_blocks`` publishes, KV events on, for a
    group that skips blocks (:data:`SKIPPING_LAYOUT`, as the block pool's own upstream
    test of vllm#44451 lays it out): each ``BlockStored``'s hashes, the blocks its
    ``token_ids`` span and its parent, as block indices. ``per_run``: every event holds
    one run of cached blocks, each hash with its own tokens and the run's parent the
    hash of the block before it; stock vLLM pairs the cached hashes with token_ids over
    the whole range and the parent before it (vllm#44451)."""
    from vllm.distributed.kv_events import BlockStored
    from vllm.utils.hashing import sha256
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import (get_request_block_hasher, init_none_hash,
                                             maybe_convert_block_hash)
    from vllm.v1.request import Request
    from vllm import SamplingParams

    bs, n = PROBE_BLOCK_SIZE, len(SKIPPING_LAYOUT)
    init_none_hash(sha256)
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=bs,
                     enable_kv_cache_events=True)
    req = Request(request_id="kv-events-probe", prompt_token_ids=list(range(100, 100 + n * bs)),
                  sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                  block_hasher=get_request_block_hasher(bs, sha256))
    new_blocks = iter(pool.get_new_blocks(SKIPPING_LAYOUT.count("x")))
    blocks = [next(new_blocks) if c == "x" else pool.null_block for c in SKIPPING_LAYOUT]
    pool.cache_full_blocks(request=req, blocks=blocks, num_cached_blocks=0,
                           num_full_blocks=n, block_size=bs, kv_cache_group_id=1)
    # Every hash, parent and token chunk read back as the index of its block.
    index = {maybe_convert_block_hash(h): i for i, h in enumerate(req.block_hashes)}
    chunks = [list(req.all_token_ids[i * bs:(i + 1) * bs]) for i in range(n)]
    events = []
    for event in pool.take_events():
        if isinstance(event, BlockStored):
            token_ids = list(event.token_ids)
            events.append({
                "hashes": [index.get(h) for h in event.block_hashes],
                "token_blocks": [chunks.index(token_ids[i:i + bs]) if token_ids[i:i + bs]
                                 in chunks else None for i in range(0, len(token_ids), bs)],
                "parent": (None if event.parent_block_hash is None
                           else index.get(event.parent_block_hash))})
    runs = []
    for i, c in enumerate(SKIPPING_LAYOUT):
        if c == "x" and runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        elif c == "x":
            runs.append([i])
    per_run = events == [{"hashes": run, "token_blocks": run,
                          "parent": run[0] - 1 if run[0] else None} for run in runs]
    return {"layout": SKIPPING_LAYOUT, "events": events, "per_run": per_run}


def _block_stored() -> dict:
    try:
        return block_stored_runs()
    except Exception as exc:  # noqa: BLE001 - reported, the other answers stand
        return _error(exc)


def drops_last_matched_block(coordinator) -> bool:
    """Whether vLLM's coordinator drops a hit's last matched block for the draft: v0.33
    names the groups that drop (``drop_eagle_group_ids``; lookahead hashes flag groups
    that do not), v0.32 drops for every flagged group (``eagle_group_ids``), older
    releases keep one ``use_eagle`` flag."""
    if hasattr(coordinator, "drop_eagle_group_ids"):
        return bool(coordinator.drop_eagle_group_ids)
    if hasattr(coordinator, "eagle_group_ids"):
        return bool(coordinator.eagle_group_ids)
    return bool(getattr(coordinator, "use_eagle", False))


def _scheduler(vllm_config, kv_cache_config, block_size: int, hash_block_size: int):
    """vLLM's scheduler as ``EngineCore.__init__`` builds it: the configured class
    (async scheduling picks vLLM's AsyncScheduler), the block sizes it resolved."""
    from vllm.v1.structured_output import StructuredOutputManager

    scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
    return scheduler_cls(
        vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        include_finished_set=False, block_size=block_size,
        hash_block_size=hash_block_size,
    )


#: The decode instance's followers of question 3: (name, how it reaches the decode
#: instance). Each shares the donor's cached prefix; a remote prefill carries the
#: ``kv_transfer_params`` a PD proxy hands the decode instance (NIXL's format).
FOLLOWERS = (
    ("remote_prefill", "a remote prefill (do_remote_prefill) sharing the prefix"),
    ("remote_prefill_prefix_plus_one",
     "a remote prefill whose prompt is the cached prefix and one token"),
    ("plain", "a plain request sent straight to the decode instance"),
)
#: What a request that never gets through its prompt is told apart by.
STUCK = "stuck"
#: The donor's prefix, in scheduler blocks, and each follower's own tail after it.
PREFIX_BLOCKS, TAIL_BLOCKS = 2, 1


def _import_patch_helpers(patch_tests: str):
    """The patch tests' own builders, Mamba-state checker and hash-store stand-ins
    (``tests/patches``, imported as its package: its modules import their siblings
    relatively), so this question is measured exactly as the patch tests measure it."""
    import importlib

    patch_tests = os.path.abspath(patch_tests)
    if os.path.dirname(patch_tests) not in sys.path:
        sys.path.insert(0, os.path.dirname(patch_tests))
    package = os.path.basename(patch_tests)
    return (importlib.import_module(f"{package}.builders"),
            importlib.import_module(f"{package}.mamba_state"),
            importlib.import_module(f"{package}.hash_stores"))


def _lmcache_stand_in(patch_tests: str | None):
    """``(why not, None)``, or ``(None, stand_in)``: ``stand_in(chunk_tokens)`` makes an
    empty stand-in server of that chunk size and returns a factory of the context in
    which vLLM builds lmcache's own LMCacheMPConnector against it (the patch tests'
    ``hash_stores.lmcache_adapter_stub``)."""
    if not patch_tests or not os.path.isdir(patch_tests):
        return "the series' patch tests (tests/patches), which hold the stand-in, are " \
               "not at hand", None
    try:
        _, _, hash_stores = _import_patch_helpers(patch_tests)
        reason = hash_stores.lmcache_mp_unavailable()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}", None
    if reason is not None:
        return reason, None
    def stand_in(chunk_tokens: int):
        server = hash_stores.FakeLMCacheServer(chunk_tokens)
        return lambda: hash_stores.lmcache_adapter_stub(server)

    return None, stand_in


def decode_hits(patch_tests: str | None, probe, new_scheduler, hash_block_size: int) -> dict:
    """Question 3: which requests keep a local prefix hit on a decode instance, and
    whether the Mamba state each resumes from exists.

    As the patch tests drive it (``tests/patches/decode_hit``): a fresh scheduler
    per follower serves a donor remote prefill (its connector loads the prompt; the
    worker reports the load finished the step after), which leaves the prefix's
    attention blocks cached, and whichever Mamba states the block pool then holds
    inside the prefix (read from it, per Mamba group: ``donor_prefix_mamba``); then
    the follower. The patch tests' ``MambaStateChecker`` watches every admission and
    says which state the model would read at the resume point (a cached Mamba block
    of the request's own prefix, a NIXL load ending where the prefiller's state
    belongs, or none). A model without Mamba layers has no state to resume from:
    the question does not apply."""
    if not patch_tests or not os.path.isdir(patch_tests):
        return {"unknown": "the series' patch tests (tests/patches), whose scheduler "
                           "driving this question reuses, are not at hand"}
    if not _mamba_group_ids(probe.kv_cache_config):
        return {"not_applicable": "the model's KV cache groups hold no Mamba group: no "
                                  "request resumes from a Mamba state"}
    try:
        builders, mamba_state, hash_stores = _import_patch_helpers(patch_tests)
    except Exception as exc:  # noqa: BLE001
        return _error(exc)
    if probe.connector is None:
        return {"unknown": "no KV connector: a decode instance without one receives no "
                           "remote prefills"}
    bs = probe.block_size
    prompt_len = (PREFIX_BLOCKS + TAIL_BLOCKS) * bs
    max_len = probe.max_model_len
    if prompt_len + 8 > max_len:
        return {"unknown": f"a prompt of {PREFIX_BLOCKS + TAIL_BLOCKS} blocks of {bs} "
                           f"tokens does not fit max_model_len {max_len}"}
    prefix = builders.prompt(PREFIX_BLOCKS * bs, seed=1)
    tails = {name: builders.prompt(TAIL_BLOCKS * bs, seed=3 + n)
             for n, (name, _) in enumerate(FOLLOWERS)}
    tails["remote_prefill_prefix_plus_one"] = [5]
    out = {"block_size": bs, "cached_prefix_tokens": len(prefix),
           "donor_prefix_mamba": None, "requests": []}
    for name, what in FOLLOWERS:
        try:
            said = _follow(builders, mamba_state, hash_stores, new_scheduler,
                           hash_block_size, prefix, prefix + tails[name],
                           remote=name != "plain")
        except Exception as exc:  # noqa: BLE001 - vLLM's refusal is the answer
            said = _error(exc)
        # Each donor is the same request on a fresh instance: the first one read says it.
        left = said.pop("donor_prefix_mamba", None)
        if out["donor_prefix_mamba"] is None:
            out["donor_prefix_mamba"] = left
        out["requests"].append({"kind": name, "what": what, **said})
    return out


def hang_probes(patch_tests: str | None, probe, new_scheduler, hash_block_size: int) -> dict:
    """Question 4: whether the prompt lengths that hang stock v0.32+ on a hybrid
    model are served: ``lookahead_chunk``, per ``r`` from 1 to the drafter's prefill
    lookahead less one (at least 1), a remote prefill of two blocks plus ``r``
    tokens, driven on a fresh scheduler of this deployment's own config as the patch
    tests drive theirs (``mamba_state.Driver``: one batch at a time, its load
    reported finished the step after it starts, the drafts the speculative config
    proposes). With multi-module MTP (a lookahead of N) NIXL's prefiller stops
    ``N - 1`` tokens short, and a request that resumes inside a block ending fewer
    than N tokens before its prompt does gets no chunk from vLLM's align rule and
    its lookahead together. A request is ``served`` when it gets through its prompt
    and finishes; one that does not says where it waits."""
    if not patch_tests or not os.path.isdir(patch_tests):
        return {"unknown": "the series' patch tests (tests/patches), whose scheduler "
                           "driving this question reuses, are not at hand"}
    if not _mamba_group_ids(probe.kv_cache_config):
        return {"not_applicable": "the model's KV cache groups hold no Mamba group"}
    if probe.connector is None or not any(
            type(c).__name__.startswith("Nixl")
            for c in [probe.connector, *getattr(probe.connector, "_connectors", ())]):
        return {"not_applicable": "no NIXL connector: no remote prefill to probe"}
    try:
        builders, mamba_state, hash_stores = _import_patch_helpers(patch_tests)
    except Exception as exc:  # noqa: BLE001
        return _error(exc)
    config = probe.vllm_config
    spec = config.speculative_config
    num_spec = spec.num_speculative_tokens if spec is not None else 0
    lookahead = getattr(config, "num_prefill_lookahead_tokens", 0) or 0
    bs = probe.block_size

    def serve(tokens: list) -> dict:
        """A remote prefill of ``tokens`` on a fresh scheduler, driven to its end."""
        sched = new_scheduler()
        names = [type(c).__name__
                 for c in getattr(sched.connector, "_connectors", [sched.connector])]
        worker = (hash_stores.OffloadingWorker(sched) if "OffloadingConnector" in names
                  else None)
        checker = mamba_state.MambaStateChecker(sched)
        req = builders.request(
            tokens, kv_transfer_params=builders.remote_prefill_params(-(-len(tokens) // bs)),
            block_size=hash_block_size, max_tokens=2)
        driver = mamba_state.Driver(sched, checker, (), num_spec, rng=random.Random(0),
                                    worker=worker)
        sched.add_request(req)
        try:
            for _ in range(600):
                driver.step()
                if req.is_finished() and not driver.held():
                    break
        except mamba_state.MambaStateViolation as exc:
            return {"prompt_tokens": len(tokens), "served": False, "problem": str(exc)}
        served = req.is_finished() and req.num_computed_tokens >= req.num_prompt_tokens
        return {"prompt_tokens": len(tokens), "served": served,
                **({} if req.is_finished() else
                   {"waits": f"{req.status.name}, {req.num_computed_tokens} of "
                             f"{req.num_prompt_tokens} prompt tokens computed"})}

    prefix = builders.prompt(PREFIX_BLOCKS * bs, seed=1)
    out: dict = {"block_size": bs, "prefill_lookahead_tokens": lookahead}
    try:
        out["lookahead_chunk"] = [
            {"past_block_boundary": r, **serve(prefix + builders.prompt(r, seed=7))}
            for r in range(1, max(2, lookahead))]
    except Exception as exc:  # noqa: BLE001 - vLLM's refusal is the answer
        out["lookahead_chunk"] = _error(exc)
    return out


def _mamba_group_ids(kv_cache_config) -> list[int]:
    """The KV cache groups of Mamba layers (by the spec's class name, as the groups
    step reports them: vLLM's MambaSpec or a subclass)."""
    return [i for i, g in enumerate(kv_cache_config.kv_cache_groups)
            if any(c.__name__ == "MambaSpec" for c in type(g.kv_cache_spec).__mro__)]


def _prefix_mamba(checker, req, prefix_blocks: int) -> list[dict]:
    """Per Mamba group, the blocks among the first ``prefix_blocks`` of ``req`` whose
    Mamba state the block pool holds cached (``block_pool.get_cached_block`` on the
    request's block hashes, as the checker reads them at an admission)."""
    return [{"group": gid, "blocks": sorted(i for i in found if i < prefix_blocks)}
            for gid, found in zip(checker.mamba_group_ids, checker._cached_states(req))]


def _state_source(mamba_state, adm, problem: str | None) -> str:
    """Where the follower's Mamba state at its resume point comes from, as far as the
    checker checked it. ``loaded`` only where it checked what the load brings (a NIXL
    load must end where the prefiller's state belongs); ``unchecked`` for any other
    load (one from 0 brings its own state, DecodeBench's is taken as declared)."""
    local = adm.resume_point - adm.external_tokens
    if problem is not None:
        return "missing"
    if adm.resume_point == 0:
        return "not needed"  # computes from its first token
    if adm.external_tokens and adm.serving_connector in mamba_state.NIXL_CONNECTORS:
        return "loaded"
    if adm.external_tokens and (
            local == 0 or adm.serving_connector in mamba_state.LOAD_STATE_CHECKS):
        return "unchecked"
    return "cached"


def _follow(builders, mamba_state, hash_stores, new_scheduler, hash_block_size: int,
            prefix: list, tokens: list, remote: bool) -> dict:
    sched = new_scheduler()
    names = [type(c).__name__ for c in getattr(sched.connector, "_connectors", [sched.connector])]
    worker = hash_stores.OffloadingWorker(sched) if "OffloadingConnector" in names else None
    checker = mamba_state.MambaStateChecker(sched)

    def request(tokens, remote):
        params = builders.remote_prefill_params(-(-len(tokens) // sched.block_size))
        return builders.request(tokens, kv_transfer_params=params if remote else None,
                                block_size=hash_block_size)

    def serve(req) -> str | None:
        """Drive ``req`` through its prompt; the checker's objection, if any."""
        sched.add_request(req)
        for _ in range(4 * req.num_prompt_tokens):
            try:
                hash_stores.hash_store_step(sched, checker, worker)
            except mamba_state.MambaStateViolation as exc:
                return str(exc)
            if req.num_computed_tokens >= req.num_prompt_tokens:
                return None
        return STUCK

    donor = request(prefix + builders.prompt(TAIL_BLOCKS * sched.block_size, seed=2), True)
    problem = serve(donor)
    if problem is STUCK:
        return {"unknown": "the donor did not get through its prompt on this scheduler"}
    if problem is not None:
        return {"unknown": f"the donor itself broke the Mamba-state invariant: {problem}"}
    # The checker reads one block hash per scheduler block: elsewhere, not measured.
    left = (_prefix_mamba(checker, donor, len(prefix) // sched.block_size)
            if hash_block_size == sched.block_size else None)
    follower = request(tokens, remote)
    problem = serve(follower)
    if problem is STUCK:
        return {"unknown": "the follower did not get through its prompt on this scheduler"}
    adm = next((a for a in checker.admissions if a.request_id == follower.request_id), None)
    if adm is None:
        return {"unknown": "the follower was never admitted"}
    return {"prompt_tokens": len(tokens),
            "local_hit_tokens": adm.resume_point - adm.external_tokens,
            "external_tokens": adm.external_tokens, "served_by": adm.serving_connector,
            "resume_point": adm.resume_point,
            "mamba_state": _state_source(mamba_state, adm, problem),
            **({"problem": problem} if problem else {}), "donor_prefix_mamba": left}


def _waits_for_a_server(kv: dict | None) -> bool:
    """Whether the set holds a connector whose scheduler side waits for its server."""
    if not kv:
        return False
    children = (kv.get("kv_connector_extra_config") or {}).get("connectors") or []
    return kv.get("kv_connector") == "LMCacheMPConnector" or any(
        _waits_for_a_server(c) for c in children)


def _spec(spec) -> dict:
    out = {"type": type(spec).__name__, "block_size": spec.block_size,
           "page_size_bytes": spec.page_size_bytes}
    for field in ("sliding_window", "page_size_padded", "mamba_cache_mode",
                  "num_speculative_blocks", "dtype", "num_kv_heads", "head_size"):
        value = getattr(spec, field, None)
        if value is not None:
            out[field] = str(value) if field == "dtype" else value
    return out


#: The prefix of the line that carries the answer (vLLM logs to stdout too), and of
#: the lines that say which step runs and what each finished one found.
MARKER = "HYBRIDPD-EXPLAIN"
STEP = "HYBRIDPD-EXPLAIN-STEP"


class _Steps(dict):
    """``{step: answer}`` of case ``case``, each answer printed as it is found, so that
    a driver stopped at its time limit still tells what it had answered and where it
    waited."""

    def __init__(self, case: int):
        super().__init__()
        self.case = case

    def running(self, name: str) -> None:
        print(f"{STEP} {json.dumps({'case': self.case, 'running': name})}", flush=True)

    def __setitem__(self, name: str, answer: dict) -> None:
        super().__setitem__(name, answer)
        print(f"{STEP} {json.dumps({'case': self.case, 'done': name, 'answer': answer})}",
              flush=True)


def _init_distributed() -> None:
    """One rank, one process group, as a single-GPU engine has (once per process)."""
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.utils.network_utils import get_open_port

    if model_parallel_is_initialized():
        return
    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}")
    ensure_model_parallel_initialized(1, 1)


def explain(request: dict, case: int = 0) -> dict:
    out: dict = {"steps": _Steps(case)}
    t0 = time.monotonic()
    from vllm.config import KVTransferConfig, set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    out["import_s"] = round(time.monotonic() - t0, 1)
    try:
        import vllm

        out["vllm_version"] = vllm.__version__
    except Exception:  # noqa: BLE001 - a version is only reported
        pass
    out["steps"].running("start")
    kv = request.get("kv_transfer_config")
    text_only = {"language_model_only": True} if request.get("text_only") else {}
    try:
        args = EngineArgs(
            model=request["model"], skip_tokenizer_init=True, load_format="dummy",
            kv_transfer_config=KVTransferConfig(**kv) if kv else None,
            **text_only, **request.get("engine_args", {}),
        )
        config = args.create_engine_config()
    except Exception as exc:  # noqa: BLE001 - vLLM's refusal is the answer
        out["steps"]["start"] = _error(exc)
        return out
    mm = getattr(config.model_config, "multimodal_config", None)
    if text_only and mm is not None:
        # A KV consumer accepts precomputed embeddings, for which vLLM builds the
        # multimodal processor, which needs the tokenizer a config-only directory
        # lacks. Nothing of the KV cache depends on it.
        mm.enable_mm_embeds = False
    cc, sc = config.cache_config, config.scheduler_config
    out["steps"]["start"] = {
        "architecture": config.model_config.architecture,
        "hybrid_kv_cache_manager": not sc.disable_hybrid_kv_cache_manager,
        "mamba_cache_mode": getattr(cc, "mamba_cache_mode", None),
        "enable_prefix_caching": cc.enable_prefix_caching,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "block_size": cc.block_size,
        "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
    }
    with set_current_vllm_config(config):
        out["steps"].running("groups")
        try:
            _init_distributed()
            from vllm.platforms import current_platform
            from vllm.v1.engine.core import EngineCore

            with _tensor_parallel_rank(config.parallel_config.tensor_parallel_size):
                _build_model(config)
                # As the executor does once the model is loaded: the platform sets
                # the block size (and pads the Mamba page), which the layers' specs
                # read.
                current_platform.update_block_size_for_backend(config)
                specs = _layer_specs(config)
            executor = _executor(config, specs, int(request.get("kv_cache_bytes", 16 << 30)))
            kv_cache_config = EngineCore._initialize_kv_caches(_EngineCore(executor), config)
        except Exception as exc:  # noqa: BLE001
            out["steps"]["groups"] = _error(exc)
            return out
        out["steps"]["groups"] = {
            "kv_cache_bytes": executor.worker.determine_available_memory(),
            "block_size": config.cache_config.block_size,
            "mamba_page_size_padded": getattr(config.cache_config, "mamba_page_size_padded", None),
            "num_blocks": kv_cache_config.num_blocks,
            "groups": [{"layers": len(g.layer_names), **_spec(g.kv_cache_spec)}
                       for g in kv_cache_config.kv_cache_groups],
        }
        out["steps"].running("scheduler")
        server = None
        if _waits_for_a_server(kv):
            # Built for real, its scheduler side would wait for its lmcache server:
            # only its client is stood in, as the patch tests do (lmcache's own class).
            reason, server = _lmcache_stand_in(request.get("patch_tests"))
            if reason is not None:
                out["steps"]["scheduler"] = {
                    "unknown": "LMCacheMPConnector's scheduler side connects to its lmcache "
                               "server when it is built; explain stands in its client as the "
                               f"patch tests do, which needs lmcache's class here: {reason}"}
                return out
        try:
            from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

            block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, config)
            if server:
                # LMCache's chunk is a whole number of blocks (its connector checks);
                # its docs run one block per chunk.
                server = server(block_size)

            def new_scheduler():
                with server() if server else contextlib.nullcontext():
                    return _scheduler(config, kv_cache_config, block_size, hash_block_size)

            sched = new_scheduler()
        except Exception as exc:  # noqa: BLE001
            out["steps"]["scheduler"] = _error(exc)
            return out
        connector = getattr(sched, "connector", None)
        children = getattr(connector, "_connectors", None) or []
        out["steps"]["scheduler"] = {
            "class": type(sched).__name__,
            "connector": type(connector).__name__ if connector is not None else None,
            "children": [type(c).__name__ for c in children],
            "block_size": block_size, "hash_block_size": hash_block_size,
            "kv_events": kv_events(sched),
            "block_stored": _block_stored(),
            **({"speculative": _speculative(sched)} if config.speculative_config else {}),
            **({"stand_in": "LMCacheMPConnector's lmcache server: an empty stand-in with "
                            "one block per chunk (its client, lmcache's ZMQ adapter, stood "
                            "in as the patch tests do)"}
               if server else {}),
        }
        out["steps"].running("decode_hit")
        out["steps"]["decode_hit"] = decode_hits(
            request.get("patch_tests"), sched, new_scheduler, hash_block_size)
        out["steps"].running("hangs")
        out["steps"]["hangs"] = hang_probes(
            request.get("patch_tests"), sched, new_scheduler, hash_block_size)
    out["total_s"] = round(time.monotonic() - t0, 1)
    return out


def main() -> int:
    """``argv[1]``: ``{"cases": [request, ...]}``, answered in order in this process
    (one vLLM import for all)."""
    cases = json.loads(sys.argv[1])["cases"]
    answers = [explain(request, n) for n, request in enumerate(cases)]
    print(f"{MARKER} {json.dumps(answers)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
