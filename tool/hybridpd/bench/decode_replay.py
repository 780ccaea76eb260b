"""Replay a prefix-repetition workload through one vLLM tree's decode instance.

Runs as a script under a pin's test environment, with the tree (stock or patched) on
``PYTHONPATH``: ``python decode_replay.py SPEC.json``. Standard library, the pin's
vLLM and ``tests/patches/builders.py`` only (the spec names its directory). Progress
goes to stderr as JSON lines; the result is one JSON object, written to the spec's
``out`` (stdout without one).

What is real: vLLM's ``Scheduler``, its KV cache manager, its hybrid coordinator and
the KV connector's scheduler side (NIXL, or a MultiConnector), built by the same
builders the patch tests use. What stands in: the client (a closed loop at the
workload's concurrency), the prefill instance (a FIFO server that computes each
prompt at a modelled per-token cost, with its own prefix cache), the worker (it
reports a KV load finished once the modelled pull time has passed, and samples one
token for every request that has computed all its tokens) and the clock (each step
takes the modelled time of the batch it ran). Hits, pulls, blocks, running and
waiting requests, preemptions and steps are counted from vLLM's own objects, so they
are exact for the modelled arrival times; TTFT and throughput follow the cost model.
"""

from __future__ import annotations

import heapq
import json
import os
import random
import sys
import time
from typing import Any

#: The token every stand-in sample returns (never the builders' EOS).
SAMPLED_TOKEN = 7
#: Points kept in the running/waiting trace (the plot's resolution).
TRACE_POINTS = 2000


def import_builders(builders_dir: str, module: str = "builders"):
    """``builders.py`` (or a sibling ``module``) as a module of its package
    (``tests/patches``): it imports its sibling ``hash_stores`` relatively."""
    import importlib

    builders_dir = os.path.abspath(builders_dir)
    sys.path.insert(0, os.path.dirname(builders_dir))
    return importlib.import_module(os.path.basename(builders_dir) + "." + module)


def _progress(build: str, done: int, total: int, steps: int) -> None:
    print(json.dumps({"build": build, "finished": done, "total": total, "steps": steps}),
          file=sys.stderr, flush=True)


class Prompts:
    """The prefix-repetition prompts (vLLM's ``prefix_repetition`` dataset shape):
    ``num_prefixes`` shared prefixes, a distinct suffix per prompt, shuffled order.
    Prompts are made when sent, so only the ones in flight are held.

    With ``exact_repeat_fraction`` F > 0, about F of the prompts (never the first)
    are exact repeats: an earlier prompt's first k * ``block_size`` tokens (k >= 1,
    drawn uniformly up to the earlier prompt's last full block before its last
    token) plus one fresh token, so D may hold the whole prompt but its last token
    (the len-1 corner). Their source is at least ``concurrency`` prompts earlier
    where there is one (likely finished, so its blocks are cached on D). F = 0
    leaves the seed's workload unchanged (its random streams are not touched).
    """

    def __init__(self, w: dict[str, Any], block_size: int = 1) -> None:
        self.w = w
        rng = random.Random(w["seed"])
        self.prefixes = [
            [rng.randrange(3, 1000) for _ in range(w["prefix_len"])]
            for _ in range(w["num_prefixes"])
        ]
        self.order = [i % w["num_prefixes"] for i in range(w["num_prompts"])]
        rng.shuffle(self.order)
        self.seed = w["seed"]
        #: prompt index -> (source prompt index, repeated tokens k * block_size)
        self.repeats: dict[int, tuple[int, int]] = {}
        fraction = w.get("exact_repeat_fraction", 0.0)
        if fraction > 0:
            repeat_rng = random.Random(f"{self.seed}:exact-repeats")
            prompt_len = w["prefix_len"] + w["suffix_len"]
            max_blocks = (prompt_len - 1) // block_size
            if max_blocks < 1:
                raise ValueError(
                    f"--exact-repeat-fraction needs prompts longer than a block "
                    f"({block_size} tokens); they have {prompt_len}"
                )
            for index in range(1, w["num_prompts"]):
                if repeat_rng.random() >= fraction:
                    continue
                earliest = index - w["concurrency"]
                source = repeat_rng.randrange(0, earliest + 1 if earliest >= 0 else index)
                # A source that is itself a repeat is shorter: take its own source.
                while source in self.repeats:
                    source = self.repeats[source][0]
                k = repeat_rng.randint(1, max_blocks)
                self.repeats[index] = (source, k * block_size)
                self.order[index] = self.order[source]

    def prompt(self, index: int) -> list[int]:
        rng = random.Random(f"{self.seed}:{index}")
        if index in self.repeats:
            source, repeated = self.repeats[index]
            return self.prompt(source)[:repeated] + [rng.randrange(3, 1000)]
        suffix = [rng.randrange(3, 1000) for _ in range(self.w["suffix_len"])]
        return self.prefixes[self.order[index]] + suffix

    def new_tokens(self, index: int) -> int:
        """Tokens past the shared prefix (what P computes once it holds the prefix)."""
        if index in self.repeats:
            return max(1, self.repeats[index][1] + 1 - self.w["prefix_len"])
        return self.w["suffix_len"]


class PrefillInstance:
    """The prefill side: a FIFO server at ``prefill_ms_per_token``, with its own
    prefix cache (the first prompt of a prefix computes it all, later ones only
    their suffix). Returns when each prompt's KV is ready to pull."""

    def __init__(self, cost: dict[str, float], w: dict[str, Any]) -> None:
        self.cost, self.w = cost, w
        self.free_at = 0.0
        self.cached: set[int] = set()

    def submit(self, prefix: int, now: float, new_tokens: int | None = None) -> float:
        tokens = self.w["suffix_len"] if new_tokens is None else new_tokens
        if prefix not in self.cached:
            tokens += self.w["prefix_len"]
            self.cached.add(prefix)
        self.free_at = max(self.free_at, now) + tokens * self.cost["prefill_ms_per_token"]
        return self.free_at


def step_ms(cost: dict[str, float], sched_output, requests) -> float:
    """Modelled time of one decode step: a fixed launch overhead, one read of the
    weights, each scheduled request's attention context and Mamba state, and the
    tokens computed beyond one per request (local prefill and recompute)."""
    scheduled = sched_output.num_scheduled_tokens
    if not scheduled:
        return 0.0
    context = sum(requests[rid].num_computed_tokens for rid in scheduled)
    extra = sum(n - 1 for n in scheduled.values())
    # Speculative decoding (MTP): its drafting passes each step, and the draft
    # tokens every scheduled request has verified (0 without it).
    extra += len(scheduled) * cost.get("verify_tokens_per_request", 0)
    return (
        cost["step_overhead_ms"]
        + cost["weights_read_ms"]
        + cost.get("draft_ms_per_step", 0.0)
        + context * cost["kv_read_ms_per_token"]
        + len(scheduled) * cost["state_read_ms_per_request"]
        + extra * cost["prefill_ms_per_token"]
    )


def worker_output(sched_output, requests, finished_recving: set[str]):
    """What the stand-in worker returns: a token for every request that has now
    computed all its tokens (none for a chunk of a prefill), and the loads done."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    req_ids = list(sched_output.num_scheduled_tokens)
    sampled = [
        [SAMPLED_TOKEN]
        if requests[rid].num_computed_tokens >= requests[rid].num_tokens else []
        for rid in req_ids
    ]
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=(
            KVConnectorOutput(finished_recving=finished_recving)
            if finished_recving else None
        ),
    )


def nixl_scheduler(connector):
    """NIXL's scheduler side in ``connector`` (itself or a MultiConnector's child)."""
    for child in [connector, *getattr(connector, "_connectors", ())]:
        # NixlConnector, or its pull/push classes (0.33: NixlPullConnector).
        if type(child).__name__.startswith("Nixl") and getattr(
                child, "connector_scheduler", None) is not None:
            return child.connector_scheduler
    return None


def load_target(nixl, num_prompt_tokens: int) -> int:
    """Where NIXL's load of a remote prefill ends: the prompt less NIXL's back-off
    (read as NIXL reads it where the pin has ``_prefill_backoff``, else 1)."""
    backoff = nixl._prefill_backoff() if hasattr(nixl, "_prefill_backoff") else 1
    if backoff and num_prompt_tokens > backoff:
        return num_prompt_tokens - backoff
    return num_prompt_tokens


def attention_hit(sched, request, hash_block_size: int) -> int:
    """The local prefix hit of the full-attention groups alone, before any
    reconciliation with the Mamba groups: leading full blocks of the prompt (never
    its last token, as vLLM's lookup) cached for every non-Mamba group."""
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = [
        i for i, g in enumerate(sched.kv_cache_config.kv_cache_groups)
        if not isinstance(g.kv_cache_spec, MambaSpec)
    ]
    if not groups:
        return 0
    bs = sched.kv_cache_config.kv_cache_groups[groups[0]].kv_cache_spec.block_size
    hashes = request.block_hashes
    # The request's hashes are kept per ``hash_block_size`` tokens (the builders'
    # block size); a group's block spans ``per_block`` of them.
    per_block = max(1, bs // hash_block_size)
    pool = sched.kv_cache_manager.block_pool
    blocks = (request.num_tokens - 1) // bs
    hit = 0
    for i in range(blocks):
        index = (i + 1) * per_block - 1
        if index >= len(hashes) or pool.get_cached_block(hashes[index], groups) is None:
            break
        hit += bs
    return hit


def use_mtp_modules(b, modules: int) -> None:
    """Build MTP configs on a checkpoint of ``modules`` MTP modules: the builders'
    ``vllm_config(spec_method="mtp")`` gives the target one module per speculative
    token (multi-module MTP); a Qwen3.5 checkpoint has one, reused for every token."""
    make = b.tiny_mtp_model_dir
    b.tiny_mtp_model_dir = lambda _num_speculative_tokens: make(modules)


def speculative_settings(sched, nixl) -> dict[str, Any]:
    """What vLLM's scheduler does with the speculative config, read from its objects:
    lookahead slots per running request, prefill lookahead, NIXL's back-off, and
    whether the KV cache manager drops the last matched block (``drop_eagle_block``)."""
    config = sched.vllm_config
    coordinator = sched.kv_cache_manager.coordinator
    return {
        "lookahead_slots": getattr(sched, "num_lookahead_tokens", None),
        "prefill_lookahead_tokens": getattr(config, "num_prefill_lookahead_tokens", None),
        "nixl_prefill_backoff": (
            nixl._prefill_backoff() if nixl is not None and hasattr(nixl, "_prefill_backoff")
            else None
        ),
        "drops_last_matched_block": explain_driver().drops_last_matched_block(coordinator),
    }


def explain_driver():
    """``hybridpd explain``'s driver (beside this script's package; it imports only the
    standard library at load): one reading of the releases' speculative settings."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "explain", "driver.py")
    spec = importlib.util.spec_from_file_location("hybridpd_explain_driver", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serving_child(connector, request_id: str) -> str:
    """The class of the connector that loads ``request_id``'s external tokens: the
    connector, or the MultiConnector child that matched them."""
    children = getattr(connector, "_connectors", None)
    if children is None:
        return type(connector).__name__
    chosen = connector._requests_to_connector.get(request_id)
    return "unknown" if chosen is None else type(children[chosen]).__name__


class Counters:
    """Wraps the connector's ``get_num_new_matched_tokens`` and
    ``update_state_after_alloc`` and the block pool's ``get_new_blocks`` on this
    scheduler instance (all still run unchanged).

    ``get_num_new_matched_tokens`` follows the local lookup: the full-attention hit
    is read there, before the request's own blocks are allocated (the last lookup
    before its admission counts). ``update_state_after_alloc`` is where the
    scheduler commits a request's external tokens, after any reconciliation of its
    hit: the first call per request is its first admission's (``external``, with
    the attention hit of that lookup in ``attention``); a call with tokens is a
    load the connector now plans (``planned``, taken by the caller each step).
    """

    def __init__(self, sched, hash_block_size: int) -> None:
        self.external: dict[str, int] = {}
        self.attention: dict[str, int] = {}
        self.planned: dict[str, int] = {}
        #: connector class -> external tokens it was chosen to load (every load,
        #: re-admissions included)
        connector = sched.connector
        self.served_by: dict[str, int] = {
            type(c).__name__: 0 for c in getattr(connector, "_connectors", [connector])
        }
        self.blocks_allocated = 0
        update_state_after_alloc = connector.update_state_after_alloc
        get_num_new_matched_tokens = connector.get_num_new_matched_tokens
        looked_up: dict[str, int] = {}

        def matched(request, num_computed_tokens):
            if request.request_id not in self.external:
                looked_up[request.request_id] = attention_hit(sched, request, hash_block_size)
            return get_num_new_matched_tokens(request, num_computed_tokens)

        connector.get_num_new_matched_tokens = matched

        def after_alloc(request, blocks, num_external_tokens):
            if request.request_id not in self.external:
                self.attention[request.request_id] = looked_up.pop(request.request_id, 0)
            self.external.setdefault(request.request_id, num_external_tokens)
            if num_external_tokens:
                self.planned[request.request_id] = num_external_tokens
                child = serving_child(connector, request.request_id)
                self.served_by[child] = self.served_by.get(child, 0) + num_external_tokens
            return update_state_after_alloc(request, blocks, num_external_tokens)

        connector.update_state_after_alloc = after_alloc
        pool = sched.kv_cache_manager.block_pool
        get_new_blocks = pool.get_new_blocks

        def new_blocks(num_blocks):
            self.blocks_allocated += num_blocks
            return get_new_blocks(num_blocks)

        pool.get_new_blocks = new_blocks


def replay(spec: dict[str, Any]) -> dict[str, Any]:
    b = import_builders(spec["builders_dir"])
    from vllm.v1.request import RequestStatus

    w, cost, build = spec["workload"], spec["cost"], spec["build"]
    bs = spec["block_size"]
    speculative = spec.get("speculative")
    num_spec = speculative["num_speculative_tokens"] if speculative else 0
    if speculative:
        use_mtp_modules(b, speculative["mtp_modules"])

    def new_config(connector_args):
        return b.vllm_config(
            block_size=bs,
            max_num_seqs=spec["max_num_seqs"],
            max_num_batched_tokens=spec["max_num_batched_tokens"],
            max_model_len=spec["max_model_len"],
            num_speculative_tokens=num_spec,
            spec_method="mtp",
            **connector_args,
        )

    # vLLM gives each Mamba group num_speculative_tokens blocks beyond the running
    # state under speculative decoding.
    kv_cache_config = b.hybrid_kv_cache_config(
        num_blocks=spec["num_blocks"], block_size=bs,
        num_mamba_groups=spec["num_mamba_groups"], num_speculative_blocks=num_spec,
    )
    stores = None
    if any(s in spec["connector"] for s in ("lmcache", "offloading")):
        import replay_stores

        stores = replay_stores.Stores(
            b, import_builders(spec["builders_dir"], "hash_stores"), spec["connector"],
            bs, spec["store_blocks"],
        )
        sched = stores.scheduler(new_config, kv_cache_config)
    else:
        sched = b.scheduler(new_config(b.connectors(spec["connector"])), kv_cache_config)
    counters = Counters(sched, bs)
    nixl = nixl_scheduler(sched.connector)
    prompts = Prompts(w, bs)
    prefill = PrefillInstance(cost, w)

    total = w["num_prompts"]
    next_prompt = 0
    in_flight = 0
    arrivals: list[tuple[float, int]] = []  # (time the KV is ready on P, prompt)
    sent_at_prompt: dict[int, float] = {}
    sent_at: dict[str, float] = {}
    prefix_of: dict[str, int] = {}
    # Tokens a request did not compute itself at its first admission (local hit +
    # external tokens).
    admitted: dict[str, int] = {}
    loads: dict[str, float] = {}  # request -> time its pull completes
    first_token: dict[str, float] = {}
    finished: dict[str, float] = {}
    requests: dict[str, Any] = {}
    first_of_prefix: set[str] = set()
    targets: dict[str, int] = {}  # request -> NIXL's load target
    limits: dict[str, int] = {}  # exact repeats -> their block-rounded limit
    seen_prefixes: set[int] = set()
    preemptions = 0
    clock = 0.0
    steps = 0
    running_sum = waiting_sum = 0
    peak_running = peak_waiting = 0
    peak_usage = 0.0
    trace: list[tuple[int, float, int, int]] = []
    started = time.monotonic()
    last_progress = started

    while len(finished) < total:
        # The client keeps `concurrency` requests in flight; P computes each prompt.
        while in_flight < w["concurrency"] and next_prompt < total:
            prefix = prompts.order[next_prompt]
            ready = prefill.submit(prefix, clock, prompts.new_tokens(next_prompt))
            heapq.heappush(arrivals, (ready, next_prompt))
            sent_at_prompt[next_prompt] = clock
            next_prompt += 1
            in_flight += 1
        # Requests whose KV is ready on P reach the decode instance.
        while arrivals and arrivals[0][0] <= clock:
            _, index = heapq.heappop(arrivals)
            tokens = prompts.prompt(index)
            req = b.request(
                tokens,
                b.remote_prefill_params(-(-len(tokens) // bs)),
                block_size=bs,
                max_tokens=w["output_len"],
            )
            rid = req.request_id
            targets[rid] = load_target(nixl, len(tokens))
            if index in prompts.repeats:
                # Its whole blocks but never its last token (a hit capped below
                # NIXL's load target to pull the state stays a block short).
                limits[rid] = (len(tokens) - 1) // bs * bs
            sent_at[rid] = sent_at_prompt.pop(index)
            prefix = prompts.order[index]
            prefix_of[rid] = prefix
            if prefix not in seen_prefixes:
                seen_prefixes.add(prefix)
                first_of_prefix.add(rid)
            requests[rid] = req
            sched.add_request(req)

        output = sched.schedule()
        for rid, req in requests.items():
            if rid in admitted or req.status == RequestStatus.WAITING:
                continue
            # Admitted this step: scheduled tokens are already in num_computed_tokens.
            admitted[rid] = req.num_computed_tokens - output.num_scheduled_tokens.get(rid, 0)
        for rid, external in counters.planned.items():
            if requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                loads[rid] = (
                    clock + cost["pull_ms_per_request"]
                    + external * cost["pull_ms_per_token"]
                )
        counters.planned.clear()
        end = clock + step_ms(cost, output, requests)
        done = {rid for rid, t in loads.items() if t <= end}
        for rid in done:
            del loads[rid]
        result = worker_output(output, requests, done)
        if stores is not None:
            stores.report(output, result)
        engine_outputs = sched.update_from_output(output, result)
        for outs in engine_outputs.values():
            for out in outs.outputs:
                if out.new_token_ids and out.request_id not in first_token:
                    first_token[out.request_id] = end
                if out.finish_reason is not None:
                    finished[out.request_id] = end
                    req = requests.pop(out.request_id)
                    preemptions += req.num_preemptions
                    in_flight -= 1

        if output.num_scheduled_tokens:
            steps += 1
            # vLLM's own counts (waiting includes requests whose KV is loading).
            running, waiting = sched.get_request_counts()
            running_sum += running
            waiting_sum += waiting
            peak_running = max(peak_running, running)
            peak_waiting = max(peak_waiting, waiting)
            peak_usage = max(peak_usage, sched.kv_cache_manager.usage)
            trace.append((steps, round(end, 3), running, waiting))
            clock = end
        elif not done:
            # Nothing ran and no load finished: move the clock to the next event.
            # Every pending load ends after `clock` (those that ended by `end` were
            # reported above) and arrivals up to `clock` were added, so nothing is
            # skipped; with neither left, no step can change anything.
            upcoming = [t for t in loads.values()]
            if arrivals:
                upcoming.append(arrivals[0][0])
            if not upcoming:
                raise RuntimeError(
                    f"{build}: stalled with {len(requests)} request(s) on the decode "
                    "instance and nothing to wait for (the KV pool cannot hold one "
                    "request?)"
                )
            clock = max(clock, min(upcoming))
        now = time.monotonic()
        if now - last_progress >= 2:
            _progress(build, len(finished), total, steps)
            last_progress = now
    _progress(build, len(finished), total, steps)

    # The block-rounded limit: every request but the first of its prefix can reuse
    # the whole prefix, rounded down to a block, and never its prompt's last token.
    prompt_len = w["prefix_len"] + w["suffix_len"]
    # An exact repeat's limit is its own whole blocks below its last token.
    reusable = min(w["prefix_len"], prompt_len - 1) // bs * bs
    limit = reusable * (total - len(first_of_prefix) - len(limits)) + sum(limits.values())
    pulled = sum(counters.external.get(rid, 0) for rid in admitted)
    hit = sum(admitted.values()) - pulled
    # Tokens D computes below NIXL's load target (P computed them already), and
    # the len-1 corner: an attention hit that reaches the target, so NIXL has
    # nothing left to load unless the scheduler caps the hit.
    below = {rid: max(0, targets[rid] - admitted[rid]) for rid in admitted}
    corner = [rid for rid in admitted if counters.attention.get(rid, 0) >= targets[rid]]
    ttfts = sorted(first_token[r] - sent_at[r] for r in first_token)
    makespan_ms = max(finished.values())
    stride = max(1, len(trace) // TRACE_POINTS)
    return {
        "build": build,
        "hit_tokens": hit,
        "limit_tokens": limit,
        "pulled_tokens": pulled,
        "recomputed_below_target_tokens": sum(below.values()),
        "corner_admissions": len(corner),
        "corner_recomputed_tokens": sum(below[rid] for rid in corner),
        "served_by": dict(sorted(counters.served_by.items())),
        "limited_requests": total - len(first_of_prefix),
        "speculative": (
            {**speculative, **speculative_settings(sched, nixl)} if speculative else None
        ),
        "store_blocks": spec["store_blocks"] if stores is not None else None,
        "store_evicted_chunks": stores.evicted() if stores is not None else None,
        "blocks_allocated": counters.blocks_allocated,
        "peak_block_usage": round(peak_usage, 4),
        "peak_running": peak_running,
        "mean_running": round(running_sum / max(steps, 1), 2),
        "peak_waiting": peak_waiting,
        "mean_waiting": round(waiting_sum / max(steps, 1), 2),
        "preemptions": preemptions,
        "steps": steps,
        "ttft_ms_est": round(sum(ttfts) / len(ttfts), 1),
        "ttft_p50_ms_est": round(ttfts[len(ttfts) // 2], 1),
        "makespan_s_est": round(makespan_ms / 1000, 2),
        "output_tps_est": round(total * w["output_len"] / (makespan_ms / 1000), 1),
        "wall_s": round(time.monotonic() - started, 1),
        "trace": trace[::stride],
    }


def main(argv: list[str]) -> int:
    spec = json.loads(open(argv[0]).read())
    result = json.dumps(replay(spec))
    if spec.get("out"):
        with open(spec["out"] + ".tmp", "w") as fh:
            fh.write(result)
        os.replace(spec["out"] + ".tmp", spec["out"])
    else:
        print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
