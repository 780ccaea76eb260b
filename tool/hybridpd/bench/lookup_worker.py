"""Time the decode instance's prefix-cache hit computation in one vLLM tree.

What is timed is what the scheduler calls for a waiting request's local hit:
``Scheduler._get_local_prefix_cache_hit`` where the tree has it (0.28+: it picks
``get_computed_blocks`` or ``get_computed_blocks_for_connector``), else the calls
``schedule()`` makes inline (:func:`_inline_lookup`); the ready line says which.

Runs as a script under a pin's test environment, with the tree on ``PYTHONPATH``:
``python lookup_worker.py SPEC.json``. It builds a real decode instance (the patch
tests' builders), receives one remote-prefill prompt so the prefix cache holds its
blocks, then waits on stdin: each line asks for one sample, answered by one JSON line
on stdout with the mean nanoseconds per call of

- ``decode``: a remote-prefill request that shares the cached prefix (the decode
  path the series changes);
- ``plain``: the same tokens without ``kv_transfer_params`` (every build computes the
  Mamba-aligned hit).

Both requests hash the same blocks in every build (same tokens, same block size).
"""

from __future__ import annotations

import json
import os
import sys
import time


def _inline_lookup(sched):
    """Trees whose scheduler looks the hit up inline in ``schedule()`` (0.20.2): the
    same calls, in the same order. The patched series asks the connector first
    where its load would resume the request (None: no divergent hit)."""
    manager, connector = sched.kv_cache_manager, sched.connector
    resume_point = getattr(connector, "get_divergent_hit_resume_point", None)
    if resume_point is None:
        return manager.get_computed_blocks, "KVCacheManager.get_computed_blocks"

    def lookup(request):
        point = resume_point(request)
        if point is None:
            return manager.get_computed_blocks(request)
        blocks, hit, diverged = manager.get_computed_blocks_for_connector(request)
        if diverged and hit >= point:
            cap = max(point - 1, 0) // sched.block_size * sched.block_size
            blocks, hit, diverged = manager.get_computed_blocks_for_connector(request, cap)
        if diverged:
            # schedule() records a kept divergent hit's stats itself (after the
            # connector's answer; stock's get_computed_blocks records them inside).
            manager.record_prefix_cache_stats(request, hit)
        return blocks, hit

    return lookup, ("connector.get_divergent_hit_resume_point, then "
                    "KVCacheManager.get_computed_blocks[_for_connector]")


def main(argv: list[str]) -> int:
    spec = json.loads(open(argv[0]).read())
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from decode_replay import import_builders

    b = import_builders(spec["builders_dir"])

    bs, n = spec["block_size"], spec["prompt_len"]
    config = b.vllm_config(block_size=bs, max_model_len=n + bs, max_num_batched_tokens=n + bs,
                           **b.connectors(spec["connector"]))
    sched = b.scheduler(config, b.hybrid_kv_cache_config(num_blocks=4 * (n // bs + 8), block_size=bs))
    first = b.prompt(n, seed=1)
    b.receive_remote_prefill(sched, b.request(first, b.remote_prefill_params(n // bs + 1), block_size=bs))
    # Same prefix, a different last block: a hit of the shared whole blocks.
    tokens = first[: n - bs] + b.prompt(bs, seed=2)
    requests = {
        "decode": b.request(tokens, b.remote_prefill_params(n // bs + 1), block_size=bs),
        "plain": b.request(tokens, block_size=bs),
    }
    lookup = getattr(sched, "_get_local_prefix_cache_hit", None)
    timed = "Scheduler._get_local_prefix_cache_hit"
    if lookup is None:
        lookup, timed = _inline_lookup(sched)
    hits = {k: lookup(r)[1] for k, r in requests.items()}
    print(json.dumps({"ready": True, "hits": hits, "timed": timed}), flush=True)
    for _ in sys.stdin:
        sample = {}
        for name, req in requests.items():
            start = time.perf_counter_ns()
            for _ in range(spec["calls"]):
                lookup(req)
            sample[name] = (time.perf_counter_ns() - start) / spec["calls"]
        print(json.dumps({"sample": sample}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
