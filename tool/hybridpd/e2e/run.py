"""One ``hybridpd e2e`` invocation without the command line: options in, report out.

:class:`E2EOptions` holds every option (the CLI builds it from its flags, a script can
build it directly); :func:`run` checks them, prepares the environments (:mod:`.envs`),
serves each (build, connector) pair in turn (:mod:`.pair`, one pair of servers at a
time) and runs the scenario on it (:mod:`.smoke`, :mod:`.correctness`,
:mod:`.prefix_repetition`), writes the report (:mod:`.report`) and returns it with the
checks that failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path

from hybridpd import cache, proc, progress
from hybridpd import speculative as spec_mod
from hybridpd.e2e import correctness, metrics, prefix_repetition, smoke
from hybridpd.e2e import fleet as fleet_mod
from hybridpd.e2e import lmcache as lm
from hybridpd.e2e import netns
from hybridpd.e2e import pair as pair_mod
from hybridpd.e2e import reap as reap_mod
from hybridpd.e2e import router as router_mod
from hybridpd.e2e import report as report_mod
from hybridpd.e2e.envs import Env, given, preflight, prepare, probe
from hybridpd.e2e.servers import E2EError, Processes
from hybridpd.e2e.tinymodel import SPEC, spec_id
from hybridpd.errors import Interrupted, UsageError
from hybridpd.progress import Log
from hybridpd.series.model import Pin, Series, release_key


class E2EUsageError(UsageError):
    """Options of ``hybridpd e2e`` that do not go together."""


SCENARIOS = ("smoke", "prefix-repetition", "correctness", "fleet")

_SERVER, _SMOKE, _BENCH = (
    pair_mod.ServerOptions(), smoke.SmokeOptions(), prefix_repetition.BenchOptions()
)


@dataclasses.dataclass(frozen=True)
class E2EOptions:
    """Every option of ``hybridpd e2e`` (the CLI's names and defaults)."""

    pin: Pin | None
    device: str = "cpu"
    model: str | None = None
    tiny: bool = False
    tiny_arch: str = "auto"
    connectors: tuple[str, ...] = ()
    role: str = "kv_both"
    scenario: str = "smoke"
    compare: str | None = None
    out_dir: Path | None = None
    patched_venv: Path | None = None
    stock_venv: Path | None = None
    stock_only: bool = False
    torch_spec: str | None = None
    # The scenarios' own defaults, so the two never drift apart.
    block_size: int = _SERVER.block_size
    # None: 4096, or with a shrunken decode pool what it holds (_max_model_len).
    max_model_len: int | None = None
    decode_prefix_caching: bool = _SERVER.decode_prefix_caching
    prompt_tokens: int = _SMOKE.prompt_tokens
    shared_tokens: int = _SMOKE.shared_tokens
    max_tokens: int = _SMOKE.max_tokens
    baseline_tokens: int = _SMOKE.baseline_tokens
    prefix_len: int = _BENCH.prefix_len
    suffix_len: int = _BENCH.suffix_len
    num_prefixes: int = _BENCH.num_prefixes
    output_len: int = _BENCH.output_len
    num_prompts: int = _BENCH.num_prompts
    concurrency: int = _BENCH.concurrency
    decode_num_blocks: int | None = None
    gpus: str = ",".join(_SERVER.gpus)
    gpu_memory_utilization: float = _SERVER.gpu_memory_utilization
    server_args: tuple[str, ...] = ()
    ready_timeout: float = _SERVER.ready_timeout
    seed: int = _BENCH.seed
    expect_patched_hit: bool = False
    fail_fast: bool = False
    lmcache_without: tuple[str, ...] = ()
    # What PD requests go through: vLLM's router (e2e/router.py) or hybridpd's proxy.
    front: str = _SERVER.front
    # vLLM's --speculative-config JSON, passed to both instances (P is also the
    # single-instance reference); None: no speculative decoding.
    speculative_config: str | None = None
    # Where P and D run (netns.HOSTS): this host, or two simulated ones, each in
    # network, IPC and mount namespaces of its own (e2e/netns.py).
    hosts: str = "one"
    # fleet: decode instances behind the router, and the router's decode policies to
    # measure, one after the other on the same instances.
    decode_instances: int = 2
    policies: tuple[str, ...] = fleet_mod.DEFAULT_POLICIES

    def to_json(self) -> dict:
        """The report's ``options`` (its shape a contract: the pin as ``version``)."""
        return {"version": self.pin.version if self.pin else None, **{
            k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
            for k, v in dataclasses.asdict(self).items() if k != "pin"
        }}


@dataclasses.dataclass
class E2EResult:
    report: report_mod.E2EReport
    paths: dict[str, Path]
    failures: list[str]


def run(series: Series, options: E2EOptions, command: list[str], log: Log) -> E2EResult:
    """Run the pairs ``options`` asks for; ``command`` is recorded in the report as the
    command line that reproduces it. Raises E2EUsageError, E2EError or Interrupted."""
    o = options
    plan = _Plan.of(o, log)
    pin = o.pin
    if pin is None:
        raise E2EUsageError("Missing option '--pin'.")
    # Before any checkout, build or output: can this host run it at all?
    preflight(
        pin, o.device, plan.gpus,
        needs_wheel=any(plan.venv(o, b) is None for b in plan.builds),
        sdist=lambda: cache.sdist(series.package, pin.sdist, pin.sha256),
    )
    out_dir = o.out_dir or Path(f"e2e-{pin.version}-{o.device}-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    out_dir = out_dir.resolve()
    # A run killed before (SIGKILL) left its servers, here or in its own --out: end
    # them first.
    for reaped in reap_mod.reap(out_dir):
        log(f"left by an earlier run: {reaped.line()}")
    registered, unreadable = reap_mod.reap_registered()
    for reaped in registered:
        log(f"left by an earlier run: {reaped.line()}")
    for line in unreadable:
        log(f"warning: {line}")
    t_start = time.monotonic()

    # Environments first: a build failure should not cost a server start.
    with_lmcache = (
        {"lmcache": True, "lmcache_without": o.lmcache_without} if plan.lmcache else {}
    )
    envs = {
        b: given(venv, b) if (venv := plan.venv(o, b)) else prepare(
            series, pin, b, o.device, log, torch=o.torch_spec, **with_lmcache
        )
        for b in plan.builds
    }
    if o.front == "router":
        for env in envs.values():
            if env.prepared:
                router_mod.install(env.python, log)
            else:
                router_mod.require(env.python)
    opts = _server_options(o, plan)
    first = envs[plan.builds[0]]
    process_env = pair_mod.server_env(opts, "P", 0)
    caps = _capabilities(envs, process_env, o.device, log)
    model, vocab, notes = _model(o, first, caps, process_env, log, _is_mtp(plan.speculative))
    report = report_mod.E2EReport(
        pin=pin.version, device=o.device, model=model, scenario=o.scenario, role=o.role,
        command=list(command), options=o.to_json(),
        environments={b: e.to_json() for b, e in envs.items()},
        capabilities=caps,
        server_options={
            "block_size": o.block_size, "max_model_len": plan.max_model_len,
            "decode_prefix_caching": o.decode_prefix_caching, "extra_args": list(o.server_args),
            "front": (f"vllm-router {router_mod.VERSION}" if o.front == "router"
                      else "hybridpd proxy"),
            **({"speculative_config": plan.speculative} if plan.speculative else {}),
            **({"hosts": "netns: prefill and decode in network, IPC and mount namespaces of "
                         f"their own, UCX_TLS={netns.UCX_TLS}"} if o.hosts == "netns" else {}),
        },
        notes=notes,
    )
    failures: list[str] = []
    for build in plan.builds:
        for connector in plan.connectors:
            if o.scenario == "fleet":
                report.runs += _FleetRun(o, envs[build], build, connector, model, opts,
                                         out_dir / f"{build}-{connector}").run(
                                             report, out_dir, log)
                continue
            pair = _PairRun(o, envs[build], build, connector, model, vocab, opts,
                            out_dir / f"{build}-{connector}")
            report.runs.append(pair.run(report, out_dir, log))
            failures += _failures(report.runs[-1], o.scenario, o.expect_patched_hit, pin, o.tiny)
    report.timings_s["total"] = round(time.monotonic() - t_start, 1)
    paths = report_mod.write(report, out_dir, first.python)
    return E2EResult(report, paths, failures)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What the options ask for, checked before anything is done."""

    connectors: tuple[str, ...]
    gpus: tuple[str, ...]
    builds: tuple[str, ...]
    lmcache: bool = False  # the connector sets use LMCache: venvs with lmcache
    decode_num_blocks: int | None = None  # the decode pool; None: sized from memory
    max_model_len: int = _SERVER.max_model_len  # what the servers get
    speculative: dict | None = None  # --speculative-config, parsed

    @classmethod
    def of(cls, o: E2EOptions, log: Log) -> _Plan:
        if bool(o.model) == bool(o.tiny):
            raise E2EUsageError("give exactly one of --model and --tiny")
        if o.device == "cpu" and not o.tiny and not Path(o.model).exists():
            log("warning: on CPU a model hub is usually unreachable; "
                "--model should be a local path")
        connectors = tuple(o.connectors) or ("nixl",)
        if o.device == "cpu":
            bad = [c for c in connectors if c in pair_mod.GPU_ONLY_CONNECTORS]
            if bad:
                raise E2EUsageError(
                    f"{', '.join(bad)} do not start on a CPU engine; on CPU use nixl+decodebench"
                )
        if o.front not in router_mod.FRONTS:
            raise E2EUsageError(f"--front {o.front}: choose {' or '.join(router_mod.FRONTS)}")
        if o.hosts not in netns.HOSTS:
            raise E2EUsageError(f"--hosts {o.hosts}: choose {' or '.join(netns.HOSTS)}")
        if o.hosts == "netns":
            if o.device != "cpu":
                raise E2EUsageError(
                    "--hosts netns runs on CPU only so far: UCX over TCP alone moves host "
                    "memory, and a GPU's KV would need UCX's CUDA transports beside it")
            try:
                netns.check_usable()
            except netns.NetnsError as exc:
                raise E2EUsageError(exc.message) from None
        gpus = tuple(g.strip() for g in o.gpus.split(","))
        if len(gpus) not in (1, 2):
            raise E2EUsageError("--gpus takes two GPU ids (P,D), or one that P and D share")
        gpus = gpus * (3 - len(gpus))  # one GPU: P and D both on it
        builds = (
            ("stock",) if o.stock_only else ("patched", "stock") if o.compare else ("patched",)
        )
        lmcache = [c for c in connectors if lm.uses_lmcache(c)]
        if lmcache and len(lmcache) != len(connectors):
            raise E2EUsageError(
                f"{', '.join(lmcache)} run in venvs with lmcache, whose dependency pins differ:"
                " give LMCache connector sets an e2e run of their own"
            )
        if o.lmcache_without and not lmcache:
            raise E2EUsageError("--lmcache-without needs an LMCache connector set")
        if lmcache and o.device != "cpu":
            raise E2EUsageError(
                "LMCache connector sets run on CPU only so far (the lmcache wheel hybridpd "
                "builds has no GPU extension)"
            )
        if o.scenario == "smoke" and not 0 < o.shared_tokens < o.prompt_tokens:
            # make_prompts' own check, before the build and the servers' start.
            raise E2EUsageError(f"--shared-tokens {o.shared_tokens} must be between 0 and "
                                f"--prompt-tokens {o.prompt_tokens}")
        speculative = _speculative(o)
        blocks = o.decode_num_blocks
        if o.scenario == "fleet":
            blocks = _fleet_plan(o, blocks)
        if blocks is None and o.scenario == "correctness":
            blocks = CORRECTNESS_DECODE_BLOCKS
            if speculative:
                blocks = _speculative_decode_blocks(o, speculative)
        max_model_len = _max_model_len(o, blocks, bool(lmcache))
        return cls(connectors, gpus, builds, bool(lmcache), blocks, max_model_len, speculative)

    @staticmethod
    def venv(o: E2EOptions, build: str) -> Path | None:
        """The venv the user gave for ``build``; None: hybridpd prepares one."""
        return o.patched_venv if build == "patched" else o.stock_venv


def fleet_options(o: E2EOptions) -> fleet_mod.FleetOptions:
    """The fleet's sizes, counted in the blocks vLLM serves (:func:`_pool_block_size`):
    a pool and a prefix estimated in ``--block-size`` blocks on CPU, where vLLM raises
    it to hold a Mamba state, held every prefix and never evicted (measured: 18 blocks
    of 256 tokens)."""
    return fleet_mod.FleetOptions(
        o.decode_instances, tuple(o.policies),
        prefix_repetition.BenchOptions(o.prefix_len, o.suffix_len, o.num_prefixes,
                                       o.output_len, o.num_prompts, o.concurrency, o.seed),
        _pool_block_size(o))


def _fleet_plan(o: E2EOptions, blocks: int | None) -> int:
    """The fleet's checks; its decode pool (``--decode-num-blocks`` or the default of
    :func:`.fleet.decode_blocks`)."""
    if o.device != "cpu":
        raise E2EUsageError("the fleet scenario runs on CPU so far (--device cpu)")
    if o.front != "router":
        raise E2EUsageError("the fleet scenario needs --front router (the proxy has one "
                            "decode instance)")
    if o.hosts != "one":
        raise E2EUsageError(f"--hosts {o.hosts}: the fleet scenario runs its instances on "
                            "this host so far (--hosts one)")
    with_lmcache = [c for c in o.connectors if lm.uses_lmcache(c)]
    if with_lmcache:
        raise E2EUsageError(f"{', '.join(with_lmcache)}: the fleet scenario does not start "
                            "an lmcache server per decode instance; give NIXL sets")
    if o.decode_instances < 2:
        raise E2EUsageError(f"--decode-instances {o.decode_instances}: a fleet has at least 2")
    bad = [p for p in o.policies if p not in router_mod.DECODE_POLICIES]
    if bad or not o.policies:
        raise E2EUsageError(f"--policy {', '.join(bad) or '(none)'}: choose from "
                            f"{', '.join(router_mod.DECODE_POLICIES)}")
    if o.num_prompts < o.num_prefixes:
        raise E2EUsageError(f"--num-prompts {o.num_prompts} is fewer than --num-prefixes "
                            f"{o.num_prefixes}: every prefix needs a request")
    fo = fleet_options(o)
    if fleet_mod.prefix_blocks(o.prefix_len, fo.block_size) == 0:
        raise E2EUsageError(f"--prefix-len {o.prefix_len} is shorter than a block "
                            f"({fo.block_size} tokens): no decode-side hit is possible")
    types = _layer_types(o)
    blocks = fleet_mod.decode_blocks(fo, types) if blocks is None else blocks
    if fleet_mod.holds_every_prefix(fo, blocks, types):
        raise E2EUsageError(
            f"a decode pool of {blocks} blocks holds all {o.num_prefixes} prefixes: nothing "
            "evicts, so every policy reaches the limit; give fewer --decode-num-blocks or "
            "more --num-prefixes")
    return blocks


#: The correctness scenario's decode pool in blocks (``--decode-num-blocks``' default
#: there): small enough that its concurrent requests preempt (see CorrectnessOptions).
#: With speculative decoding, see :func:`_speculative_decode_blocks`.
CORRECTNESS_DECODE_BLOCKS = 16


def _speculative_decode_blocks(o: E2EOptions, speculative: dict) -> int:
    """The correctness scenario's decode pool with speculative decoding: the smallest
    that admits two of its concurrent requests at once (:func:`.pair.concurrent_pool_blocks`),
    and at least the smallest vLLM starts with at ``--max-model-len`` (left out: the
    length the pool of :data:`CORRECTNESS_DECODE_BLOCKS` holds without it).

    With speculative decoding one request takes most of a small pool (1 + N pages in
    each Mamba group), so the pool sized for one request's length alone (19 blocks for
    N = 3 at 1024 tokens) admitted one request at a time, which never outgrows it:
    measured with ``nixl``, N = 3, no preemption at 19 or 22 blocks. Two admitted
    requests that cross their next block boundary do not fit, and one is preempted."""
    length = o.max_model_len
    if length is None:
        length = pair_mod.pool_max_model_len(CORRECTNESS_DECODE_BLOCKS, o.block_size,
                                             _layer_types(o, drafter=False))
    n = speculative_tokens(speculative)
    types = _layer_types(o)
    prefix, prompt = correctness.concurrent_prompt_span(
        correctness.CorrectnessOptions(block_size=o.block_size))
    block = _pool_block_size(o)
    return max(pair_mod.pool_blocks(length, block, types, n),
               pair_mod.concurrent_pool_blocks(prefix, prompt, block, types, n))


def _pool_block_size(o: E2EOptions) -> int:
    """The block size the decode pool is counted in: the one vLLM serves
    (:func:`_served_block_size`, else ``--block-size``) with speculative decoding and in
    the fleet, whose pools are sized from it; ``--block-size`` for the other scenarios,
    whose pools were measured in it and fit on every host."""
    n = speculative_tokens(_speculative(o))
    if n or o.scenario == "fleet":
        return _served_block_size(o, n) or o.block_size
    return o.block_size


def _served_block_size(o: E2EOptions, speculative_tokens: int) -> int | None:
    """The block size the instances serve on CPU (:func:`.pair.served_block_size`, the
    state in :data:`.pair.CPU_SSM_CACHE_DTYPE`) for the tiny model or a local model's
    config; None where it cannot be derived (a GPU, a hub id, a config without
    Gated-DeltaNet sizes): sizes then use ``--block-size`` and nothing checks it."""
    if o.device != "cpu":
        return None
    try:
        return pair_mod.served_block_size(_text_config(o), o.block_size, speculative_tokens)
    except KeyError:
        return None


def _text_config(o: E2EOptions) -> dict:
    """The model's text config before anything is built: the tiny model's spec, a local
    model's config.json (its ``text_config``), else nothing (a hub id)."""
    if o.tiny:
        return dict(SPEC)
    cfg = Path(o.model) / "config.json" if o.model else None
    if cfg is None or not cfg.exists():
        return {}
    data = json.loads(cfg.read_text())
    return data.get("text_config", data)


def _speculative(o: E2EOptions) -> dict | None:
    """``--speculative-config`` as vLLM takes it, checked where the e2e depends on it:
    a JSON object with a positive ``num_speculative_tokens``; with ``--tiny`` only
    ``"method": "mtp"`` (the tiny model's drafter is its MTP module)."""
    if o.speculative_config is None:
        return None
    data = spec_mod.load(o.speculative_config)
    n = data.get("num_speculative_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise E2EUsageError("--speculative-config: num_speculative_tokens must be a positive "
                            f"integer, not {n!r}")
    if o.tiny and data.get("method") != "mtp":
        raise E2EUsageError(f"--speculative-config: method {data.get('method')!r} with --tiny;"
                            " the tiny model drafts with its MTP module (\"method\": \"mtp\")")
    return data


def speculative_tokens(speculative: dict | None) -> int:
    return speculative["num_speculative_tokens"] if speculative else 0


def _is_mtp(speculative: dict | None) -> bool:
    return bool(speculative) and speculative.get("method") == "mtp"


def _max_model_len(o: E2EOptions, blocks: int | None, lmcache: bool) -> int:
    """``--max-model-len`` for both servers: the one given; left out, the longest
    request a decode pool of ``blocks`` blocks holds, or 4096 where the pool is sized
    from memory. E2EUsageError where the value, or the pool, cannot hold the scenario's
    longest request, or the pool cannot hold the value given: vLLM would refuse it only
    after the build and a server start (minutes), or fail a request mid-run."""
    longest = _longest_request(o, lmcache)
    value = o.max_model_len if o.max_model_len is not None else _SERVER.max_model_len
    if blocks is not None:
        # P's pool is sized from memory; D's is `blocks` blocks, and vLLM starts D only
        # when one request of --max-model-len tokens fits it (pair.pool_max_model_len).
        n = speculative_tokens(_speculative(o))
        block = _pool_block_size(o)
        holds = pair_mod.pool_max_model_len(blocks, block, _layer_types(o), n)
        pool = (f"a decode pool of {blocks} blocks of {block} tokens holds one "
                f"request of at most {holds} tokens")
        if holds < longest:
            raise E2EUsageError(
                f"{pool}, short of the {o.scenario} scenario's longest request ({longest} "
                "tokens): give more --decode-num-blocks or a larger --block-size")
        if o.max_model_len is None:
            value = holds
        elif o.max_model_len > holds:
            raise E2EUsageError(
                f"--max-model-len {o.max_model_len} does not fit: {pool}; give at most "
                f"{holds} (or leave it out), more --decode-num-blocks or a larger --block-size")
    if value < longest:
        raise E2EUsageError(
            f"--max-model-len {value} is shorter than the {o.scenario} scenario's longest "
            f"request ({longest} tokens, prompt and output): give at least {longest}")
    if o.tiny and value > SPEC["max_position_embeddings"]:
        # vLLM refuses a --max-model-len over the model's positions.
        raise E2EUsageError(f"--max-model-len {value} is longer than the tiny model's "
                            f"{SPEC['max_position_embeddings']} positions")
    return value


def _longest_request(o: E2EOptions, lmcache: bool) -> int:
    """Tokens of the scenario's longest request, prompt and output."""
    if o.scenario == "smoke":
        return o.prompt_tokens + o.max_tokens
    if o.scenario == "correctness":
        n = speculative_tokens(_speculative(o))
        return correctness.longest_request(correctness.CorrectnessOptions(
            block_size=o.block_size, max_tokens=o.max_tokens, seed=o.seed, lmcache=lmcache,
            speculative=n > 0, served_block_size=_served_block_size(o, n)))
    return o.prefix_len + o.suffix_len + o.output_len


def _layer_types(o: E2EOptions, drafter: bool = True) -> list[str] | tuple[str, ...]:
    """The model's layer types before anything is built: the tiny model's spec, a
    local model's config.json, else Qwen3.5's layout (a hub id); with MTP, its
    modules' full-attention layers after them (vLLM groups the drafter's KV cache with
    the target's; ``drafter`` False: without them)."""
    mtp = drafter and _is_mtp(_speculative(o))
    if o.tiny:
        return list(SPEC["layer_types"]) + ["full_attention"] * mtp
    data = _text_config(o)
    types = list(data.get("layer_types") or pair_mod.QWEN35_LAYER_TYPES)
    return types + ["full_attention"] * (spec_mod.mtp_modules(data) if mtp else 0)


def dry_run(series: Series, options: E2EOptions, log: Log) -> list[str]:
    """The server command lines of every pair ``options`` asks for, P then D, nothing
    started or built (the venvs given, or ``VENV`` where hybridpd would prepare one; the
    tiny model where the run would write it)."""
    o = options
    plan = _Plan.of(o, log)
    if o.pin is None:
        raise E2EUsageError("Missing option '--pin'.")
    arch = "qwen3_5" if o.tiny_arch == "auto" else o.tiny_arch
    variant = "state-sensitive" if o.scenario == "correctness" else "default"
    model = str(o.model) if o.model else str(
        cache.cache_dir() / "e2e" / "models" / f"tiny-{arch}-{spec_id(o.seed, arch, variant)}"
    )
    opts = _server_options(o, plan)
    lines = []
    for build in plan.builds:
        venv = plan.venv(o, build) or Path("VENV")
        env = Env(build, Path(venv) / "bin" / "python", Path(venv), None, None, False, {})
        for connector in plan.connectors:
            lines.append(f"# {build} / {connector}")
            if o.scenario == "fleet":
                lines += fleet_mod.dry_run_lines(env, model, connector, o.role, opts,
                                                 fleet_options(o))
                continue
            lines += pair_mod.dry_run_lines(env, model, connector, o.role, opts)
    return lines


def _server_options(o: E2EOptions, plan: _Plan) -> pair_mod.ServerOptions:
    return pair_mod.ServerOptions(
        device=o.device, block_size=o.block_size, max_model_len=plan.max_model_len,
        decode_prefix_caching=o.decode_prefix_caching, gpus=plan.gpus,
        gpu_memory_utilization=pair_mod.memory_share(o.gpu_memory_utilization, plan.gpus),
        extra_args=tuple(o.server_args),
        ready_timeout=o.ready_timeout, decode_num_blocks=plan.decode_num_blocks,
        front=o.front,
        speculative_config=(json.dumps(plan.speculative, separators=(",", ":"))
                            if plan.speculative else None),
        hosts=o.hosts,
    )


def _capabilities(envs: dict[str, Env], process_env: dict, device: str, log: Log) -> dict:
    """What each venv can do (:func:`.envs.probe`); an error where it cannot serve."""
    caps = {b: probe(e, process_env, device) for b, e in envs.items()}
    for b, c in caps.items():
        log(f"[{b}] compiled ops: {c['kernels']['module']} ({c['kernels']['status']})")
        if c["kernels"]["status"] != "ok":
            raise E2EError(
                f"[{b}] vLLM's compiled ops ({c['kernels']['module']}) do not load in"
                f" {envs[b].venv}: {c['kernels']['status']}"
            )
        if c["nixl"] != "ok":
            raise E2EError(f"[{b}] NixlConnector cannot load nixl in {envs[b].venv}: {c['nixl']}")
    return caps


def _model(
    o: E2EOptions, first: Env, caps: dict, process_env: dict, log: Log, mtp: bool = False
) -> tuple[str, int | None, list[str]]:
    """The model to serve (``--model``, or the tiny one written here, with its MTP
    module where ``mtp``), its vocabulary size where the scenario makes prompts of
    token ids, and notes for the report."""
    if not o.tiny:
        vocab = _vocab_size(o.model) if o.scenario in ("smoke", "correctness") else None
        return o.model, vocab, []
    notes = []
    arch = o.tiny_arch
    if arch == "auto":
        arch = "qwen3_5" if all(c["qwen3_5"] == "ok" for c in caps.values()) else "qwen3_next"
    if mtp and arch != "qwen3_5":
        raise E2EError("the tiny model's MTP module is Qwen3.5's; vLLM's Qwen3.5 module does "
                       f"not import here ({arch} would stand in)")
        if arch != "qwen3_5":
            why = next(c["qwen3_5"] for c in caps.values() if c["qwen3_5"] != "ok")
            notes.append(
                "tiny model: Qwen3NextForCausalLM stands in for Qwen3_5ForCausalLM "
                f"(same Gated-DeltaNet + gated attention decoder layers) because vLLM's "
                f"Qwen3.5 module does not import in this venv: {why}"
            )
            log(f"note: {notes[-1]}")
    # correctness compares outputs: its model's tokens must depend on the Mamba state;
    # with MTP, also follow its drafts often enough (tinymodel.VARIANTS).
    variant = ("state-sensitive-mtp" if mtp else
               "state-sensitive" if o.scenario == "correctness" else "default")
    path = tiny_model(first, arch, o.seed, cache.cache_dir() / "e2e" / "models", process_env,
                      variant, mtp)
    manifest = json.loads((path / "hybridpd-tiny.json").read_text())
    log(f"tiny model {manifest['architectures'][0]} ({manifest['parameters']:,} parameters) "
        f"at {path}")
    return str(path), manifest["vocab_size"], notes


@contextlib.contextmanager
def _reaped(run_dir: Path) -> Iterator[Processes]:
    """The processes of one run, all reaped when the block ends: an E2EError raised
    inside is explained by a server that died, if one did; after the block, one left
    running is an E2EError."""
    with Processes(run_dir) as procs:
        try:
            yield procs
        except E2EError:
            procs.check_soon()
            raise
    left = procs.leftovers()
    if left:
        raise E2EError(f"processes left running after the run: {left}")


@dataclasses.dataclass(frozen=True)
class _PairRun:
    """One (build, connector): a fresh prefill, decode and front, the scenario, and the
    servers reaped; logs in ``run_dir``."""

    o: E2EOptions
    env: Env
    build: str
    connector: str
    model: str
    vocab: int | None
    opts: pair_mod.ServerOptions
    run_dir: Path

    def run(self, report: report_mod.E2EReport, out_dir: Path, log: Log) -> report_mod.RunResult:
        """The finished run. A failed one is written to the report (with what ran
        before it) and raised as E2EError, or Interrupted on Ctrl-C."""
        log(f"== {self.build} / {self.connector}: starting prefill, decode and {self.o.front} "
            f"(logs: {self.run_dir})")
        show, done = progress.printer()
        t0 = time.monotonic()
        try:
            with _reaped(self.run_dir) as procs:
                pair = pair_mod.start_pair(procs, self.env, self.model, self.connector,
                                           self.o.role, self.opts, show)
                done()
                log(f"   ready: {pair.ready_s}")
                t1 = time.monotonic()
                result = self._scenario(pair, procs, log)
                t2 = time.monotonic()
                if pair.network is not None:
                    _transport(pair.network, procs, result, log)
                if self.opts.speculative_config is not None:
                    result["speculative"] = _acceptance(pair, log)
                if lm.uses_lmcache(self.connector):
                    shm = lm.segments_after_stop(procs, log)
                    result.setdefault("checks", {})[
                        "lmcache_removed_exited_segments"] = shm.pop("check")
                    result.update(shm)
        except (E2EError, KeyboardInterrupt) as exc:
            done()
            report.runs.append(report_mod.RunResult.failed(
                self.build, self.connector, str(exc), self.run_dir))
            report_mod.write(report, out_dir, None)
            if isinstance(exc, KeyboardInterrupt):
                raise Interrupted(f"interrupted; logs kept in {self.run_dir}") from None
            raise E2EError(f"{self.build} / {self.connector}: {exc}") from None
        return report_mod.RunResult.from_json({
            "build": self.build, "connector": self.connector, **result,
            "ready_s": pair.ready_s, "scenario_s": round(t2 - t1, 1),
            "total_s": round(time.monotonic() - t0, 1), "logs": str(self.run_dir),
            "server_commands": pair.commands,
        })

    def _scenario(self, pair: pair_mod.Pair, procs: Processes, log: Log) -> dict:
        o = self.o
        if o.scenario == "smoke":
            return smoke.run_smoke(
                pair, procs, self.vocab,
                smoke.SmokeOptions(o.prompt_tokens, o.shared_tokens, o.max_tokens,
                                   o.baseline_tokens, o.seed),
                log,
            )
        if o.scenario == "correctness":
            return correctness.run_correctness(
                pair, procs, self.vocab,
                correctness.CorrectnessOptions(
                    block_size=o.block_size, max_tokens=o.max_tokens, seed=o.seed,
                    lmcache=lm.uses_lmcache(self.connector),
                    speculative=_speculative(o) is not None, fail_fast=o.fail_fast,
                    served_block_size=_served_block_size(
                        o, speculative_tokens(_speculative(o)))),
                log,
            )
        return prefix_repetition.run_prefix_repetition(
            pair, procs, self.env, self.model,
            prefix_repetition.BenchOptions(o.prefix_len, o.suffix_len, o.num_prefixes,
                                           o.output_len, o.num_prompts, o.concurrency,
                                           o.seed),
            self.run_dir, log,
        )


@dataclasses.dataclass(frozen=True)
class _FleetRun:
    """One (build, connector) as a fleet: a prefill and ``decode_instances`` decode
    instances, a router per decode policy, and every process reaped; one run of the
    report per policy."""

    o: E2EOptions
    env: Env
    build: str
    connector: str
    model: str
    opts: pair_mod.ServerOptions
    run_dir: Path

    def run(self, report: report_mod.E2EReport, out_dir: Path,
            log: Log) -> list[report_mod.RunResult]:
        o = self.o
        log(f"== {self.build} / {self.connector}: starting prefill, {o.decode_instances} "
            f"decode instances, a router per policy ({', '.join(o.policies)}; logs: "
            f"{self.run_dir})")
        t0 = time.monotonic()
        results: list[dict] = []

        def runs() -> list[report_mod.RunResult]:
            return [report_mod.RunResult.from_json({
                "build": self.build, "connector": self.connector, **r,
                "total_s": round(time.monotonic() - t0, 1), "logs": str(self.run_dir),
            }) for r in results]

        try:
            with _reaped(self.run_dir) as procs:
                fleet_mod.run_fleet(procs, self.env, self.model, self.connector, o.role,
                                    self.opts, fleet_options(o), self.run_dir, log, results)
        except (E2EError, KeyboardInterrupt) as exc:
            report.runs += runs()
            report.runs.append(report_mod.RunResult.failed(
                self.build, self.connector, str(exc), self.run_dir))
            report_mod.write(report, out_dir, None)
            if isinstance(exc, KeyboardInterrupt):
                raise Interrupted(f"interrupted; logs kept in {self.run_dir}") from None
            raise E2EError(f"{self.build} / {self.connector}: {exc}") from None
        return runs()


#: The acceptance rate (accepted / drafted tokens, vLLM's counters on the decode
#: instance) the tiny model's MTP module must land in: drafts accepted often enough that
#: the accepted-token paths run, rejected often enough that the rejection paths do.
ACCEPTANCE = (0.2, 0.8)


def _transport(network: netns.Network, procs: Processes, result: dict, log: Log) -> None:
    """The simulated hosts' proof: NIXL's transfers went over TCP on the link
    (:func:`.netns.tcp_verdict` on the instances' logs); into ``result``'s checks
    (``nixl_over_tcp``) and figures (``network``, ``ucx_transports``)."""
    logs = {}
    for side, name in (("p", "prefill"), ("d", "decode")):
        try:
            logs[side] = procs.procs[name].log.read_text(errors="replace")
        except OSError as exc:
            raise E2EError(f"cannot read the {name} instance's log: {exc}") from None
    ok, seen = netns.tcp_verdict(network, logs)
    result.setdefault("checks", {})["nixl_over_tcp"] = ok
    result["network"] = network.to_json()
    result["ucx_transports"] = seen
    log(f"   UCX transports between the hosts: decode "
        f"{', '.join(seen['remote_endpoints'].get('d', [])) or 'none'}, prefill "
        f"{', '.join(seen['remote_endpoints'].get('p', [])) or 'none'}")


def _acceptance(pair: pair_mod.Pair, log: Log) -> dict:
    """Each instance's drafted and accepted tokens over the whole run (vLLM's
    ``vllm:spec_decode_num_*`` counters)."""
    out = {}
    for side, url in (("decode", pair.decode), ("prefill", pair.prefill)):
        try:
            out[side] = metrics.acceptance(metrics.scrape(url))
        except (OSError, ValueError) as exc:
            raise E2EError(f"cannot read the {side} instance's metrics: {exc}") from None
    d = out["decode"] or {}
    log(f"   speculative decoding on D: {d.get('accepted_tokens')} of {d.get('draft_tokens')} "
        f"drafted tokens accepted ({d.get('acceptance_rate')})")
    return out


def tiny_model(env: Env, arch: str, seed: int, cache: Path, process_env: dict,
               variant: str = "default", mtp: bool = False) -> Path:
    """The tiny model for ``arch``/``seed``/``variant`` (with its MTP module where
    ``mtp``), written once under ``cache``."""
    import shutil

    dest = cache / f"tiny-{arch}-{spec_id(seed, arch, variant, mtp)}"
    if (dest / "hybridpd-tiny.json").exists():
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    done = proc.run(
        [env.python, Path(__file__).with_name("tinymodel.py"), tmp,
         "--seed", str(seed), "--arch", arch, "--variant", variant, *(["--mtp"] * mtp)],
        env=process_env,
    )
    if not done.ok:
        shutil.rmtree(tmp, ignore_errors=True)
        raise E2EError(f"could not write the tiny model: {done.tail()}")
    tmp.rename(dest)
    return dest


#: Connector sets for which stock vLLM (v0.24+) already keeps the decode-side hit.
UPSTREAM_CAPABLE_CONNECTORS = frozenset({"nixl"})


def _has_upstream_gate(pin: Pin) -> bool:
    """Whether stock ``pin`` keeps the decode-side hit for capable connectors (v0.24+)."""
    return release_key(pin.version) >= release_key("0.24")


def _failures(
    run: report_mod.RunResult, scenario: str, expect_patched_hit: bool, pin: Pin,
    tiny: bool = False,
) -> list[str]:
    """Checks that fail the command: outputs always; the hit only with the gate flag
    (patched must hit; on pins with upstream's capability gate (v0.24+), stock must
    hit exactly for the connector sets upstream handles)."""
    where = run.where
    out = []
    if not (run.checks or {}).get("nixl_over_tcp", True):
        seen = run.figures.get("ucx_transports") or {}
        out.append(f"{where}: NIXL's transfers between the simulated hosts did not go over "
                   f"{seen.get('expected', 'TCP')} alone (UCX's protocol tables: "
                   f"{seen.get('remote_endpoints')}, other transports "
                   f"{seen.get('other_transports')})")
    if not (run.checks or {}).get("lmcache_removed_exited_segments", True):
        out.append(f"{where}: the lmcache server left the stopped decode instance's "
                   "shared-memory segments behind (or it registered none): "
                   f"{run.figures.get('decode_shm_segments_left_by_lmcache')}")
    spec = (run.figures.get("speculative") or {}).get("decode")
    if tiny and "speculative" in run.figures:
        rate = (spec or {}).get("acceptance_rate")
        if rate is None or not ACCEPTANCE[0] <= rate <= ACCEPTANCE[1]:
            out.append(f"{where}: the decode instance accepted {rate} of the MTP module's drafts,"
                       f" outside {ACCEPTANCE[0]}..{ACCEPTANCE[1]} (the tiny model's MTP weights"
                       " no longer draft as designed)")
    if scenario == "correctness":
        return out + _correctness_failures(run, where, expect_patched_hit)
    if scenario != "smoke":
        return out
    checks = run.checks or {}
    if not checks.get("warm_equals_cold_decode", True):
        out.append(f"{where}: the decode output with a local prefix hit differs from a cold decode instance's")
    if not checks.get("first_tokens_equal_single_instance", True):
        out.append(f"{where}: the first tokens differ from a single-instance run")
    if not checks.get("upstream_outputs_equal", True):
        out.append(f"{where}: the same prompt twice gave different outputs")
    if not expect_patched_hit:
        return out
    hit = checks.get("decode_local_hit")
    if run.build == "patched" and not hit:
        out.append(f"{where}: the decode instance took no local prefix hit for the shared-prefix request")
    if run.build == "stock" and _has_upstream_gate(pin):
        # Upstream keeps the hit exactly when every connector declares
        # supports_divergent_local_hybrid_hits (NIXL alone does): stock must
        # show that, or the gate proves nothing.
        capable = run.connector in UPSTREAM_CAPABLE_CONNECTORS
        if capable and not hit:
            out.append(f"{where}: stock lost the decode-side hit that upstream keeps for this connector")
        if not capable and hit:
            out.append(f"{where}: stock already keeps the decode-side hit, so the gate proves nothing")
    return out


def _correctness_failures(
    run: report_mod.RunResult, where: str, expect_patched_hit: bool
) -> list[str]:
    checks = run.checks or {}
    out = [
        f"{where}: {r['label']} differs from the single-instance reference: {r['note']}"
        for r in run.requests if not r["equal"]
    ]
    if not checks.get("preemption_forced", True):
        out.append(f"{where}: no preemption on the decode instance (its pool admitted too few "
                       "requests at once, or held them all)")
    if expect_patched_hit and run.build == "patched" and not checks.get("decode_local_hit"):
        out.append(f"{where}: the decode instance took no local prefix hit for request B")
    if not checks.get("lmcache_served_a_hit", True):
        misses = run.figures.get("lmcache_not_served") or []
        said = [line for m in misses for line in m.get("log_lines", [])][-5:]
        out.append(f"{where}: LMCache served no hit to the decode instance (L2, "
                   f"{len(misses)} attempt(s)), so the state it restores was not checked; "
                   + ("its logs say: " + " | ".join(said) if said
                      else "its logs name no fault (no degraded mode, reaping or error)"))
    return out


def _vocab_size(model: str) -> int:
    cfg = Path(model) / "config.json"
    if cfg.exists():
        data = json.loads(cfg.read_text())
        data = data.get("text_config", data)
        return int(data["vocab_size"])
    return 32000  # token ids below any real model's vocabulary
