"""The decode instance's hash-store children for ``decode_replay.py``: vLLM's
OffloadingConnector and lmcache's LMCacheMPConnector beside NIXL.

Runs inside a pin's test environment (imported by ``decode_replay.py`` from its own
directory). The connectors are the real classes, built as the patch tests build them
(``tests/patches/hash_stores.py``): the OffloadingConnector keeps its scheduler side and
vLLM's CPU offloading manager, its GPU worker stood in by ``OffloadingWorker`` (every
transfer job completes within the step); lmcache's LMCacheMPConnector keeps its
scheduler side, its ZMQ client answering from a stand-in server. What the store holds
comes from each connector's own store path: the Offloading tier gets a request the
decode instance computed or loaded, handed off when it finishes; the LMCache server gets
the chunks the connector hands its worker at each step, with the object groups LMCache
documents for hybrid models (a chunk's Mamba object only where its Mamba slot held a
state: LMCache with ``null-recurrent-slot-not-stored``).

The store's capacity is ``store_blocks`` chunks of one block each: the Offloading tier
gets the CPU bytes vLLM's own sizing turns into exactly that many chunks; the LMCache
stand-in server keeps that many chunks, least recently used evicted first.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Sequence

#: The builders' name of each bench set whose children differ from theirs (the
#: builders' ``nixl+lmcache`` is LMCacheConnectorV1; the deployed set is LMCacheMP).
#: The probe tier's bytes (the scheduler side allocates nothing for it): 1 TiB holds
#: tens of thousands of chunks, so ``PROBE_BYTES // chunks`` is a chunk's aligned size
#: to within a byte for any ``store_blocks`` below that count (``scheduler`` checks the
#: tier it then builds holds exactly ``store_blocks``).
PROBE_BYTES = 1 << 40
BUILDERS_KIND = {"nixl+lmcache": "nixl+lmcachemp", "lmcache+nixl": "lmcachemp+nixl"}


def capped_server(hash_stores, chunk_tokens: int, capacity: int):
    """A ``FakeLMCacheServer`` that holds at most ``capacity`` chunks (LRU; a chunk's
    Mamba object goes with it), keyed by the hash of each chunk's token prefix (the
    prefixes themselves would hold gigabytes at vllm#42524's scale)."""

    class CappedServer(hash_stores.FakeLMCacheServer):
        def __init__(self) -> None:
            super().__init__(chunk_tokens)
            # chunk key -> whether its Mamba object is stored
            self.chunks: OrderedDict[int, bool] = OrderedDict()  # type: ignore[assignment]
            self.capacity = capacity
            self.evicted = 0

        def _keys(self, token_ids: Sequence[int], end: int, start: int = 0):
            h = 0
            ids = list(token_ids[:end])
            for e in range(self.chunk_tokens, end + 1, self.chunk_tokens):
                h = hash((h, tuple(ids[e - self.chunk_tokens:e])))
                if e > start:
                    yield e, h

        def store(self, token_ids: Sequence[int], num_tokens: int | None = None,
                  start: int = 0, state_ends=None) -> None:
            n = len(token_ids) if num_tokens is None else num_tokens
            for e, key in self._keys(token_ids, n, start):
                state = state_ends is None or e in state_ends
                self.chunks[key] = self.chunks.get(key, False) or state
                self.chunks.move_to_end(key)
            while len(self.chunks) > self.capacity:
                self.chunks.popitem(last=False)
                self.evicted += 1

        def lookup(self, token_ids: Sequence[int], end: int) -> int:
            hit = 0
            for e, key in self._keys(token_ids, end):
                if key not in self.chunks:
                    break
                self.chunks.move_to_end(key)
                if self.chunks[key]:
                    hit = e
            return hit

        def holds(self, token_ids: Sequence[int], end: int) -> bool:
            keys = list(self._keys(token_ids, end))
            return (bool(keys) and keys[-1][0] == end
                    and self.chunks.get(keys[-1][1], False))

    return CappedServer()


class Stores:
    """The hash-store children of one decode instance: builds its scheduler and
    completes their workers' side each step."""

    def __init__(self, b, hash_stores, kind: str, block_size: int, store_blocks: int) -> None:
        self.b, self.hs = b, hash_stores
        self.kind = BUILDERS_KIND.get(kind, kind)
        self.block_size, self.store_blocks = block_size, store_blocks
        self.lmcache = "lmcachemp" in self.kind
        self.offloading = "offloading" in self.kind
        self.server = None
        if self.lmcache:
            reason = hash_stores.lmcache_mp_unavailable()
            if reason is not None:
                raise RuntimeError(f"LMCacheMPConnector: {reason}")
            self.server = capped_server(hash_stores, block_size, store_blocks)
        self.workers: list[Any] = []

    def connectors(self, cpu_bytes: int | None = None) -> dict[str, Any]:
        """``vllm_config``'s connector arguments, the Offloading tier sized."""
        args = self.b.connectors(self.kind)
        for child in args.get("kv_connector_extra_config", {}).get("connectors", ()):
            if child["kv_connector"] == "OffloadingConnector" and cpu_bytes is not None:
                child["kv_connector_extra_config"]["cpu_bytes_to_use"] = cpu_bytes
        return args

    def scheduler(self, new_config, kv_cache_config):
        """The decode instance's scheduler (``new_config(connector_args)`` builds its
        VllmConfig), with its store holding ``store_blocks`` chunks."""
        cpu_bytes = None
        if self.offloading:
            # vLLM sizes the tier from bytes: ask it for the bytes of one chunk.
            probe = self._build(new_config(self.connectors(PROBE_BYTES)), kv_cache_config)
            manager = self._offloading(probe).manager
            info = getattr(manager, "_config_info", None)
            if info:  # v0.33 publishes the tier's sizes
                per_chunk = info["cpu_kv_cache_size_bytes"] // info["cpu_num_chunks"]
            else:  # v0.32: only the chunk count, PROBE_BYTES // (aligned chunk size)
                per_chunk = PROBE_BYTES // manager._num_chunks
            cpu_bytes = per_chunk * self.store_blocks
        sched = self._build(new_config(self.connectors(cpu_bytes)), kv_cache_config)
        if self.offloading:
            chunks = self._offloading(sched).manager._num_chunks
            if chunks != self.store_blocks:
                raise RuntimeError(f"the Offloading tier holds {chunks} chunks, "
                                   f"not {self.store_blocks}")
            self.workers.append(self.hs.OffloadingWorker(sched))
        if self.lmcache:
            self.workers.append(self.hs.LMCacheWorker(sched, self.server))
        return sched

    def _build(self, config, kv_cache_config):
        stub = (self.hs.lmcache_adapter_stub(self.server) if self.lmcache
                else contextlib.nullcontext())
        with stub:
            return self.b.scheduler(config, kv_cache_config)

    def _offloading(self, sched):
        return self.hs.child(sched, "OffloadingConnector").connector_scheduler

    def report(self, output, result) -> None:
        """The hash-store workers' part of the step's ModelRunnerOutput."""
        for worker in self.workers:
            worker.report(output, result)

    def evicted(self) -> int | None:
        """Chunks the LMCache server evicted (None without one)."""
        return self.server.evicted if self.server is not None else None
