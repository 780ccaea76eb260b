"""``hybridpd bench replay``: vllm#42524's workload through a pin's real decode-side
scheduler, stock and patched side by side.

:func:`run` plans the deployment (:mod:`.deployment`), runs
``decode_replay.py`` under the stock tree and then the patched tree of the pin
(:mod:`.env`), and returns a :class:`ReplayReport`: per build the exact counts (hits,
pulls, blocks, running, waiting, preemptions, steps) and the modelled TTFT and
throughput, plus the ratios patched/stock.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from hybridpd import connectors
from hybridpd.speculative import Speculative, mtp_modules
from hybridpd.bench import deployment
from hybridpd.bench.env import BUILDS, BenchEnv, prepared, run_script
from hybridpd.errors import UsageError
from hybridpd.progress import Log, quiet
from hybridpd.series.model import Pin, Series

DRIVER = Path(__file__).with_name("decode_replay.py")

#: Connector sets a replay can run (the registry's ``bench`` sets, which the builders
#: construct): NIXL alone, and NIXL beside a connector that does not deliver the Mamba
#: state (upstream's gate is false).
#: ``decodebench+nixl`` is left out on purpose: DecodeBench's
#: ``get_num_new_matched_tokens`` claims every new request's uncomputed tokens but
#: the last (it fills them with dummy KV), and a MultiConnector serves a request
#: from the first child that reports tokens, so NIXL would never load anything:
#: no P/D pull, no load target, nothing this replay measures.
CONNECTORS = connectors.names("replay")

#: Sets with a hash-store child (vLLM's OffloadingConnector, lmcache's
#: LMCacheMPConnector), and the release they need: before v0.32 neither class
#: supports HMA, and vLLM's connector factory refuses them beside the hybrid KV cache
#: manager (``KVConnectorFactory``: "does not support HMA but HMA is enabled").
STORE_CHILDREN = ("OffloadingConnector", "LMCacheMPConnector")
STORES_SINCE = (0, 32)

#: The store's default capacity in chunks of one block: about 97 GB of CPU memory at
#: the default model's 23.6 MB block (10 layer slots of 2,359,296 B), four times the
#: decode pool's 811 blocks.
STORE_BLOCKS = 4096

#: Keys of a build's result in the report (the JSON contract), in order.
RESULT_KEYS = (
    "hit_tokens", "limit_tokens", "pulled_tokens", "recomputed_below_target_tokens",
    "corner_admissions", "corner_recomputed_tokens", "limited_requests", "speculative",
    "served_by", "store_blocks",
    "store_evicted_chunks", "blocks_allocated", "peak_block_usage",
    "peak_running", "mean_running", "peak_waiting", "mean_waiting", "preemptions", "steps",
    "ttft_ms_est", "ttft_p50_ms_est", "makespan_s_est", "output_tps_est", "wall_s",
)

#: Ratios patched/stock shown beside the results.
RATIO_KEYS = ("blocks_allocated", "peak_running", "mean_running", "steps", "ttft_ms_est",
              "output_tps_est")


@dataclass
class ReplayOptions:
    pin: Pin
    workload: deployment.Workload = field(default_factory=deployment.Workload)
    hardware: deployment.Hardware = field(default_factory=deployment.Hardware)
    connector: str = "nixl"
    block_size: int = 128
    kv_blocks: int | None = None
    kv_gib: float | None = None
    model_config: Path | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_model_len: int = 24576
    #: The hash-store child's capacity in chunks of one block (sets with one).
    store_blocks: int = STORE_BLOCKS
    #: Speculative decoding on the decode instance (MTP), or None.
    speculative: Speculative | None = None


@dataclass
class ReplayReport:
    pin: str
    connector: str
    #: What the stock build is: the release, plus any patches it needs to run at all.
    stock_build: str
    workload: dict[str, Any]
    cost_model: dict[str, Any]
    results: dict[str, dict[str, Any]]
    traces: dict[str, list] = field(default_factory=dict)

    def ratios(self) -> dict[str, float | None]:
        stock, patched = self.results["stock"], self.results["patched"]
        return {
            k: (round(patched[k] / stock[k], 3) if stock[k] else None) for k in RATIO_KEYS
        }

    def hit_fraction(self, build: str = "patched") -> float | None:
        """The hit as a fraction of the limit; None when the workload allows none."""
        r = self.results[build]
        return r["hit_tokens"] / r["limit_tokens"] if r["limit_tokens"] else None

    def to_json(self) -> dict[str, Any]:
        return {
            "pin": self.pin,
            "connector": self.connector,
            "stock_build": self.stock_build,
            "workload": self.workload,
            "cost_model": self.cost_model,
            **{b: self.results[b] for b in BUILDS},
            "ratios": self.ratios(),
        }


def store_child(connector: str) -> str | None:
    """The set's hash-store child class, or None."""
    return next((c for c in connectors.get(connector).children if c in STORE_CHILDREN), None)


def check_store_pin(connector: str, pin: Pin) -> None:
    """One line where the pin's release cannot run the set's hash-store child on a
    hybrid model."""
    child = store_child(connector)
    version = tuple(int(x) for x in pin.version.split(".")[:2])
    if child is None or version >= STORES_SINCE:
        return
    raise UsageError(f"--connector {connector} needs vLLM 0.32 or later: on {pin.version} "
                     f"{child} does not support the hybrid KV cache manager (HMA) that a "
                     "hybrid Mamba model needs, and vLLM refuses the set at start-up")


def spec(options: ReplayOptions, plan: deployment.Plan, env: BenchEnv, build: str) -> dict[str, Any]:
    return {
        "build": build,
        "builders_dir": str(env.builders_dir),
        "connector": options.connector,
        "block_size": plan.block_size,
        "num_blocks": plan.num_blocks,
        "num_mamba_groups": plan.num_mamba_groups,
        "max_num_seqs": options.max_num_seqs,
        "max_num_batched_tokens": options.max_num_batched_tokens,
        "max_model_len": options.max_model_len,
        "store_blocks": options.store_blocks,
        "speculative": speculative_spec(options, plan),
        "workload": asdict(options.workload),
        "cost": plan.cost,
    }


def speculative_spec(options: ReplayOptions, plan: deployment.Plan) -> dict[str, Any] | None:
    if options.speculative is None:
        return None
    return {**options.speculative.to_json(),
            "mtp_modules": mtp_modules(deployment.load_model_config(options.model_config))}


def speculative_cost(plan: deployment.Plan, options: ReplayOptions) -> list[str]:
    """Add MTP's modelled cost to ``plan.cost`` and return its derivation: each step
    runs N drafting passes of one MTP module (one decoder layer's weights read each),
    and every scheduled request verifies N draft tokens (prefill compute per token).
    Acceptance is not modelled: each step still yields one token per request."""
    if options.speculative is None:
        return []
    n = options.speculative.num_speculative_tokens
    layers = deployment.load_model_config(options.model_config)["num_hidden_layers"]
    plan.cost["draft_ms_per_step"] = n * plan.cost["weights_read_ms"] / layers
    plan.cost["verify_tokens_per_request"] = n
    return [
        f"MTP, {n} speculative tokens: {n} drafting passes per step of one MTP module "
        f"(one of {layers} layers' weights each) = {plan.cost['draft_ms_per_step']:.2f} ms, "
        f"+ {n} verified tokens per scheduled request at the prefill rate; acceptance is "
        "not modelled (one token per request per step, so MTP's speed-up is not counted)",
    ]


def run(
    series: Series,
    options: ReplayOptions,
    log: Log = quiet,
    status: Callable[[dict], None] = lambda _: None,
) -> ReplayReport:
    if options.connector not in CONNECTORS:
        raise UsageError(f"unknown connector set {options.connector}")
    check_store_pin(options.connector, options.pin)
    w = options.workload
    if not 0 <= w.exact_repeat_fraction <= 1:
        raise UsageError(f"--exact-repeat-fraction {w.exact_repeat_fraction} is not in [0, 1]")
    if w.prefix_len + w.suffix_len + w.output_len > options.max_model_len:
        raise UsageError(
            f"prompt + output ({w.prefix_len + w.suffix_len + w.output_len} tokens) exceed "
            f"--max-model-len {options.max_model_len}"
        )
    plan = deployment.plan(
        w, options.hardware, deployment.load_model_config(options.model_config),
        options.block_size, options.kv_blocks, options.kv_gib,
    )
    plan.derivation.extend(speculative_cost(plan, options))
    for line in plan.derivation:
        log(line)
    results, traces = {}, {}
    with prepared(series, options.pin, log) as env:
        if connectors.uses(options.connector, "LMCacheMPConnector"):
            env.with_layers(log)
        stock_build = f"v{options.pin.version}" + "".join(f" + {p}" for p in env.baseline)
        if env.baseline:
            log(f"stock build: {stock_build} (the release cannot run a remote prefill "
                "of a hybrid model without it)")
        for build in BUILDS:
            log(f"replaying {w.num_prompts} prompts on {options.pin.version} {build} ({options.connector})")
            result = run_script(env, build, DRIVER, spec(options, plan, env, build), status)
            traces[build] = result.pop("trace")
            results[build] = {k: result[k] for k in RESULT_KEYS}
    cost_model = {
        "hardware": asdict(options.hardware),
        "block_size": plan.block_size,
        "requested_block_size": options.block_size,
        "kv_blocks": plan.num_blocks,
        "per_step_and_pull": plan.cost,
        "derivation": plan.derivation,
    }
    return ReplayReport(options.pin.version, options.connector, stock_build, asdict(w), cost_model,
                        results, traces)
