"""One vLLM CPU worker's hybrid KV cache and one LMCache server, in one process.

What is real:
- vLLM (the host pin's tree on ``PYTHONPATH``): the KV cache config of a Qwen3.5-like
  layout (three Gated-DeltaNet layers per full-attention layer, block and chunk 256,
  ``mamba_cache_mode="align"``) from ``get_kv_cache_configs``, the CPU attention
  backend's layout, the allocation (``allocate_kv_cache``: one backing buffer, each
  Mamba page padded to the attention page) and the binding of each layer's views
  (``bind_kv_cache_to_layers``, the Mamba layers' own ``bind_kv_cache`` splitting a
  page into its conv and ssm state views: the tensors the model computes with).
- LMCache (the tree under test): ``lmcache server``'s own argument parsing and
  ``run_cache_server`` on a loopback ZMQ port, vLLM's ``LMCacheMPConnector`` (worker
  role) registering the KV cache with it, and the server's transfer and lookup modules.

Stood in: the model layers are the smallest subclasses of vLLM's ``MambaBase`` and
``AttentionLayerBase`` (no weights: only their ``bind_kv_cache``, vLLM's, is used), and
the scheduler's requests are replaced by calls of the server's store / lookup /
retrieve handlers with the block ids a vLLM scheduler hands out: what the worker
sends the server over ZMQ.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lmcache.v1.distributed.config import add_storage_manager_args, parse_args_to_config
from lmcache.v1.mp_observability.config import (
    add_observability_args,
    parse_args_to_observability_config,
)
from lmcache.v1.multiprocess.config import add_mp_server_args, parse_args_to_mp_server_config
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
from lmcache.v1.multiprocess.modules.lmcache_driven_transfer import (
    LMCacheDrivenTransferModule,
)
from lmcache.v1.multiprocess.modules.lookup import LookupModule
from lmcache.v1.multiprocess.server import run_cache_server
from lmcache.v1.platform.base.event_ipc import get_event_ipc_backend
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
try:  # vLLM 0.33: the planning module, given the model's global groups
    from vllm.v1.core.kv_cache_planning import (
        get_global_kv_cache_groups,
        get_kv_cache_configs,
    )
except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    get_global_kv_cache_groups = None
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
from vllm.v1.worker.utils import allocate_kv_cache, bind_kv_cache_to_layers

from patches import builders  # the patch tests' builders (tests/ is the rootdir)

BLOCK = 256  # vLLM's block (raised to 256 by vLLM on CPU) = LMCache's chunk
CPU = torch.device("cpu")
# A Gated-DeltaNet layer's state: conv (bf16) and ssm (fp32, as vLLM's CPU path keeps it).
STATE_SHAPES = ((3, 256), (2, 32, 32))
STATE_DTYPES = (torch.bfloat16, torch.float32)
NUM_LAYERS = 4  # layers 0-2 linear attention, 3 full attention (one group each)


class _Mamba(MambaBase):
    """Stand-in for a Gated-DeltaNet layer: vLLM's own bind_kv_cache, no weights."""

    def get_state_shape(self):
        return STATE_SHAPES

    def get_state_dtype(self):
        return STATE_DTYPES

    @property
    def mamba_type(self):
        raise NotImplementedError

    def get_attn_backend(self):
        raise NotImplementedError


class _Attention(AttentionLayerBase):
    """Stand-in for a full-attention layer: vLLM's own bind_kv_cache."""

    def get_attn_backend(self):
        return CPUAttentionBackend

    def get_kv_cache_spec(self, vllm_config):
        raise NotImplementedError


@dataclass
class Worker:
    """A vLLM CPU worker's KV cache: the allocation, the layers bound to it and the
    LMCache connector that registered it."""

    vllm_config: VllmConfig
    kv_cache_config: Any
    kv_caches: dict[str, torch.Tensor]
    layers: dict[str, AttentionLayerBase]
    connector: Any = None

    @property
    def mamba_layers(self) -> list[str]:
        return [n for n, layer in self.layers.items() if isinstance(layer, _Mamba)]

    def group_of(self, layer_name: str) -> int:
        """The KV cache group (= the LMCache engine group) holding ``layer_name``."""
        return next(
            gid
            for gid, group in enumerate(self.kv_cache_config.kv_cache_groups)
            if layer_name in group.layer_names
        )

    def write_state(self, block_ids: list[list[int]], chunk: int, seed: int) -> list:
        """Write a distinct state into every Mamba layer's block of ``chunk`` (its
        group's entry of ``block_ids``) through the layer's own views, as the model
        does, and return it."""
        written = []
        gen = torch.Generator().manual_seed(seed)
        for name in self.mamba_layers:
            block = block_ids[self.group_of(name)][chunk]
            for state in self.layers[name].kv_cache:
                value = torch.randn(state[block].shape, generator=gen).to(state.dtype)
                state[block].copy_(value)
                written.append(value)
        return written

    def read_state(self, block_ids: list[list[int]], chunk: int) -> list:
        """Every Mamba layer's state in its block of ``chunk``, as the model reads it."""
        return [
            state[block_ids[self.group_of(name)][chunk]].clone()
            for name in self.mamba_layers
            for state in self.layers[name].kv_cache
        ]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_config(port: int, max_num_batched_tokens: int = 2 * BLOCK) -> VllmConfig:
    """A decode-or-prefill instance's config with LMCacheMPConnector (kv_both), in
    LMCache's shared-memory transfer mode (the only one that serves several KV groups)."""
    return builders.vllm_config(
        kv_role="kv_both",
        kv_connector="LMCacheMPConnector",
        kv_connector_extra_config={
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": port,
            "lmcache.mp.mp_transfer_mode": "lmcache_driven",
        },
        block_size=BLOCK,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=4,
        max_model_len=8 * BLOCK,
    )


def allocate_worker(
    config: VllmConfig, num_blocks: int = 32, pool_context: bool = True,
    hybrid: bool = True, mamba_spec: dict[str, Any] | None = None,
) -> Worker:
    """Create the LMCache connector, then allocate and bind the KV cache the way
    vLLM's CPU worker does (``Worker.initialize_from_config``): inside the memory
    pool context the connector returns from ``get_mem_pool_context``. With
    ``pool_context=False`` the allocation ignores it, as vLLM releases whose worker
    does not ask the connector (0.20.2) allocate. With ``hybrid=False`` every layer
    is full attention (one KV cache group, unpadded pages): what stock LMCache
    registers on CPU. ``mamba_spec``: further ``MambaSpec`` fields, as a model layer
    sets them (speculative blocks, prefill checkpoint blocks)."""
    from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector

    specs: dict[str, Any] = {}
    layers: dict[str, AttentionLayerBase] = {}
    for i in range(NUM_LAYERS):
        if i % 4 == 3 or not hybrid:
            name = f"model.layers.{i}.self_attn.attn"
            specs[name] = FullAttentionSpec(
                block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
            )
            layers[name] = _Attention()
        else:
            name = f"model.layers.{i}.linear_attn"
            specs[name] = MambaSpec(
                block_size=BLOCK, shapes=STATE_SHAPES, dtypes=STATE_DTYPES,
                mamba_cache_mode="align", **(mamba_spec or {}),
            )
            layers[name] = _Mamba()
    layouts = get_supported_kv_cache_layouts([CPUAttentionBackend])
    layout = resolve_kv_cache_layout(config, [[l.name for l in layouts]], specs.values())
    page = max(spec.page_size_bytes for spec in specs.values())
    # A hybrid layout's groups share one page size; attention layers alone share
    # each block over every layer.
    memory = num_blocks * page * (1 if hybrid else NUM_LAYERS)
    groups = () if get_global_kv_cache_groups is None else (
        get_global_kv_cache_groups(config, [specs]),
    )
    kv_cache_config = get_kv_cache_configs(config, [specs], [memory], *groups)[0]
    connector = LMCacheMPConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    context = connector.get_mem_pool_context() if pool_context else None
    with context or contextlib.nullcontext():
        kv_caches = allocate_kv_cache(
            kv_cache_config, CPU, layout,
            [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups],
        )
    bind_kv_cache_to_layers(kv_caches, layers)
    config.compilation_config.static_forward_context.update(layers)
    return Worker(config, kv_cache_config, kv_caches, layers, connector)


@dataclass
class Server:
    """An in-process ``lmcache server``; ``store`` / ``lookup`` / ``retrieve`` call
    its handlers as the worker's ZMQ requests would."""

    port: int
    request_server: Any
    engine: Any
    model_name: str = ""  # the name the connector registered (vLLM's model)
    _events: Any = field(default=None, repr=False)

    def _module(self, cls):
        return next(m for m in self.engine._modules if isinstance(m, cls))

    def _handle(self) -> bytes:
        backend = self._events or get_event_ipc_backend(CPU)
        self._events = backend
        event = backend.create_event(CPU)
        backend.record_event(event, None)
        return backend.export_event(event, CPU)

    def _key(self, tokens: Sequence[int], end: int, request_id: str, worker: bool):
        return IPCCacheServerKey(
            self.model_name, 1, 0 if worker else None, tuple(tokens), 0, end, request_id,
            num_kv_readers=1,
        )

    def registered_instance(self) -> int:
        entries = self._module(LMCacheDrivenTransferModule).context_entries_snapshot()
        assert len(entries) == 1, f"expected one registered worker, got {entries}"
        return next(iter(entries))

    def store(self, tokens: Sequence[int], block_ids: list[list[int]]) -> list[bool]:
        """Store ``tokens`` (whole chunks) from the worker blocks ``block_ids``
        (per KV cache group); returns which chunks were stored."""
        end = len(tokens) // BLOCK * BLOCK
        transfer = self._module(LMCacheDrivenTransferModule)
        key = self._key(tokens, end, f"store-{time.monotonic_ns()}", True)
        instance = self.registered_instance()
        _, ok, stored = transfer.store_with_chunk_mask(
            key, instance, block_ids, self._handle()
        )
        assert ok, "the store failed"
        # The copy completes on the server's callback thread: wait until every
        # object the store reserved is committed (its write lock released), as a
        # later request of a real deployment would find it.
        groups = transfer.context_entries_snapshot()[instance].cache_context
        num_groups = groups.kv_layer_groups_manager.num_object_groups
        keys = self.engine.context.resolve_obj_keys(key, list(range(num_groups)))
        l1 = self.engine.context.storage_manager._l1_manager
        deadline = time.monotonic() + 30
        for group_keys in keys:
            for chunk, obj_key in enumerate(group_keys):
                while stored[chunk]:
                    state = l1.get_object_state(obj_key)
                    if state is not None and not state.write_lock.is_locked():
                        break
                    assert time.monotonic() < deadline, "the store never committed"
                    time.sleep(0.005)
        return stored

    def lookup(self, tokens: Sequence[int], request_id: str) -> int:
        """The number of leading chunks the server would load for ``tokens``."""
        end = len(tokens) // BLOCK * BLOCK
        lookup = self._module(LookupModule)
        lookup.lookup(self._key(tokens, end, request_id, False), 1)
        hit = lookup.wait_prefetch_status(request_id, 30.0)
        assert hit is not None, "the lookup did not finish"
        return hit

    def retrieve(self, tokens: Sequence[int], block_ids: list[list[int]], request_id: str) -> bool:
        """Load the chunks of ``tokens`` into the worker blocks ``block_ids``."""
        end = len(tokens) // BLOCK * BLOCK
        _, ok = self._module(LMCacheDrivenTransferModule).retrieve(
            self._key(tokens, end, request_id, True), self.registered_instance(),
            block_ids, self._handle(),
        )
        return ok


def server_args(extra: Sequence[str] = ()) -> list[str]:
    """``lmcache server`` flags: the ones hybridpd's e2e uses, metrics off."""
    return [
        "--host", "127.0.0.1", "--chunk-size", str(BLOCK), "--l1-size-gb", "0.1",
        "--eviction-policy", "LRU", "--disable-metrics", *extra,
    ]


@contextlib.contextmanager
def lmcache_server(extra: Sequence[str] = ()) -> Iterator[Server]:
    """Start ``lmcache server`` in this process on a free loopback port."""
    port = _free_port()
    parser = argparse.ArgumentParser()
    add_mp_server_args(parser)
    add_storage_manager_args(parser)
    add_observability_args(parser)
    args = parser.parse_args([*server_args(extra), "--port", str(port)])
    request_server, engine = run_cache_server(
        parse_args_to_mp_server_config(args),
        parse_args_to_config(args),
        parse_args_to_observability_config(args),
        return_engine=True,
        start_prometheus_http_server=False,
    )
    try:
        yield Server(port, request_server, engine)
    finally:
        request_server.close()
        engine.close()


def register(worker: Worker, server: Server) -> Any:
    """vLLM's LMCacheMPConnector (worker role) registers the worker's KV cache."""
    worker.connector.register_kv_caches(worker.kv_caches)
    server.model_name = worker.vllm_config.model_config.model
    return worker.connector
