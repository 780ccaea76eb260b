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
CONNECTORS = connectors.names("bench")

#: Keys of a build's result in the report (the JSON contract), in order.
RESULT_KEYS = (
    "hit_tokens", "limit_tokens", "pulled_tokens", "recomputed_below_target_tokens",
    "corner_admissions", "corner_recomputed_tokens", "blocks_allocated", "peak_block_usage",
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
        "workload": asdict(options.workload),
        "cost": plan.cost,
    }


def run(
    series: Series,
    options: ReplayOptions,
    log: Log = quiet,
    status: Callable[[dict], None] = lambda _: None,
) -> ReplayReport:
    if options.connector not in CONNECTORS:
        raise UsageError(f"unknown connector set {options.connector}")
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
    for line in plan.derivation:
        log(line)
    results, traces = {}, {}
    with prepared(series, options.pin, log) as env:
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
