"""Small builders of real vLLM objects for the patch tests.

Every patch test builds real vLLM classes (KVCacheConfig, KVCacheManager,
Scheduler, connectors) from a few arguments, so that each test reads as a
scenario: build, act, assert the one thing that matters. Nothing here copies
vLLM logic; what crosses a process or device boundary (the LMCache engine, a
remote KV transfer) is the only thing faked.

The model is a tiny local OPT config written to a temporary directory: the
scheduler and the KV cache manager never run the model, they only need a
ModelConfig that resolves offline. Multi-module MTP needs a target whose
checkpoint carries MTP modules: a tiny Qwen3-Next config
(:func:`tiny_mtp_model_dir`). Their model classes are inspected in the test
process (:func:`inspect_in_process`). The hybrid layout itself comes from the
KVCacheConfig: one full-attention group plus Mamba groups in
``mamba_cache_mode="align"``, the layout of Qwen3.5 (three Gated-DeltaNet
layers for every full-attention layer).
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from collections.abc import Sequence
from itertools import count
from pathlib import Path
from typing import Any

import torch

from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 16
EOS_TOKEN_ID = 2

_TINY_OPT_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 64,
    "ffn_dim": 128,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "max_position_embeddings": 32768,
    "vocab_size": 1024,
    "word_embed_proj_dim": 64,
    "do_layer_norm_before": True,
    "bos_token_id": 2,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": 1,
    "torch_dtype": "float32",
}

_request_ids = count(1)
_hash_initialized = False


@functools.cache
def tiny_model_dir() -> str:
    """A local directory holding only a config.json, resolvable offline (one per
    test process, removed at exit)."""
    path = Path(tempfile.mkdtemp(prefix="hybridpd-tiny-opt-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    (path / "config.json").write_text(json.dumps(_TINY_OPT_CONFIG))
    return str(path)


def _tiny_mtp_config(num_mtp_modules: int) -> dict[str, Any]:
    """A tiny Qwen3-Next (Gated DeltaNet + full attention, like Qwen3.5) whose
    checkpoint declares ``num_mtp_modules`` MTP modules
    (``num_nextn_predict_layers``): vLLM maps ``qwen3_next`` to its
    ``qwen3_next_mtp`` draft and reads the module count from that key."""
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "num_hidden_layers": 4,
        "full_attention_interval": 4,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "decoder_sparse_step": 1,
        "max_position_embeddings": 32768,
        "vocab_size": 1024,
        "bos_token_id": 2,
        "eos_token_id": EOS_TOKEN_ID,
        "torch_dtype": "float32",
        "num_nextn_predict_layers": num_mtp_modules,
    }


@functools.cache
def inspect_in_process(*architectures: str) -> None:
    """Have vLLM inspect these model classes in this process.

    ModelConfig asks the registry what a lazily registered architecture supports
    (``_ModelInfo.from_model_cls``), and the registry answers from a subprocess
    that imports vLLM afresh: tens of seconds per test process on 2 cores.
    Registering the class itself (imported here, as that subprocess imports it)
    makes vLLM run the same inspection in this process."""
    from vllm import ModelRegistry

    for arch in architectures:
        ModelRegistry.register_model(arch, ModelRegistry.models[arch].load_model_cls())


@functools.cache
def tiny_mtp_model_dir(num_mtp_modules: int) -> str:
    """A local config-only Qwen3-Next checkpoint with ``num_mtp_modules`` MTP
    modules (one directory per count and test process, removed at exit).

    vLLM inspects the target's and the draft's model classes in a subprocess
    the first time it meets them (tens of seconds on a small machine), then
    keeps the result in memory and on disk (``VLLM_CACHE_ROOT/modelinfos``, keyed
    by the model file's hash): one cached directory per count keeps every later
    config of the process on those caches."""
    path = Path(tempfile.mkdtemp(prefix=f"hybridpd-tiny-mtp{num_mtp_modules}-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    (path / "config.json").write_text(json.dumps(_tiny_mtp_config(num_mtp_modules)))
    return str(path)


def hybrid_kv_cache_config(
    num_blocks: int = 1000,
    block_size: int = BLOCK_SIZE,
    num_mamba_groups: int = 3,
    num_speculative_blocks: int = 0,
    sliding_window: int | None = None,
) -> KVCacheConfig:
    """One full-attention group and ``num_mamba_groups`` Mamba groups in
    align mode (Qwen3.5's layout). ``num_speculative_blocks``: the Mamba blocks
    each request holds beyond its running state for speculative tokens (vLLM
    sets it to ``num_speculative_tokens``). ``sliding_window``: a sliding-window
    attention group of that window beside them (a model that mixes all three)."""
    full = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    mamba = MambaSpec(
        block_size=block_size,
        shapes=((1, 1),),
        dtypes=(torch.float32,),
        mamba_cache_mode="align",
        num_speculative_blocks=num_speculative_blocks,
    )
    groups = [KVCacheGroupSpec(["attn.0"], full)]
    if sliding_window is not None:
        window = SlidingWindowSpec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32,
            sliding_window=sliding_window,
        )
        groups.append(KVCacheGroupSpec(["swa.0"], window))
    groups += [
        KVCacheGroupSpec([f"linear_attn.{i}"], mamba) for i in range(num_mamba_groups)
    ]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def vllm_config(
    kv_role: str | None = "kv_both",
    kv_connector: str | None = "NixlConnector",
    kv_connector_extra_config: dict[str, Any] | None = None,
    mamba_cache_mode: str = "align",
    block_size: int = BLOCK_SIZE,
    max_num_batched_tokens: int = 1024,
    enable_prefix_caching: bool = True,
    kv_load_failure_policy: str = "fail",
    hybrid_kv_cache_manager: bool | None = None,
    max_num_seqs: int = 16,
    max_model_len: int = 4096,
    num_speculative_tokens: int = 0,
    async_scheduling: bool = False,
    spec_method: str = "ngram",
    mtp_modules: int | None = None,
    disable_eagle_block_drop: bool = False,
) -> VllmConfig:
    """A VllmConfig of a PD instance with the hybrid allocator enabled.

    ``kv_role=None`` builds an instance without any KV connector.
    ``kv_load_failure_policy``: "fail" (vLLM's default) or "recompute".
    ``hybrid_kv_cache_manager``: None lets vLLM decide, as a server started
    without ``--[no-]disable-hybrid-kv-cache-manager`` does; True or False is
    the operator's explicit choice. ``num_speculative_tokens``: speculative
    decoding, the scheduler's side of it (no model runs); ``spec_method``:
    "ngram" (no draft model) or "mtp": the target is :func:`tiny_mtp_model_dir`
    with ``mtp_modules`` MTP modules (``num_nextn_predict_layers``; default one
    per speculative token). Multi-module MTP (2 or more modules): the drafter
    reads ``num_speculative_tokens`` prompt tokens ahead of a prefill chunk
    (``VllmConfig.num_prefill_lookahead_tokens``) and NIXL backs off
    ``num_speculative_tokens - 1`` prompt tokens where the release knows
    multi-module MTP. One module (Qwen3.5's checkpoints), run
    ``num_speculative_tokens`` times: vLLM treats it as EAGLE, a prefill
    lookahead of 1 token, NIXL's back-off of 1 (the Mamba state's), the last
    matched block dropped (``drop_eagle_block``) and ``num_speculative_tokens``
    lookahead slots. ``disable_eagle_block_drop``: the speculative config's
    option of that name (keep the trailing cached block EAGLE-like drafters
    drop). ``async_scheduling``: vLLM's AsyncScheduler (see :func:`scheduler`).
    """
    if spec_method not in ("ngram", "mtp"):
        raise ValueError(spec_method)
    mtp = spec_method == "mtp" and num_speculative_tokens > 0
    inspect_in_process(
        *(("Qwen3NextForCausalLM", "Qwen3NextMTP") if mtp else ("OPTForCausalLM",))
    )
    model_config = ModelConfig(
        model=(tiny_mtp_model_dir(mtp_modules or num_speculative_tokens) if mtp
               else tiny_model_dir()),
        dtype="float32",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    if hybrid_kv_cache_manager is not None:
        scheduler_config.disable_hybrid_kv_cache_manager = not hybrid_kv_cache_manager
    cache_config = CacheConfig(
        block_size=block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=enable_prefix_caching,
        mamba_cache_mode=mamba_cache_mode,
    )
    kv_transfer_config = None
    if kv_role is not None:
        kv_transfer_config = KVTransferConfig(
            kv_connector=kv_connector,
            kv_role=kv_role,
            kv_connector_extra_config=kv_connector_extra_config or {},
            kv_load_failure_policy=kv_load_failure_policy,
        )
    speculative_config = None
    if num_speculative_tokens:
        from vllm.config import ParallelConfig, SpeculativeConfig

        parallel_config = ParallelConfig()

        # MTP's draft is the target's own checkpoint (its MTP modules): vLLM
        # builds the draft ModelConfig from the target's directory.
        method_args = (
            {"method": "mtp"} if mtp
            else {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}
        )
        speculative_config = SpeculativeConfig(
            **method_args,
            num_speculative_tokens=num_speculative_tokens,
            **({"disable_eagle_block_drop": True} if disable_eagle_block_drop else {}),
            target_model_config=model_config,
            target_parallel_config=parallel_config,
        )
    if async_scheduling:
        scheduler_config.async_scheduling = True
    return VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
        speculative_config=speculative_config,
        **({"parallel_config": parallel_config} if speculative_config else {}),
    )


def scheduler(
    config: VllmConfig,
    kv_cache_config: KVCacheConfig | None = None,
    async_scheduling: bool = False,
) -> Scheduler:
    """A real Scheduler (with its real KV connector, if configured); vLLM's
    AsyncScheduler with ``async_scheduling`` (build ``config`` with it too)."""
    kv_cache_config = kv_cache_config or hybrid_kv_cache_config()
    config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    cls = Scheduler
    if async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as cls

        # vLLM's CPU platform turns async scheduling off when the config is built;
        # the scheduler under test is the GPU engine's: two batches in flight.
        config.scheduler_config.async_scheduling = True
        assert getattr(config, "max_concurrent_batches", 2) == 2
    return cls(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
        block_size=config.cache_config.block_size,
    )


def request(
    prompt_token_ids: Sequence[int],
    kv_transfer_params: dict[str, Any] | None = None,
    block_size: int = BLOCK_SIZE,
    max_tokens: int = 8,
) -> Request:
    """A request whose block hashes are computed as the engine does."""
    global _hash_initialized
    if not _hash_initialized:
        init_none_hash(sha256)
        _hash_initialized = True
    sampling_params = SamplingParams(max_tokens=max_tokens)
    sampling_params.update_from_generation_config({}, EOS_TOKEN_ID)
    req = Request(
        request_id=f"req-{next(_request_ids)}",
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=sampling_params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )
    req.kv_transfer_params = kv_transfer_params
    return req


def connectors(kind: str, kv_role: str = "kv_both") -> dict[str, Any]:
    """``vllm_config`` arguments for a connector set.

    ``nixl``: NixlConnector alone (it declares that it delivers the Mamba
    state). ``nixl+decodebench``: a MultiConnector of NIXL and a connector that
    does not declare it, which is where upstream's capability gate is false;
    ``decodebench+nixl``: the same children in the other order. ``nixlpush``,
    ``nixlpush+decodebench``: the same with NIXL in push mode (NixlPushConnector:
    the decode instance registers its blocks, the prefiller writes them). ``lmcache``,
    ``nixl+lmcache``, ``lmcache+nixl``: LMCacheConnectorV1 alone and beside NIXL.
    ``nixl+lmcachemp``, ``lmcachemp+nixl``: LMCacheMPConnector (lmcache's own
    class where lmcache is importable; build it inside
    ``hash_stores.lmcache_adapter_stub``) beside NIXL. ``nixl+offloading``,
    ``offloading+nixl``: vLLM's OffloadingConnector (CPU tier, scheduler side
    only; drive it with ``hash_stores.hash_store_step``) beside NIXL.
    """
    from .hash_stores import LMCACHE_EXTRA_CONFIG, OFFLOADING_EXTRA_CONFIG

    child_extra = {
        "LMCacheMPConnector": LMCACHE_EXTRA_CONFIG,
        "OffloadingConnector": OFFLOADING_EXTRA_CONFIG,
    }
    single = {
        "nixl": "NixlConnector",
        "nixlpush": "NixlPushConnector",
        "lmcache": "LMCacheConnectorV1",
    }
    if kind in single:
        return {"kv_role": kv_role, "kv_connector": single[kind]}
    children = {
        "nixl+decodebench": ["NixlConnector", "DecodeBenchConnector"],
        "nixlpush+decodebench": ["NixlPushConnector", "DecodeBenchConnector"],
        "decodebench+nixl": ["DecodeBenchConnector", "NixlConnector"],
        "nixl+lmcache": ["NixlConnector", "LMCacheConnectorV1"],
        "lmcache+nixl": ["LMCacheConnectorV1", "NixlConnector"],
        "nixl+lmcachemp": ["NixlConnector", "LMCacheMPConnector"],
        "lmcachemp+nixl": ["LMCacheMPConnector", "NixlConnector"],
        "nixl+offloading": ["NixlConnector", "OffloadingConnector"],
        "offloading+nixl": ["OffloadingConnector", "NixlConnector"],
    }
    if kind in children:
        return {
            "kv_role": kv_role,
            "kv_connector": "MultiConnector",
            "kv_connector_extra_config": {
                "connectors": [
                    {
                        "kv_connector": name,
                        "kv_role": kv_role,
                        **(
                            {"kv_connector_extra_config": dict(child_extra[name])}
                            if name in child_extra
                            else {}
                        ),
                    }
                    for name in children[kind]
                ]
            },
        }
    raise ValueError(kind)


def local_hit_tokens(sched: Scheduler, req: Request) -> int:
    """Admit ``req`` and return the prompt tokens the instance took from its own
    prefix cache, as vLLM counts them: the tokens the KV connector was not
    queried for (``connector_prefix_cache_stats``)."""
    sched.add_request(req)
    sched.schedule()
    stats = sched.connector_prefix_cache_stats
    assert stats is not None
    return req.num_tokens - stats.queries


def cached_hit_tokens(sched: Scheduler, req: Request) -> int:
    """The hit every KV cache group agrees on (KVCacheManager.get_computed_blocks),
    without admitting ``req``."""
    return sched.kv_cache_manager.get_computed_blocks(req)[1]


def remote_prefill_params(num_remote_blocks: int) -> dict[str, Any]:
    """kv_transfer_params a PD proxy hands the decode instance (NIXL format)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-engine",
        "remote_request_id": f"prefill-{next(_request_ids)}",
        "remote_block_ids": list(range(num_remote_blocks)),
        "remote_host": "127.0.0.1",
        "remote_port": 1234,
        "tp_size": 1,
    }


def prefill_side_params() -> dict[str, Any]:
    """kv_transfer_params a PD proxy hands the prefill instance (NIXL format):
    compute the prompt and keep its KV for the decode instance to pull."""
    return {"do_remote_decode": True, "do_remote_prefill": False}


def prompt(num_tokens: int, seed: int = 0) -> list[int]:
    """Deterministic token ids; different seeds give different prompts."""
    return [(seed * 7919 + i * 31) % 1000 + 3 for i in range(num_tokens)]


def model_runner_output(
    reqs: Sequence[Request],
    finished_recving: set[str] | None = None,
    invalid_block_ids: set[int] | None = None,
    token_id: int = 7,
    failed_recving: set[str] | None = None,
    num_accepted: dict[str, int] | None = None,
    sampling: set[str] | None = None,
):
    """What the worker returns for one step: one sampled token per request
    (and ``num_accepted[request id]`` accepted speculative tokens after it; only
    for the requests in ``sampling`` where given: a partial prefill samples none),
    plus the connector's report of finished or failed KV loads
    (``failed_recving``, per-request failures, is not in v0.20.2)."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    kv_connector_output = None
    if finished_recving is not None or invalid_block_ids is not None or failed_recving:
        extra = {"failed_recving": failed_recving} if failed_recving else {}
        kv_connector_output = KVConnectorOutput(
            finished_recving=finished_recving,
            invalid_block_ids=invalid_block_ids or set(),
            **extra,
        )
    req_ids = [r.request_id for r in reqs]
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=[
            [token_id] * (1 + (num_accepted or {}).get(rid, 0))
            if sampling is None or rid in sampling else []
            for rid in req_ids
        ],
        kv_connector_output=kv_connector_output,
    )


def step(
    sched: Scheduler,
    finished_recving: set[str] | None = None,
    invalid_block_ids: set[int] | None = None,
):
    """One engine step: schedule, let the worker produce a token for every
    scheduled request, feed the output back. Returns the scheduler output."""
    output = sched.schedule()
    reqs = [sched.requests[rid] for rid in output.num_scheduled_tokens]
    sched.update_from_output(
        output, model_runner_output(reqs, finished_recving, invalid_block_ids)
    )
    return output


def run_local_prefill(sched: Scheduler, req: Request) -> None:
    """Compute ``req``'s prompt locally, as a prefill instance does (in as many
    chunks as the scheduler cuts); its blocks and the Mamba state at the end of
    the prompt end up in the prefix cache."""
    sched.add_request(req)
    for _ in range(req.num_prompt_tokens):
        step(sched)
        if req.num_computed_tokens >= req.num_prompt_tokens:
            return
    raise AssertionError(f"{req.request_id} did not finish its prefill")


def receive_remote_prefill(sched: Scheduler, req: Request) -> None:
    """Drive a remote-prefill request through a decode instance: the connector
    loads its KV asynchronously, the worker reports the load finished, and the
    scheduler caches the received blocks and schedules the request."""
    sched.add_request(req)
    output = step(sched)
    assert req.request_id not in output.num_scheduled_tokens
    step(sched, finished_recving={req.request_id})
    output = step(sched)
    assert req.request_id in output.num_scheduled_tokens
