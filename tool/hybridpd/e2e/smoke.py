"""The ``smoke`` scenario (upstream's test_mamba_prefix_cache.py, plus vllm#42524's key
case), with prompts given as token ids so that their lengths and shared prefixes are
exact:

====  ===================================  =========================================
 r1   prompt A (``prompt_tokens`` long)    cold: everything is pulled from P
 r2   prompt A again                        upstream's case: fewer bytes, same output
 r3   prompt B = A[:shared] + new suffix    vllm#42524's case: D's local prefix hit
 r4   B after D's prefix cache is reset     cold decode instance: r3's output must
                                            equal r4's token for token
 r5   B on P alone, no KV transfer          single instance: r3's first tokens must
                                            equal r5's
====  ===================================  =========================================

Each request's ``decode_local_hit_tokens`` is the change of D's
``vllm:prefix_cache_hits`` over that request, ``kv_bytes_transferred`` the change of
``vllm:nixl_bytes_transferred_sum``; TTFT is measured at the client, through the
front (vllm-router, or the proxy), on a streamed response.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hybridpd.e2e import metrics
from hybridpd.e2e.client import common_prefix, complete, post, settled_scrape, warm_up
from hybridpd.e2e.pair import Pair
from hybridpd.e2e.servers import E2EError, Processes
from hybridpd.progress import Log


@dataclass(frozen=True)
class SmokeOptions:
    prompt_tokens: int = 1400
    shared_tokens: int = 1300
    max_tokens: int = 16
    baseline_tokens: int = 4
    seed: int = 0
    block_size_hint: int = 64  # warm-up prompt length: under one block, so nothing it caches is shared


def make_prompts(vocab_size: int, opts: SmokeOptions) -> tuple[list[int], list[int]]:
    """Prompt A and prompt B (A's first ``shared_tokens`` ids + a new suffix)."""
    if not 0 < opts.shared_tokens < opts.prompt_tokens:
        raise E2EError("--shared-tokens must be between 0 and --prompt-tokens")
    rng = random.Random(opts.seed)
    low = 2  # 0 and 1 are the tiny tokenizer's special tokens
    a = [rng.randrange(low, vocab_size) for _ in range(opts.prompt_tokens)]
    suffix = [rng.randrange(low, vocab_size) for _ in range(opts.prompt_tokens - opts.shared_tokens)]
    if suffix[0] == a[opts.shared_tokens]:
        suffix[0] = low + (suffix[0] - low + 1) % (vocab_size - low)
    return a, a[: opts.shared_tokens] + suffix


def _measured(
    label: str,
    pair: Pair,
    procs: Processes,
    prompt: list[int],
    max_tokens: int,
    before: metrics.Snapshot,
    via: str | None = None,
) -> tuple[dict, metrics.Snapshot]:
    out = complete(via or pair.front, prompt, max_tokens, procs)
    after = settled_scrape(pair.decode)
    row = {
        "label": label,
        "prompt_tokens": len(prompt),
        "decode_local_hit_tokens": int(after.delta(before, metrics.PREFIX_CACHE_HITS)),
        "decode_prefix_cache_queries": int(after.delta(before, metrics.PREFIX_CACHE_QUERIES)),
        "decode_external_hit_tokens": int(after.delta(before, metrics.EXTERNAL_PREFIX_CACHE_HITS)),
        "kv_bytes_transferred": int(after.delta(before, metrics.NIXL_BYTES)),
        "nixl_transfers": int(after.delta(before, metrics.NIXL_TRANSFERS)),
        "ttft_ms": out.ttft_ms,
        "latency_ms": out.latency_ms,
        "output_token_ids": out.token_ids,
        "output_text": out.text,
    }
    return row, after


def run_smoke(pair: Pair, procs: Processes, vocab_size: int, opts: SmokeOptions, log: Log) -> dict:
    a, b = make_prompts(vocab_size, opts)
    n = opts.max_tokens
    warm_up(pair, procs, vocab_size, opts.block_size_hint, log)
    start = before = settled_scrape(pair.decode, wait=0.5)
    requests = []
    for label, prompt in (("r1 A cold", a), ("r2 A again", a), ("r3 B shares prefix", b)):
        row, before = _measured(label, pair, procs, prompt, n, before)
        log(
            f"  {label}: decode local hit {row['decode_local_hit_tokens']} tokens, "
            f"{row['kv_bytes_transferred']} bytes, TTFT {row['ttft_ms']:.0f} ms"
        )
        requests.append(row)
    totals = {
        "decode_prefix_cache_hits": int(before.delta(start, metrics.PREFIX_CACHE_HITS)),
        "decode_prefix_cache_queries": int(before.delta(start, metrics.PREFIX_CACHE_QUERIES)),
    }

    # Cold decode instance: the same request B after D forgets its prefix cache.
    post(f"{pair.decode}/reset_prefix_cache")
    cold, before = _measured("r4 B, cold decode", pair, procs, b, n, settled_scrape(pair.decode, wait=0.5))
    log(f"  r4 B with a cold decode instance: hit {cold['decode_local_hit_tokens']} tokens")
    # Single instance: B on the prefill instance alone, nothing transferred.
    post(f"{pair.prefill}/reset_prefix_cache")
    single = complete(pair.prefill, b, n, procs)

    warm = requests[2]
    cold_equal = warm["output_token_ids"] == cold["output_token_ids"]
    first = common_prefix(warm["output_token_ids"], single.token_ids)
    checks = {
        "upstream_bytes_drop": requests[1]["kv_bytes_transferred"] < requests[0]["kv_bytes_transferred"],
        "upstream_outputs_equal": requests[0]["output_token_ids"] == requests[1]["output_token_ids"],
        "cold_decode_had_no_hit": cold["decode_local_hit_tokens"] == 0,
        "warm_equals_cold_decode": cold_equal,
        "first_tokens_equal_single_instance": first >= min(opts.baseline_tokens, n),
        "decode_local_hit": warm["decode_local_hit_tokens"] > 0,
    }
    return {
        "requests": requests,
        **totals,
        "cold_decode": cold,
        "single_instance": {"output_token_ids": single.token_ids, "ttft_ms": single.ttft_ms},
        "single_instance_common_prefix_tokens": first,
        "outputs_match_baseline": cold_equal and checks["first_tokens_equal_single_instance"],
        "checks": checks,
    }
