"""The ``fleet`` scenario: 1 prefill and N decode instances behind vllm-router, the
decode policy a parameter, on a prefix-repetition workload whose prefixes do not all
fit one decode pool.

The decode-side hit is per instance: a request hits only where the router sends it to
a decode instance that still holds its prefix. Each (build, connector) gets one fleet
(:func:`start_fleet`); each decode policy then gets a router of its own over the same
instances, after every instance's prefix cache was reset (``/reset_prefix_cache``), and
the same workload (``vllm bench serve --dataset-name prefix_repetition``, the same seed,
so the same prompts in the same order). What a policy scores is the decode instances'
``vllm:prefix_cache_hits`` summed over the fleet, against the block-rounded limit
(:func:`hit_limit`): every request but the first of each prefix takes its prefix's
whole blocks from the instance it lands on.

The decode pools are sized (:func:`decode_blocks`, or ``--decode-num-blocks``) to hold
the prefixes of an even share of the fleet and one running request, so a router that
keeps each prefix on one instance need evict nothing, and one that spreads every prefix
over every instance, or piles them onto one, evicts.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from hybridpd.e2e import metrics
from hybridpd.e2e import pair as pair_mod
from hybridpd.e2e import prefix_repetition
from hybridpd.e2e import router as router_mod
from hybridpd.e2e.client import post, settled_scrape
from hybridpd.e2e.envs import Env
from hybridpd.e2e.servers import E2EError, Processes, free_port
from hybridpd.progress import Log

#: The decode policies a fleet run measures unless told otherwise: spread, vllm-router's
#: own prefix tree, and its KV-event policy (load-only on the decode side in PD mode,
#: :data:`router.DECODE_POLICIES`).
DEFAULT_POLICIES = ("round_robin", "cache_aware", "kv_aware")

#: Finished requests (summed over ``finished_reason``): how many requests an instance took.
REQUESTS = "vllm:request_success"


@dataclass(frozen=True)
class FleetOptions:
    decode_instances: int = 2
    policies: tuple[str, ...] = DEFAULT_POLICIES
    bench: prefix_repetition.BenchOptions = prefix_repetition.BenchOptions()
    block_size: int = 128


@dataclass
class Fleet:
    prefill: str
    decodes: list[str]
    ready_s: dict = field(default_factory=dict)
    commands: dict = field(default_factory=dict)


def decode_name(i: int) -> str:
    return f"decode-{i + 1}"


# --------------------------------------------------------------------------- sizes


def prefix_blocks(prefix_len: int, block_size: int) -> int:
    """The prefix's whole blocks: what a decode instance can take from its cache."""
    return prefix_len // block_size


def hit_limit(bench: prefix_repetition.BenchOptions, block_size: int) -> int:
    """Tokens the fleet's decode instances can take from their prefix caches at most:
    each of the ``num_prefixes`` prefixes is new to the fleet once, and every other
    request hits its prefix's whole blocks (vllm bench's dataset sends
    ``num_prompts // num_prefixes`` requests per prefix)."""
    requests = bench.num_prompts // bench.num_prefixes * bench.num_prefixes
    return (requests - bench.num_prefixes) * prefix_blocks(bench.prefix_len, block_size) * block_size


def _request_blocks(bench: prefix_repetition.BenchOptions, block_size: int) -> int:
    return -(-(bench.prefix_len + bench.suffix_len + bench.output_len) // block_size)


def decode_blocks(o: FleetOptions, layer_types) -> int:
    """The default decode pool: the cached prefixes of an even share of the fleet
    (``ceil(num_prefixes / decode_instances)``, each its whole blocks in the attention
    groups), one running request beyond its prefix (its other attention blocks and align
    mode's 2 pages per Mamba group, the most it takes) and the null block, so a router
    that keeps each prefix on one instance evicts nothing.

    A decode instance keeps no Mamba state per prefix: its hit takes the prefix's
    attention blocks, and the state at the prompt's end arrives from the prefill
    instance with the rest of the prompt. Measured (0.32.0, CPU, the tiny model at
    256-token blocks, every request on one instance): 10 blocks held 4 prefixes of one
    block each and 16 blocks held 8, each with a running request, with no miss but each
    prefix's first. An estimate of vLLM's allocation (pair.pool_max_model_len has the
    rules); the run measures what it gives."""
    share = -(-o.bench.num_prefixes // o.decode_instances)
    return 1 + share * _prefix_footprint(o, layer_types) + _running(o, layer_types)


def holds_every_prefix(o: FleetOptions, blocks: int, layer_types) -> bool:
    """Whether one decode pool of ``blocks`` may hold every prefix of the workload and a
    running request taking one page per Mamba group, the fewest it takes (then a router
    that piles every prefix onto one instance may evict nothing: measured, 10 blocks
    held 4 prefixes of the tiny model's)."""
    lean = _running(o, layer_types, mamba_pages=1)
    return blocks >= 1 + o.bench.num_prefixes * _prefix_footprint(o, layer_types) + lean


def _prefix_footprint(o: FleetOptions, layer_types) -> int:
    _, attention = pair_mod.kv_cache_groups(layer_types)
    return prefix_blocks(o.bench.prefix_len, o.block_size) * attention


def _running(o: FleetOptions, layer_types, mamba_pages: int = pair_mod.MAMBA_ALIGN_BLOCKS) -> int:
    """Blocks one running request takes beyond its cached prefix."""
    mamba, attention = pair_mod.kv_cache_groups(layer_types)
    rest = _request_blocks(o.bench, o.block_size) - prefix_blocks(o.bench.prefix_len, o.block_size)
    return rest * attention + mamba_pages * mamba


# --------------------------------------------------------------------------- servers


def start_fleet(
    procs: Processes, env: Env, model: str, connector: str, role: str,
    opts: pair_mod.ServerOptions, decode_instances: int, progress: Log,
) -> Fleet:
    """Start the prefill instance and ``decode_instances`` decode instances (each its
    own port and NIXL side-channel port, the decode pool ``opts.decode_num_blocks``) and
    wait until all answer. The router starts per policy (:func:`start_router`)."""
    names = ["prefill", *(decode_name(i) for i in range(decode_instances))]
    ports = {n: free_port() for n in names}
    commands = {}
    for index, name in enumerate(names):
        side = "P" if name == "prefill" else "D"
        cmd = pair_mod.instance_command(env, model, connector, role, opts, side, ports[name])
        environ = pair_mod.server_env(opts, side, free_port())
        if opts.device == "cpu" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(index, len(names), side)
        procs.start(name, cmd, environ, cwd=procs.log_dir)
        commands[name] = cmd
    urls = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
    ready = procs.wait_ready({n: u + "/v1/models" for n, u in urls.items()},
                             opts.ready_timeout, progress)
    return Fleet(urls["prefill"], [urls[n] for n in names[1:]], ready, commands)


def cpu_binding(index: int, count: int, side: str, cores: list[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` of instance ``index`` of ``count`` (the prefill
    instance first): a share of the cores of its own where there is one for each,
    else the pair's halves (the decode instances then share the second half)."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if len(cores) < count:
        return pair_mod.cpu_binding(side, cores)
    size = len(cores) // count
    mine = cores[index * size:(index + 1) * size if index < count - 1 else len(cores)]
    return ",".join(str(c) for c in mine)


def router_command(env: Env, fleet: Fleet, policy: str, port: int,
                   ready_timeout: float) -> list[str]:
    return router_mod.command(env.python, port, free_port(), fleet.prefill, fleet.decodes,
                              ready_timeout, decode_policy=policy)


def start_router(procs: Processes, env: Env, fleet: Fleet, policy: str,
                 opts: pair_mod.ServerOptions, progress: Log) -> tuple[str, str, list[str]]:
    """Start vllm-router over the fleet with ``policy`` for its decode instances; its
    process name, URL and command line."""
    port = free_port()
    name = f"router-{policy}"
    cmd = router_command(env, fleet, policy, port, opts.ready_timeout)
    procs.start(name, cmd, dict(os.environ), cwd=procs.log_dir)
    url = f"http://127.0.0.1:{port}"
    ready = procs.wait_ready({name: url + router_mod.HEALTH}, opts.ready_timeout, progress)
    fleet.ready_s.update(ready)
    return name, url, cmd


# --------------------------------------------------------------------------- one policy


def reset_caches(fleet: Fleet) -> None:
    """Empty every instance's prefix cache, so that each policy starts cold."""
    for url in (fleet.prefill, *fleet.decodes):
        post(f"{url}/reset_prefix_cache")


def instance_figures(before: metrics.Snapshot, after: metrics.Snapshot) -> dict:
    return {
        "requests": int(after.delta(before, REQUESTS)),
        "prefix_cache_hits": int(after.delta(before, metrics.PREFIX_CACHE_HITS)),
        "prefix_cache_queries": int(after.delta(before, metrics.PREFIX_CACHE_QUERIES)),
        "kv_bytes_transferred": int(after.delta(before, metrics.NIXL_BYTES)),
    }


def policy_result(policy: str, instances: list[dict], limit: int, o: FleetOptions) -> dict:
    """One policy's figures: per decode instance and summed over the fleet."""
    hits = sum(i["prefix_cache_hits"] for i in instances)
    return {
        "policy": policy,
        "decode_instances": len(instances),
        "workload": prefix_repetition.workload(o.bench),
        "requests": [],
        "decode_prefix_cache_hits": hits,
        "decode_prefix_cache_queries": sum(i["prefix_cache_queries"] for i in instances),
        "kv_bytes_transferred": sum(i["kv_bytes_transferred"] for i in instances),
        "outputs_match_baseline": None,
        "hit_limit_tokens": limit,
        "hit_of_limit": round(hits / limit, 3) if limit else None,
        "instances": instances,
    }


def run_policy(
    fleet: Fleet, procs: Processes, env: Env, model: str, policy: str, o: FleetOptions,
    opts: pair_mod.ServerOptions, out_dir: Path, log: Log,
) -> dict:
    """Reset every prefix cache, start a router with ``policy``, run the workload
    through it, stop the router; the policy's figures (:func:`policy_result`)."""
    reset_caches(fleet)
    name, url, cmd = start_router(procs, env, fleet, policy, opts, log)
    t0 = time.monotonic()
    before = [settled_scrape(d, wait=0.5) for d in fleet.decodes]
    summary, bench_cmd = prefix_repetition.run_bench(url, procs, env, model, o.bench, out_dir,
                                                     log, name=f"bench-{policy}")
    after = [settled_scrape(d) for d in fleet.decodes]
    procs.stop(name)
    instances = [{"url": d, **instance_figures(b, a)}
                 for d, b, a in zip(fleet.decodes, before, after)]
    result = policy_result(policy, instances, hit_limit(o.bench, o.block_size), o)
    log(f"   {policy}: fleet hit {result['decode_prefix_cache_hits']} of "
        f"{result['hit_limit_tokens']} tokens ({result['hit_of_limit']}); per instance "
        + ", ".join(f"{i['prefix_cache_hits']} ({i['requests']} requests)" for i in instances))
    return {**result, "bench": summary, "bench_command": bench_cmd, "router_command": cmd,
            "scenario_s": round(time.monotonic() - t0, 1)}


def run_fleet(
    procs: Processes, env: Env, model: str, connector: str, role: str,
    opts: pair_mod.ServerOptions, o: FleetOptions, out_dir: Path, log: Log,
    results: list[dict],
) -> Fleet:
    """Start the fleet, run every policy of ``o`` in turn, appending each policy's
    figures (with the fleet's start-up times and commands) to ``results`` as it ends,
    so a failure keeps those before it. The caller's ``procs`` reaps every process."""
    if not o.policies:
        raise E2EError("no decode policy to run")
    fleet = start_fleet(procs, env, model, connector, role, opts, o.decode_instances, log)
    log(f"   ready: {fleet.ready_s}")
    for policy in o.policies:
        result = run_policy(fleet, procs, env, model, policy, o, opts, out_dir, log)
        results.append({**result, "ready_s": dict(fleet.ready_s),
                        "server_commands": dict(fleet.commands)})
    return fleet


def dry_run_lines(env: Env, model: str, connector: str, role: str,
                  opts: pair_mod.ServerOptions, o: FleetOptions) -> list[str]:
    """The fleet's server lines (fixed example ports: P 8100, decode i 8200 + i) and
    one router line per policy."""
    import shlex

    lines = []
    fleet = Fleet("http://127.0.0.1:8100",
                  [f"http://127.0.0.1:{8200 + i}" for i in range(o.decode_instances)])
    for i, url in enumerate([fleet.prefill, *fleet.decodes]):
        side = "P" if i == 0 else "D"
        cmd = pair_mod.instance_command(env, model, connector, role, opts, side,
                                        int(url.rsplit(":", 1)[1]))
        lines.append(shlex.join(cmd))
    for policy in o.policies:
        lines.append(shlex.join(router_mod.command(env.python, 8000, 29000, fleet.prefill,
                                                   fleet.decodes, opts.ready_timeout,
                                                   decode_policy=policy)))
    return lines
