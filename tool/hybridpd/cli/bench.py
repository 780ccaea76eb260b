"""``hybridpd bench``: the decode-side effect of the series at vllm#42524's scale, on CPU.

``replay`` drives a pin's real scheduler as a decode instance
(:mod:`hybridpd.bench.replay`); ``lookup`` times the hit computation
(:mod:`hybridpd.bench.lookup`). Exit codes: 0 ok, 1 a run
failed or an ``--expect-*`` gate failed, 2 usage, 130 interrupted.
"""

from __future__ import annotations

from pathlib import Path

import click

from hybridpd import progress, speculative
from hybridpd.bench import deployment, lookup, render
from hybridpd.bench import replay as replay_mod
from hybridpd.cli import jsonout
from hybridpd.cli.options import connector_option, pin_option
from hybridpd.errors import CheckFailed
from hybridpd.series.model import Pin

_W, _H = deployment.Workload(), deployment.Hardware()
_POSITIVE = click.IntRange(min=1)


@click.group("bench", cls=jsonout.UsageGroup)
def bench_group() -> None:
    """Benchmarks of the decode side, stock against patched, without a GPU."""


def _status_printer():
    show, done = progress.printer(every=15.0)

    def status(event: dict) -> None:
        show(f"{event['build']}: {event['finished']}/{event['total']} requests done, "
             f"{event['steps']} steps")

    return status, done


@bench_group.command("replay")
@pin_option("required", help="Pin whose decode side is replayed.")
@connector_option("replay", default="nixl", show_default=True,
                  help="The decode instance's connector set, in MultiConnector order "
                       "(nixl+decodebench: one upstream's gate refuses; the lmcache and "
                       "offloading sets: LMCacheMPConnector and OffloadingConnector, "
                       "vLLM 0.32 and later).")
@click.option("--prefix-len", type=_POSITIVE, default=_W.prefix_len, show_default=True)
@click.option("--suffix-len", type=_POSITIVE, default=_W.suffix_len, show_default=True)
@click.option("--num-prefixes", type=_POSITIVE, default=_W.num_prefixes, show_default=True)
@click.option("--num-prompts", type=_POSITIVE, default=_W.num_prompts, show_default=True)
@click.option("--output-len", type=_POSITIVE, default=_W.output_len, show_default=True)
@click.option("--concurrency", type=_POSITIVE, default=_W.concurrency, show_default=True)
@click.option("--seed", type=int, default=_W.seed, show_default=True)
@click.option("--exact-repeat-fraction", type=click.FloatRange(0, 1), default=_W.exact_repeat_fraction,
              show_default=True, metavar="F",
              help="Share of prompts that are an earlier prompt's first k blocks + 1 token "
                   "(the len-1 corner: all but the last token cached on D).")
@click.option("--block-size", type=_POSITIVE, default=128, show_default=True,
              help="As passed to vLLM; raised as vLLM does until a page holds a Mamba state.")
@click.option("--model-config", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="A HF config.json of a Qwen3.5-style model. [default: Qwen3.5-35B-A3B's shape]")
@click.option("--kv-blocks", type=click.IntRange(min=1), help="The decode pool in blocks.")
@click.option("--kv-gib", type=click.FloatRange(min=0, min_open=True),
              help="The decode pool in GiB. [default: derived from an H20]")
@click.option("--max-num-seqs", type=_POSITIVE, default=256, show_default=True)
@click.option("--max-num-batched-tokens", type=_POSITIVE, default=16384, show_default=True)
@click.option("--max-model-len", type=_POSITIVE, default=24576, show_default=True)
@click.option("--store-blocks", type=_POSITIVE, default=replay_mod.STORE_BLOCKS, show_default=True,
              help="The lmcache or offloading child's store, in chunks of one block "
                   "(default: about 97 GB at the default model's 23.6 MB block).")
@click.option("--speculative-config", metavar="JSON",
              help="vLLM's option, on the decode instance: '{\"method\": \"mtp\", "
                   "\"num_speculative_tokens\": N}' (MTP's lookahead slots, NIXL's prefill "
                   "back-off, the dropped last matched block, the modelled drafting cost).")
@click.option("--num-speculative-tokens", type=int, metavar="N",
              help="Shorthand: --speculative-config for MTP with N tokens (a Qwen3.5 "
                   "checkpoint's one module, reused N times).")
@click.option("--hbm-gib", type=float, default=_H.hbm_gib, show_default=True, help="GPU memory (H20: 96).")
@click.option("--gpu-memory-utilization", type=float, default=_H.gpu_memory_utilization, show_default=True)
@click.option("--activation-gib", type=float, default=_H.activation_reserve_gib, show_default=True,
              help="Memory vLLM's profiling keeps for activations.")
@click.option("--hbm-tbps", type=float, default=_H.hbm_tbps, show_default=True, help="H20: 4.0.")
@click.option("--bandwidth-efficiency", type=float, default=_H.bandwidth_efficiency, show_default=True)
@click.option("--tflops", type=float, default=_H.bf16_tflops, show_default=True, help="Dense bf16 (H20: 148).")
@click.option("--mfu", type=float, default=_H.mfu, show_default=True, help="Prefill's model FLOPs utilisation.")
@click.option("--step-overhead-ms", type=float, default=_H.step_overhead_ms, show_default=True,
              help="Per decode step (kernel launches with --enforce-eager).")
@click.option("--pull-gbps", type=float, default=_H.pull_gbps, show_default=True,
              help="NIXL's pull rate in gigabytes (not bits) per second.")
@click.option("--png", type=click.Path(dir_okay=False, path_type=Path),
              help="Write running and waiting requests over time, stock against patched.")
@click.option("--expect-hit", type=click.FloatRange(0, 1), metavar="FRACTION",
              help="Exit 1 unless the patched hit reaches FRACTION of the limit (CI: 0.99).")
@click.option("--expect-gap", is_flag=True,
              help="Exit 1 unless stock's hit is below patched's (a connector set upstream refuses).")
@jsonout.flag()
@click.pass_obj
def replay_command(state, pin, connector, png, expect_hit, expect_gap, as_json, **p) -> None:
    """Replay vllm#42524's prefix-repetition workload through the pin's real decode-side
    Scheduler (KV cache manager, coordinator, connector), stock then patched.

    Hits, pulls, blocks, running and waiting requests, preemptions and steps are
    counted from vLLM's objects; TTFT and throughput come from the printed cost model.
    """
    options = _replay_options(pin, connector, p)
    if png:
        render.require_matplotlib()
    status, done = _status_printer()
    try:
        report = replay_mod.run(state.series, options, log=progress.say, status=status)
    finally:
        done()
    if png:
        render.replay_png(report, png)
    if as_json:
        jsonout.emit(report.to_json())
    else:
        click.echo(render.replay_table(report))
        if png:
            click.echo(f"plot: {png}")
    problems = render.gate_problems(report, expect_hit, expect_gap)
    if problems:
        raise CheckFailed("; ".join(problems))


def _replay_options(pin: Pin, connector: str, p: dict) -> replay_mod.ReplayOptions:
    """The options of ``bench replay``: its workload, its hardware, the rest."""
    workload = deployment.Workload(**{k: p.pop(k) for k in (
        "prefix_len", "suffix_len", "num_prefixes", "num_prompts", "output_len",
        "concurrency", "seed", "exact_repeat_fraction")})
    hardware = deployment.Hardware(
        hbm_gib=p.pop("hbm_gib"), gpu_memory_utilization=p.pop("gpu_memory_utilization"),
        activation_reserve_gib=p.pop("activation_gib"), hbm_tbps=p.pop("hbm_tbps"),
        bandwidth_efficiency=p.pop("bandwidth_efficiency"), bf16_tflops=p.pop("tflops"),
        mfu=p.pop("mfu"), step_overhead_ms=p.pop("step_overhead_ms"), pull_gbps=p.pop("pull_gbps"))
    spec = speculative.parse(p.pop("speculative_config"), p.pop("num_speculative_tokens"))
    return replay_mod.ReplayOptions(pin, workload, hardware, connector, speculative=spec, **p)


@bench_group.command("lookup")
@pin_option("required", help="Pin whose lookup is timed.")
@connector_option("bench", default="nixl", show_default=True)
@click.option("--prompt-len", type=_POSITIVE, default=17408, show_default=True)
@click.option("--block-size", type=_POSITIVE, default=1152, show_default=True,
              help="The block vLLM uses for the default model (see bench replay).")
@click.option("--calls", type=_POSITIVE, default=2000, show_default=True, help="Lookups per sample.")
@click.option("--repeats", type=_POSITIVE, default=15, show_default=True, help="Samples per build.")
@jsonout.flag()
@click.pass_obj
def lookup_command(state, pin, connector, prompt_len, block_size, calls, repeats, as_json) -> None:
    """Time KVCacheManager.get_computed_blocks, stock against patched, on the same
    block hashes: a remote-prefill request (the decode path) and a plain request.

    Both builds stay loaded in their own process; samples alternate between them so
    drift hits both alike. Reports the patched/stock ratio's median and spread.
    """
    options = lookup.LookupOptions(pin, connector, prompt_len, block_size, calls, repeats)
    report = lookup.run(state.series, options, log=progress.say)
    if as_json:
        jsonout.emit(report.to_json())
    else:
        click.echo(lookup.table(report))
