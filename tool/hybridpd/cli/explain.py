"""``hybridpd explain``."""

from __future__ import annotations

import click

from hybridpd import connectors, speculative
from hybridpd.errors import UsageError
from hybridpd.cli import jsonout
from hybridpd.cli.options import State, connector_option, json_flag, log, pin_option
from hybridpd.explain import render, runner
from hybridpd.progress import quiet
from hybridpd.series.model import Pin


@click.command("explain")
@pin_option("required", help="The pinned vLLM release (e.g. 0.32.0).")
@click.option("--model", required=True,
              help="The model's config directory, or its hub id in your HF cache "
                   "(never downloaded; no weights are read).")
@connector_option("explain", help="A named KV connector set of the decode instance.")
@click.option("--kv-transfer-config", "kv_json",
              help="vLLM's --kv-transfer-config JSON (or @FILE), instead of --connector.")
@click.option("--kv-role", default="kv_both", show_default=True,
              type=click.Choice(["kv_both", "kv_consumer", "kv_producer"]),
              help="The role --connector's connectors take (--kv-transfer-config "
                   "names its own).")
@click.option("--block-size", type=int, help="vLLM's --block-size.")
@click.option("--mamba-cache-mode", type=click.Choice(["none", "align", "all"]),
              help="vLLM's --mamba-cache-mode.")
@click.option("--max-num-batched-tokens", type=int, help="vLLM's --max-num-batched-tokens.")
@click.option("--no-prefix-caching", is_flag=True, help="vLLM's --no-enable-prefix-caching.")
@click.option("--disable-hybrid-kv-cache-manager", is_flag=True,
              help="vLLM's --disable-hybrid-kv-cache-manager.")
@click.option("--max-model-len", type=int, default=8192, show_default=True,
              help="vLLM's --max-model-len (vLLM's own default is the model's length).")
@click.option("--tensor-parallel-size", type=click.IntRange(min=1), default=1,
              show_default=True,
              help="vLLM's --tensor-parallel-size: the KV cache groups and the pool are "
                   "one rank's, as each GPU holds them.")
@click.option("--num-speculative-tokens", type=int, default=0, show_default=True,
              help="vLLM's speculative decoding tokens: matched against the known risks "
                   "(question 5) only; --speculative-config builds the engine with it.")
@click.option("--speculative-config", "spec_json", metavar="JSON",
              help="vLLM's --speculative-config (e.g. '{\"method\": \"mtp\", "
                   "\"num_speculative_tokens\": 3}'): the engine, its KV cache groups and "
                   "its scheduler are built with it (lookahead slots, prefill lookahead, "
                   "NIXL's back-off, the dropped last matched block), and the decode-side "
                   "hit is measured on that scheduler.")
@click.option("--lmcache-version",
              help="The LMCache release the deployment runs, for the LMCache series' fix "
                   "states (question 5; default: that series' default pin).")
@click.option("--kv-cache-gib", type=float, default=16.0, show_default=True,
              help="KV cache memory the engine core sizes the pool in (too little for "
                   "--max-model-len is vLLM's refusal, as on a GPU).")
@click.option("--timeout", type=float, default=300.0, show_default=True,
              help="Seconds each side may take.")
@json_flag
@click.pass_obj
def explain(state: State, pin: Pin, model: str, connector: str | None,
            kv_json: str | None, kv_role: str, as_json: bool, **flags) -> None:
    """Whether MODEL with a KV connector set starts on vLLM PIN, and how vLLM lays out
    its hybrid KV cache: answered by vLLM's own code (config checks, the model's
    layers built on the meta device, the engine core's KV cache sizing, the scheduler
    and its connector, which requests keep a decode-side prefix hit and with which
    Mamba state, measured on that scheduler) in the pin's test environment, for the
    stock release and with the series, side by side; then the known correctness risks
    the series' records match. No weights, no GPU.
    """
    kv = connectors.kv_transfer_config(connector, kv_json, kv_role)
    spec_json = flags.pop("spec_json")
    if spec_json is not None and flags["num_speculative_tokens"]:
        raise UsageError("give --speculative-config or --num-speculative-tokens, not both")
    opts = runner.ExplainOptions(
        model=model, kv_transfer_config=kv, block_size=flags["block_size"],
        mamba_cache_mode=flags["mamba_cache_mode"],
        max_num_batched_tokens=flags["max_num_batched_tokens"],
        enable_prefix_caching=not flags["no_prefix_caching"],
        disable_hybrid_kv_cache_manager=flags["disable_hybrid_kv_cache_manager"],
        max_model_len=flags["max_model_len"], kv_cache_gib=flags["kv_cache_gib"],
        tensor_parallel_size=flags["tensor_parallel_size"],
        num_speculative_tokens=flags["num_speculative_tokens"],
        speculative_config=speculative.load(spec_json) if spec_json is not None else None,
        lmcache_version=flags["lmcache_version"],
        timeout=flags["timeout"])
    result = runner.explain(state.series, pin, opts, log=quiet if as_json else log)
    if as_json:
        jsonout.emit(result.to_json())
    else:
        for line in render.lines(result):
            click.echo(line)
    result.require_answers()
