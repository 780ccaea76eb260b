"""Hash-store KV connectors (vLLM's OffloadingConnector, lmcache's
LMCacheMPConnector) on a CPU-only scheduler, with real stored chunks.

Only what crosses a process or device boundary is stood in:

- the OffloadingConnector keeps its real scheduler side and vLLM's real
  ``CPUOffloadingSpec`` manager (pure bookkeeping of stored keys); the GPU
  worker that copies blocks is replaced by :class:`OffloadingWorker`, which
  completes every transfer job the scheduler hands it in the next step. The
  keys the manager holds therefore come from the connector's own store path:
  a request computed on the instance, its attention blocks and its Mamba
  boundary states handed off by the KV cache manager.
- lmcache's ``LMCacheMPConnector`` keeps its real scheduler side; its ZMQ
  client (``LMCacheMPSchedulerAdapter``) is replaced by
  :class:`StubLMCacheAdapter`, which answers lookups from a
  :class:`FakeLMCacheServer` that records stored chunks the way LMCache keys
  them (one key per whole chunk of the token prefix) with the object groups
  LMCache documents for hybrid models (``--separate-object-groups``): the
  attention object of every stored chunk, the Mamba object only where the
  chunk's Mamba slot held a state; a hit ends at a chunk with its Mamba object
  behind an unbroken run of attention objects. :class:`LMCacheWorker` stores
  what the connector's own scheduler side hands its worker in each step (its
  STORE operations), as LMCache with ``null-recurrent-slot-not-stored`` does:
  no Mamba object for a chunk whose last Mamba block is vLLM's null block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import types
from collections.abc import Collection, Iterator, Sequence
from typing import Any

# CPUOffloadingSpec needs a CPU budget; the scheduler side only counts chunks.
OFFLOADING_EXTRA_CONFIG = {"cpu_bytes_to_use": 1 << 24}
LMCACHE_CHUNK_TOKENS = 16
LMCACHE_EXTRA_CONFIG = {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 6555}


class _DeviceOpsStub(types.ModuleType):
    """lmcache's compiled device ops (CUDA only); the scheduler side never
    calls them."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None


def _njit(*args: Any, **kwargs: Any) -> Any:
    """numba.njit without compiling: the decorated function runs as Python."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda fn: fn


def _stub_lmcache_device_ops() -> None:
    try:
        import numba  # noqa: F401
    except ImportError:
        # lmcache imports numba.njit for its token hasher, which only the ZMQ
        # adapter (stubbed here) runs; the CPU test envs do not install numba.
        shim = types.ModuleType("numba")
        shim.njit = _njit  # type: ignore[attr-defined]
        sys.modules["numba"] = shim
    import lmcache

    for name in ("device_ops", "c_ops"):
        if getattr(lmcache, name, None) is None:
            stub = _DeviceOpsStub(f"lmcache.{name}")
            sys.modules.setdefault(f"lmcache.{name}", stub)
            setattr(lmcache, name, sys.modules[f"lmcache.{name}"])


def lmcache_mp_unavailable() -> str | None:
    """Why vLLM cannot resolve ``LMCacheMPConnector`` to lmcache's own class
    here, or None once it does (lmcache's device ops stubbed on a CPU host)."""
    try:
        import lmcache  # noqa: F401
    except ImportError as e:
        return f"lmcache is not installed ({e})"
    _stub_lmcache_device_ops()
    try:
        from lmcache.integration.vllm import lmcache_mp_connector as lm
        from vllm.distributed.kv_transfer.kv_connector.v1 import (
            lmcache_mp_connector as vllm_lm,
        )
    except ImportError as e:
        return f"lmcache's LMCacheMPConnector is not importable ({e})"
    if vllm_lm.LMCacheMPConnector is not lm.LMCacheMPConnector:
        # vLLM resolved it before lmcache was importable: resolve again.
        vllm_lm.LMCacheMPConnector = vllm_lm._resolve_lmcache_mp_connector()
    if vllm_lm.LMCacheMPConnector is not lm.LMCacheMPConnector:
        return "vLLM does not resolve LMCacheMPConnector to lmcache's class"
    version = getattr(lmcache, "__version__", "unknown")
    if not hasattr(lm, "LMCacheMPSchedulerAdapter"):
        return f"lmcache {version} has no LMCacheMPSchedulerAdapter to stub"
    return None


# ---------------------------------------------------------------- LMCache MP


class FakeLMCacheServer:
    """What an LMCache MP server holds for a hybrid model with
    ``--separate-object-groups``: per whole chunk of a token prefix, its
    attention object, and its Mamba object where one was stored."""

    def __init__(self, chunk_tokens: int = LMCACHE_CHUNK_TOKENS):
        self.chunk_tokens = chunk_tokens
        self.chunks: set[tuple[int, ...]] = set()
        self.states: set[tuple[int, ...]] = set()

    def store(self, token_ids: Sequence[int], num_tokens: int | None = None,
              start: int = 0, state_ends: Collection[int] | None = None) -> None:
        """Store the whole chunks of ``token_ids[start:num_tokens]``; the Mamba
        object of the chunks ending at ``state_ends`` (default: every chunk, a
        prompt computed one chunk per step)."""
        n = len(token_ids) if num_tokens is None else num_tokens
        for end in range(start + self.chunk_tokens, n + 1, self.chunk_tokens):
            self.chunks.add(tuple(token_ids[:end]))
            if state_ends is None or end in state_ends:
                self.states.add(tuple(token_ids[:end]))

    def lookup(self, token_ids: Sequence[int], end: int) -> int:
        """Tokens of the longest hit in ``token_ids[:end]``: the last chunk with
        its Mamba object before the first chunk without an attention object."""
        hit = 0
        for e in range(self.chunk_tokens, end + 1, self.chunk_tokens):
            key = tuple(token_ids[:e])
            if key not in self.chunks:
                break
            if key in self.states:
                hit = e
        return hit

    def holds(self, token_ids: Sequence[int], end: int) -> bool:
        """Whether a hit can end at ``end``: its chunk and Mamba object stored."""
        key = tuple(token_ids[:end])
        return key in self.chunks and key in self.states


class StubLMCacheAdapter:
    """Stands in for ``LMCacheMPSchedulerAdapter`` (the ZMQ client): the same
    methods the connector's scheduler side calls, answered from ``server``."""

    server: FakeLMCacheServer  # set by lmcache_adapter_stub

    def __init__(self, *args: Any, **kwargs: Any):
        self.lmcache_tokens_per_chunk = self.server.chunk_tokens
        self.results: dict[str, int] = {}
        self.lookups: list[tuple[str, int]] = []

    def maybe_submit_lookup_request(
        self, request_id, token_ids, cache_salt="", request_configs=None,
        reserve_last_token=False,
    ) -> None:
        if request_id in self.results:
            return
        end = max(0, len(token_ids) - int(reserve_last_token))
        end = end // self.lmcache_tokens_per_chunk * self.lmcache_tokens_per_chunk
        self.results[request_id] = self.server.lookup(list(token_ids), end)
        self.lookups.append((request_id, self.results[request_id]))

    def check_lookup_result(self, request_id: str) -> int | None:
        return self.results.get(request_id)

    def cleanup_lookup_result(self, request_id: str) -> None:
        self.results.pop(request_id, None)

    def free_lookup_locks(self, *args: Any, **kwargs: Any) -> None:
        pass

    def end_session(self, request_id: str) -> None:
        pass

    def report_block_allocations(self, records: Any) -> None:
        pass

    def reset_cache(self) -> bool:
        self.server.chunks.clear()
        self.server.states.clear()
        return True

    def shutdown(self) -> None:
        pass


@contextlib.contextmanager
def lmcache_adapter_stub(server: FakeLMCacheServer) -> Iterator[FakeLMCacheServer]:
    """Build LMCacheMPConnectors inside this block against ``server``."""
    reason = lmcache_mp_unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    from lmcache.integration.vllm import lmcache_mp_connector as lm

    stub = type("StubLMCacheAdapter", (StubLMCacheAdapter,), {"server": server})
    original = lm.LMCacheMPSchedulerAdapter
    lm.LMCacheMPSchedulerAdapter = stub
    try:
        yield server
    finally:
        lm.LMCacheMPSchedulerAdapter = original


@dataclasses.dataclass
class LMCacheWorker:
    """LMCacheMPConnector's worker, seen from the scheduler. Each step it
    stores what the connector's scheduler side handed it (the STORE operations
    of the step's connector metadata: whole prompt chunks as they are computed
    or loaded), as LMCache with ``null-recurrent-slot-not-stored`` does: a
    chunk whose last block in a Mamba group is the null block gets no Mamba
    object. The connector keeps a finished request's blocks until the worker
    reports its stores done, in the next step."""

    sched: Any
    server: FakeLMCacheServer
    reported: set[str] = dataclasses.field(default_factory=set)

    def report(self, output: Any, result: Any) -> None:
        from vllm.v1.outputs import KVConnectorOutput

        for op in self._store_ops(output):
            self.server.store(op.token_ids, op.end, start=op.start,
                              state_ends=self._state_ends(op))
        held = {rid for rid, r in self.sched.requests.items() if r.is_finished()}
        done = held - self.reported
        self.reported = held
        if not done:
            return
        if result.kv_connector_output is None:
            result.kv_connector_output = KVConnectorOutput()
        result.kv_connector_output.finished_sending = done

    @staticmethod
    def _store_ops(output: Any) -> list[Any]:
        meta = output.kv_connector_metadata
        if meta is None:
            return []
        return [
            r.op
            for m in getattr(meta, "metadata", (meta,))
            if type(m).__name__ == "LMCacheMPConnectorMetadata"
            for r in m.requests
            if r.direction == "STORE"
        ]

    def _state_ends(self, op: Any) -> set[int]:
        """Ends of the chunks of ``op`` whose last block holds a Mamba state in
        every Mamba group (``op.block_ids`` cover ``op.start``..``op.end``)."""
        from vllm.v1.kv_cache_interface import MambaSpec

        null = self.sched.kv_cache_manager.block_pool.null_block.block_id
        mamba = [
            (gid, g.kv_cache_spec.block_size)
            for gid, g in enumerate(self.sched.kv_cache_config.kv_cache_groups)
            if isinstance(g.kv_cache_spec, MambaSpec)
        ]
        chunk = self.server.chunk_tokens
        return {
            end
            for end in range(op.start + chunk, op.end + 1, chunk)
            if all(op.block_ids[gid][(end - op.start) // size - 1] != null
                   for gid, size in mamba)
        }


# -------------------------------------------------------------- Offloading


def children(sched: Any) -> list[Any]:
    connector = sched.connector
    return list(getattr(connector, "_connectors", [connector]))


def child(sched: Any, class_name: str) -> Any:
    return next(c for c in children(sched) if type(c).__name__ == class_name)


@dataclasses.dataclass
class OffloadingWorker:
    """The OffloadingConnector's worker, seen from the scheduler: every job the
    scheduler hands it completes within the step. Records the keys of every
    store it completed (what the CPU tier holds)."""

    sched: Any
    pending: dict[int, tuple[bool, set[Any]]] = dataclasses.field(default_factory=dict)
    stored: set[Any] = dataclasses.field(default_factory=set)

    def _scheduler(self) -> Any:
        return child(self.sched, "OffloadingConnector").connector_scheduler

    def take_jobs(self, output: Any) -> None:
        """Note the jobs in this step's connector metadata."""
        meta = output.kv_connector_metadata
        if meta is None:
            return
        metas = getattr(meta, "metadata", (meta,))
        jobs = self._scheduler()._jobs
        for m in metas:
            for job_id in (*getattr(m, "store_jobs", {}), *getattr(m, "load_jobs", {})):
                status = jobs[job_id]
                self.pending[job_id] = (status.is_store, set(status.keys))

    def worker_meta(self) -> Any:
        """The worker metadata reporting every noted job done (None if none)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )

        if not self.pending:
            return None
        for is_store, keys in self.pending.values():
            if is_store:
                self.stored |= keys
        meta = OffloadingWorkerMetadata(completed_jobs={j: 1 for j in self.pending})
        self.pending = {}
        if getattr(self.sched.connector, "_connectors", None) is None:
            return meta
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
            MultiKVConnectorWorkerMetadata,
        )

        return MultiKVConnectorWorkerMetadata(
            metadata=tuple(
                meta if type(c).__name__ == "OffloadingConnector" else None
                for c in children(self.sched)
            )
        )

    def report(self, output: Any, result: Any) -> None:
        """Complete the jobs of ``output`` (a SchedulerOutput) in ``result``, the
        worker's ModelRunnerOutput for it."""
        from vllm.v1.outputs import KVConnectorOutput

        self.take_jobs(output)
        meta = self.worker_meta()
        if meta is not None:
            if result.kv_connector_output is None:
                result.kv_connector_output = KVConnectorOutput()
            result.kv_connector_output.kv_connector_worker_meta = meta

    def load_keys(self, request_id: str) -> set[Any]:
        """Keys of the load jobs of ``request_id`` still tracked by the connector."""
        return {
            k
            for s in self._scheduler()._jobs.values()
            if not s.is_store and s.req_id == request_id
            for k in s.keys
        }


def offload_key(request: Any, block_index: int, group_id: int) -> Any:
    """The key the OffloadingConnector gives the chunk of ``request`` ending
    at block ``block_index`` of ``group_id`` (one block per chunk)."""
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(request.block_hashes[block_index], group_id)


def hash_store_step(sched: Any, checker: Any, worker: OffloadingWorker | None):
    """One engine step checked by ``checker`` (as ``mamba_state.checked_step``):
    one sampled token per scheduled request, every async KV load in flight
    reported finished, and, where an OffloadingConnector is configured, every
    transfer job handed to its worker in this step completed."""
    from vllm.v1.request import RequestStatus

    from .builders import model_runner_output
    from .mamba_state import checked_schedule

    output = checked_schedule(sched, checker)
    reqs = [sched.requests[rid] for rid in output.num_scheduled_tokens]
    loading = {
        rid for rid, r in sched.requests.items()
        if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    }
    result = model_runner_output(reqs, loading or None)
    if worker is not None:
        worker.report(output, result)
    sched.update_from_output(output, result)
    return output


# ------------------------------------------------------------- load checks


@dataclasses.dataclass
class HashStoreLoads:
    """What a hash-store child's load brings to the resume point, from what it
    moves (``MambaStateChecker``'s ``load_checks``): an Offloading load carries,
    for every Mamba group, the stored key of the request's own block hash at the
    resume block; an LMCache load ends at a chunk of the request's own token
    prefix stored with its Mamba object (stored by :class:`LMCacheWorker` only
    where the chunk's Mamba slot held a state)."""

    sched: Any
    server: FakeLMCacheServer
    worker: OffloadingWorker | None = None

    def checks(self) -> dict[str, Any]:
        return {
            "OffloadingConnector": self.offloading_problem,
            "LMCacheMPConnector": self.lmcache_problem,
        }

    def _mamba_group_ids(self) -> list[int]:
        from vllm.v1.kv_cache_interface import MambaSpec

        return [
            i for i, g in enumerate(self.sched.kv_cache_config.kv_cache_groups)
            if isinstance(g.kv_cache_spec, MambaSpec)
        ]

    def offloading_problem(self, adm: Any) -> str | None:
        req = self.sched.requests[adm.request_id]
        block_size = self.sched.block_size
        if adm.resume_point % block_size:
            return "the load ends inside a block"
        assert self.worker is not None
        index = adm.resume_point // block_size - 1
        loading = self.worker.load_keys(adm.request_id)
        for gid in self._mamba_group_ids():
            key = offload_key(req, index, gid)
            if key not in self.worker.stored:
                return f"no stored Mamba chunk of this prefix, group {gid} block {index}"
            if key not in loading:
                return f"the load does not bring group {gid}'s chunk at block {index}"
        return None

    def lmcache_problem(self, adm: Any) -> str | None:
        req = self.sched.requests[adm.request_id]
        if adm.resume_point % self.server.chunk_tokens:
            return "the load ends inside an LMCache chunk"
        if not self.server.holds(req.prompt_token_ids, adm.resume_point):
            return "no chunk of this request's prefix with its Mamba object ends at the resume point"
        return None
