"""The deployment a replay models: the model's shape, the decode instance's KV pool and
the cost model, each derived from stated figures so a reader can check every number.

Nothing here runs vLLM. :func:`plan` turns the options of ``hybridpd bench replay``
into the numbers the replay needs (block size, pool blocks, per-step and per-pull
costs) and a derivation: the lines that show where each number comes from.

The default model is shaped like Qwen3.5-35B-A3B: 40 layers, one full-attention layer
in every four (10 attention, 30 Gated-DeltaNet), 256 experts with 8 active. These
figures are our reading of the published model, written into a local config
(:data:`QWEN35_35B_A3B`); pass ``--model-config`` to use another.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hybridpd.errors import UsageError

#: A Qwen3.5-35B-A3B-shaped text config (HF key names).
QWEN35_35B_A3B: dict[str, Any] = {
    "model_type": "qwen3_5_moe_text",
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "vocab_size": 248320,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    # vLLM takes the SSM state's dtype from this key of a Qwen3.5 config
    # (Qwen3_5ForConditionalGenerationConfig); the conv state keeps the model dtype.
    "mamba_ssm_dtype": "float32",
}

#: NVIDIA H20 figures from its public specification sheet (HBM sizes are binary:
#: "96 GB" is 96 GiB).
H20_HBM_GIB = 96.0
H20_HBM_TBPS = 4.0
H20_BF16_TFLOPS = 148.0


@dataclass(frozen=True)
class Workload:
    """vLLM's ``prefix_repetition`` dataset at vllm#42524's settings by default."""

    prefix_len: int = 16384
    suffix_len: int = 1024
    num_prefixes: int = 2
    num_prompts: int = 512
    output_len: int = 1024
    concurrency: int = 256
    seed: int = 0
    #: Prompts that are an earlier prompt's first k blocks + 1 token (the len-1
    #: corner); 0 is vllm#42524's workload.
    exact_repeat_fraction: float = 0.0


@dataclass(frozen=True)
class Hardware:
    """The decode instance's GPU and the engine settings that size its pool."""

    hbm_gib: float = H20_HBM_GIB
    gpu_memory_utilization: float = 0.9
    activation_reserve_gib: float = 4.0
    hbm_tbps: float = H20_HBM_TBPS
    bandwidth_efficiency: float = 0.8
    bf16_tflops: float = H20_BF16_TFLOPS
    mfu: float = 0.35
    step_overhead_ms: float = 8.0
    pull_gbps: float = 50.0


@dataclass
class Plan:
    """What the replay needs, with the derivation behind each number."""

    block_size: int
    num_blocks: int
    num_mamba_groups: int
    cost: dict[str, float]
    model: dict[str, float]
    derivation: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def load_model_config(path: Path | None) -> dict[str, Any]:
    if path is None:
        return dict(QWEN35_35B_A3B)
    try:
        config = json.loads(Path(path).read_text())
    except ValueError as exc:  # not JSON: a bad --model-config (exit 2)
        raise UsageError(str(exc)) from None
    if isinstance(config, dict):
        config = config.get("text_config", config)
    # Valid JSON of another shape: what shape() and plan() read must be there, each
    # of a kind they can compute with (a count of 0 would divide by zero in plan()).
    problem = (f"a JSON object, not {type(config).__name__}" if not isinstance(config, dict)
               else _config_problem(config))
    if problem is not None:
        raise UsageError(_not_a_config(path, problem))
    return config


#: The counts shape() and plan() read: each a positive integer.
_COUNTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
           "head_dim", "linear_num_key_heads", "linear_num_value_heads",
           "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
           "num_experts", "num_experts_per_tok", "moe_intermediate_size", "vocab_size")


def _config_problem(config: dict[str, Any]) -> str | None:
    """What makes ``config`` one that shape() and plan() cannot size, or None."""
    for key in _COUNTS:
        if key not in config:
            return f"no {key}"
    least = {**dict.fromkeys(_COUNTS, 1), "full_attention_interval": 1,
             "shared_expert_intermediate_size": 0}
    for key, low in least.items():
        value = config.get(key, low)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            kind = "a positive" if low else "a non-negative"
            return f"{key} is {json.dumps(value)}, not {kind} integer"
    if config["num_experts_per_tok"] > config["num_experts"]:
        return (f"num_experts_per_tok {config['num_experts_per_tok']} is more than "
                f"num_experts {config['num_experts']}")
    for key in ("torch_dtype", "mamba_ssm_dtype"):
        if config.get(key) is not None and config[key] not in _DTYPE_BYTES:
            return f"{key} is {json.dumps(config[key])}, not one of {', '.join(_DTYPE_BYTES)}"
    types = config.get("layer_types")
    if types is not None and (not isinstance(types, list)
                              or len(types) != config["num_hidden_layers"]
                              or not all(isinstance(t, str) for t in types)):
        return (f"layer_types is not a list of {config['num_hidden_layers']} layer type "
                "names (num_hidden_layers)")
    if _layers(config)[0] < 1:
        return "no full-attention layer"
    return None


def _not_a_config(path: Path, why: str) -> str:
    return f"--model-config {path}: not a Qwen3.5-style hybrid model config ({why})"


def _layers(config: dict[str, Any]) -> tuple[int, int]:
    """(full-attention layers, linear-attention layers)."""
    types = config.get("layer_types")
    n = config["num_hidden_layers"]
    if types:
        full = sum(t == "full_attention" for t in types)
        return full, n - full
    full = n // config.get("full_attention_interval", 4)
    return full, n - full


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def shape(config: dict[str, Any]) -> dict[str, float]:
    """Byte and parameter counts of a Qwen3.5-style hybrid MoE config."""
    dtype = _DTYPE_BYTES[config.get("torch_dtype", "bfloat16")]
    ssm_dtype = _DTYPE_BYTES[config.get("mamba_ssm_dtype") or config.get("torch_dtype", "bfloat16")]
    h = config["hidden_size"]
    full, linear = _layers(config)
    kv_heads, head_dim = config["num_key_value_heads"], config["head_dim"]
    kh, vh = config["linear_num_key_heads"], config["linear_num_value_heads"]
    kd, vd = config["linear_key_head_dim"], config["linear_value_head_dim"]
    conv_dim = 2 * kh * kd + vh * vd
    experts, active = config["num_experts"], config["num_experts_per_tok"]
    inter = config["moe_intermediate_size"]
    shared = config.get("shared_expert_intermediate_size", 0)
    q_heads = config["num_attention_heads"]
    attn_params = h * q_heads * head_dim * 2 + 2 * h * kv_heads * head_dim + q_heads * head_dim * h
    gdn_params = h * (2 * kh * kd + 2 * vh * vd) + h * 2 * vh + vh * vd * h + conv_dim * config["linear_conv_kernel_dim"]
    expert_params = 3 * h * inter
    layers = full + linear
    embeddings = config["vocab_size"] * h * (1 if config.get("tie_word_embeddings") else 2)
    dense = full * attn_params + linear * gdn_params + layers * (3 * h * shared + h * experts) + embeddings
    total = dense + layers * experts * expert_params
    return {
        "full_attention_layers": full,
        "linear_attention_layers": linear,
        "params": total,
        "active_params": dense + layers * active * expert_params,
        # A prefill token multiplies through every active weight but the embeddings
        # (a lookup; the LM head runs for the last token only).
        "prefill_params": dense - embeddings + layers * active * expert_params,
        "attn_bytes_per_token_layer": 2 * kv_heads * head_dim * dtype,
        "mamba_state_bytes_layer": (config["linear_conv_kernel_dim"] - 1) * conv_dim * dtype
        + vh * kd * vd * ssm_dtype,
        "dtype_bytes": dtype,
        "ssm_dtype_bytes": ssm_dtype,
    }


def plan(
    workload: Workload,
    hardware: Hardware,
    config: dict[str, Any],
    block_size: int = 128,
    kv_blocks: int | None = None,
    kv_gib: float | None = None,
) -> Plan:
    """The pool, block size and cost model of the decode instance, derived."""
    m = shape(config)
    lines = []
    full, linear = int(m["full_attention_layers"]), int(m["linear_attention_layers"])
    weights = m["params"] * m["dtype_bytes"]
    lines.append(
        f"model: {full} full-attention + {linear} linear-attention layers, "
        f"{m['params'] / 1e9:.2f} B parameters ({m['active_params'] / 1e9:.2f} B active), "
        f"weights {weights / 1e9:.1f} GB ({m['dtype_bytes']:.0f} B/param), SSM state "
        f"{m['ssm_dtype_bytes']:.0f} B/element"
    )
    # vLLM raises the attention block size of a hybrid model until one attention
    # page holds a Mamba state page (0.33: Platform._align_hybrid_block_size), in
    # multiples of the requested size when that is a multiple of the kernel's and
    # the Mamba checkpoint alignment (128 and 64 here).
    attn_tok = m["attn_bytes_per_token_layer"]
    state = m["mamba_state_bytes_layer"]
    effective = block_size * math.ceil(state / (block_size * attn_tok))
    effective = max(effective, block_size)
    page = max(effective * attn_tok, state)
    lines.append(
        f"block: --block-size {block_size}; a Mamba state page is {state:,.0f} B and an "
        f"attention page {attn_tok:,.0f} B/token, so vLLM raises the block to "
        f"{effective} tokens (page {page:,.0f} B)"
    )
    # Layers share the pool in groups of equal size: one group of the full-attention
    # layers and ceil(linear / full) groups of linear-attention layers (Qwen3.5: 1
    # and 3 groups of 10). A block id is one page in each of a group's layer slots.
    per_block = page * full
    mamba_groups = -(-linear // full)
    if kv_blocks is not None:
        num_blocks = kv_blocks
        lines.append(f"pool: --kv-blocks {kv_blocks}")
    else:
        if kv_gib is not None:
            pool = kv_gib * 2**30
            lines.append(f"pool: --kv-gib {kv_gib} = {pool / 1e9:.2f} GB")
        else:
            usable = hardware.hbm_gib * 2**30 * hardware.gpu_memory_utilization
            pool = usable - weights - hardware.activation_reserve_gib * 2**30
            lines.append(
                f"pool: {hardware.hbm_gib:g} GiB x gpu_memory_utilization "
                f"{hardware.gpu_memory_utilization:g} - weights {weights / 1e9:.1f} GB - "
                f"activations {hardware.activation_reserve_gib:g} GiB = {pool / 1e9:.2f} GB"
            )
        num_blocks = int(pool // per_block)
        lines.append(
            f"blocks: {pool / 1e9:.2f} GB / ({full} layer slots x {page:,.0f} B) = "
            f"{num_blocks} blocks of {effective} tokens, shared by 1 attention and "
            f"{mamba_groups} Mamba groups"
        )
    if num_blocks < 1:
        raise UsageError("the KV pool holds no block: give --kv-blocks or --kv-gib")
    hbm = hardware.hbm_tbps * 1e12 * hardware.bandwidth_efficiency  # bytes/s
    flops = hardware.bf16_tflops * 1e12 * hardware.mfu
    kv_token = attn_tok * full
    state_request = state * linear
    cost = {
        "step_overhead_ms": hardware.step_overhead_ms,
        "weights_read_ms": weights / hbm * 1e3,
        "kv_read_ms_per_token": kv_token / hbm * 1e3,
        "state_read_ms_per_request": state_request / hbm * 1e3,
        "prefill_ms_per_token": 2 * m["prefill_params"] / flops * 1e3,
        "pull_ms_per_token": kv_token / (hardware.pull_gbps * 1e9) * 1e3,
        "pull_ms_per_request": state_request / (hardware.pull_gbps * 1e9) * 1e3,
    }
    lines += [
        f"decode step: {hardware.step_overhead_ms:g} ms launch overhead + weights "
        f"{weights / 1e9:.1f} GB / ({hardware.hbm_tbps:g} TB/s x "
        f"{hardware.bandwidth_efficiency:g}) = {cost['weights_read_ms']:.2f} ms + "
        f"{kv_token:,.0f} B per context token + {state_request / 1e6:.1f} MB Mamba "
        "state per request, read at the same rate (every expert every step: a batch of "
        "32 or more touches nearly all of them)",
        f"prefill: 2 x {m['prefill_params'] / 1e9:.2f} B active params without the "
        f"embeddings / ({hardware.bf16_tflops:g} TFLOPS x MFU {hardware.mfu:g}) = "
        f"{cost['prefill_ms_per_token']:.4f} ms per token (attention's quadratic term "
        "left out)",
        f"pull: {kv_token:,.0f} B per token + {state_request / 1e6:.1f} MB per request "
        f"at {hardware.pull_gbps:g} GB/s",
    ]
    return Plan(effective, num_blocks, mamba_groups, cost, m, lines)
