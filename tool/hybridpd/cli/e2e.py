"""``hybridpd e2e``: real prefill/decode runs of a hybrid model, stock beside patched.

The command parses its options into :class:`hybridpd.e2e.run.E2EOptions`, runs them
(:func:`hybridpd.e2e.run.run`) and prints the ON/OFF table. Exit codes: 0 ok, 1 a run failed or
a check failed, 2 usage, 130 interrupted.
"""

from __future__ import annotations

from pathlib import Path

import click

from hybridpd.cli import jsonout
from hybridpd.cli.options import connector_option, log, pin_option, torch_option
from hybridpd.e2e import netns as netns_mod
from hybridpd.e2e import fleet as fleet_mod
from hybridpd.e2e import pair as pair_mod
from hybridpd.e2e import reap as reap_mod
from hybridpd.e2e import report as report_mod
from hybridpd.e2e import router as router_mod
from hybridpd.e2e import run as run_mod
from hybridpd.e2e.tinymodel import ARCHITECTURES
from hybridpd.errors import CheckFailed
from hybridpd.series.model import Pin

_D = run_mod.E2EOptions(pin=None)  # the defaults

DEVICES = ("cpu", "cuda")


#: Options left out of a report's command: where output goes, and venvs given instead of
#: builds (a local path, and re-running with it would measure the same old venv; the
#: command rebuilds from the series instead). The report's ``options`` keeps them all.
_NOT_REPRODUCED = ("out_dir", "as_json", "patched_venv", "stock_venv", "reap_dir")


def reproducing_argv(ctx: click.Context) -> list[str]:
    """``hybridpd e2e`` plus every option this invocation set (on its command line or
    from the environment), so a report records the command that reproduces it."""
    from click.core import ParameterSource

    argv = ["hybridpd"]
    parent = ctx.parent
    if parent is not None and parent.params.get("series_path") is not None and (
        parent.get_parameter_source("series_path") == ParameterSource.COMMANDLINE
    ):
        argv += ["--series", str(Path(parent.params["series_path"]).absolute())]
    argv.append("e2e")
    for param in ctx.command.params:
        if not isinstance(param, click.Option) or param.name in _NOT_REPRODUCED:
            continue
        source = ctx.get_parameter_source(param.name)
        if source not in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
            continue
        value = ctx.params[param.name]
        if param.is_flag:
            if value:
                argv.append(param.opts[0])
            elif param.secondary_opts:
                argv.append(param.secondary_opts[0])
            continue
        for item in value if param.multiple else (value,):
            argv += [param.opts[0], item.version if isinstance(item, Pin) else str(item)]
    return argv


@click.command("e2e")
@pin_option("none", help="vLLM pin, e.g. 0.32.0 (required).")
@click.option("--reap", "reap_dir", metavar="DIR",
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Only end the servers a killed run into DIR (its --out) left running, "
              "and remove their shared-memory files and simulated hosts' network.")
@click.option("--device", type=click.Choice(DEVICES), default=_D.device, show_default=True)
@click.option("--model", metavar="ID_OR_PATH", help="Model to serve (GPU: Qwen/Qwen3.5-35B-A3B).")
@click.option("--tiny", is_flag=True, help="Write and serve a 4-layer random-weight Qwen3.5-architecture model.")
@click.option(
    "--tiny-arch",
    type=click.Choice(["auto", *sorted(ARCHITECTURES)]),
    default=_D.tiny_arch,
    show_default=True,
    help="auto: qwen3_5 where the venv imports vLLM's Qwen3.5 module, else its text-decoder "
    "twin qwen3_next (see hybridpd.e2e.tinymodel.ARCHITECTURES).",
)
@connector_option("e2e", "connectors", multiple=True,
                  help="Decode instance's connector set; repeat to run several. "
                       "[default: nixl]")
@click.option("--role", type=click.Choice(pair_mod.ROLES), default=_D.role, show_default=True,
              help="kv_both on both instances, or P kv_producer / D kv_consumer.")
@click.option("--front", type=click.Choice(router_mod.FRONTS), default=_D.front,
              show_default=True,
              help="What PD requests go through: vLLM's router (vllm-router "
              f"{router_mod.VERSION}, installed into the e2e venvs) or hybridpd's proxy. "
              "correctness sends its concurrent requests' two steps itself either way.")
@click.option("--hosts", type=click.Choice(netns_mod.HOSTS), default=_D.hosts,
              show_default=True,
              help="one: every process on this host. netns (root): prefill and decode each "
              "on a simulated host (network, IPC and mount namespaces of its own, joined by "
              "a bridge the run makes), NIXL's KV over UCX TCP on that link, checked in "
              "UCX's log.")
@click.option("--scenario", type=click.Choice(run_mod.SCENARIOS), default=_D.scenario, show_default=True)
@click.option("--compare", type=click.Choice(["stock"]), help="Also run the stock build (OFF column).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Output directory. [default: e2e-<pin>-<device>-<time>]")
@click.option("--patched-venv", type=click.Path(file_okay=False, path_type=Path),
              help="Use this venv as the patched build instead of checkout+apply+build.")
@click.option("--stock-venv", type=click.Path(file_okay=False, path_type=Path),
              help="Use this venv as the stock build instead of checkout+build.")
@click.option("--stock-only", is_flag=True, help="Run only the stock build (no patched run).")
@torch_option(help="torch requirement for builds.")
@click.option("--block-size", type=int, default=_D.block_size, show_default=True)
@click.option("--max-model-len", type=int,
              help="[default: 4096; with a shrunken decode pool (--decode-num-blocks, "
              "correctness) the longest request the pool holds: 1152 for correctness]")
@click.option("--decode-prefix-caching/--no-decode-prefix-caching",
              default=_D.decode_prefix_caching, show_default=True,
              help="vllm#42524's D toggle (P always caches).")
@click.option("--prompt-tokens", type=int, default=_D.prompt_tokens, show_default=True, help="smoke: prompt A length.")
@click.option("--shared-tokens", type=int, default=_D.shared_tokens, show_default=True,
              help="smoke: tokens prompt B shares with A.")
@click.option("--max-tokens", type=int, default=_D.max_tokens, show_default=True, help="smoke: tokens generated.")
@click.option("--baseline-tokens", type=int, default=_D.baseline_tokens, show_default=True,
              help="smoke: leading tokens that must equal a single-instance run.")
@click.option("--prefix-len", type=int, default=_D.prefix_len, show_default=True, help="prefix-repetition.")
@click.option("--suffix-len", type=int, default=_D.suffix_len, show_default=True, help="prefix-repetition.")
@click.option("--num-prefixes", type=int, default=_D.num_prefixes, show_default=True, help="prefix-repetition.")
@click.option("--output-len", type=int, default=_D.output_len, show_default=True, help="prefix-repetition.")
@click.option("--num-prompts", type=int, default=_D.num_prompts, show_default=True, help="prefix-repetition.")
@click.option("--concurrency", type=int, default=_D.concurrency, show_default=True, help="prefix-repetition.")
@click.option("--decode-num-blocks", type=int, metavar="N",
              help="The decode instance's KV pool in blocks (--num-gpu-blocks-override); "
              "correctness: small enough to preempt; fleet: each decode instance's, "
              "too small for every prefix. [default: correctness 16, fleet the prefixes "
              "of an even share of the fleet and one request, else from memory]")
@click.option("--decode-instances", type=int, default=_D.decode_instances, show_default=True,
              help="fleet: decode instances behind the router.")
@click.option("--policy", "policies", multiple=True, metavar="POLICY",
              type=click.Choice(router_mod.DECODE_POLICIES), default=_D.policies,
              help="fleet: vllm-router's --decode-policy to measure; repeat for several, "
              "each on the same fleet. [default: "
              f"{' '.join(fleet_mod.DEFAULT_POLICIES)}]")
@click.option("--gpus", default=_D.gpus, show_default=True,
              help="cuda: GPU of P, GPU of D; one id: P and D share that GPU, each with "
              "half of --gpu-memory-utilization.")
@click.option("--gpu-memory-utilization", type=float, default=_D.gpu_memory_utilization, show_default=True)
@click.option("--server-arg", "server_args", multiple=True, metavar="ARG",
              help="Extra argument for both servers (repeatable).")
@click.option("--ready-timeout", type=float, default=_D.ready_timeout, show_default=True, help="Seconds.")
@click.option("--seed", type=int, default=_D.seed, show_default=True)
@click.option("--speculative-config", metavar="JSON",
              help="vLLM's --speculative-config for both instances (P is also the "
              "single-instance reference); with --tiny, '{\"method\":\"mtp\","
              "\"num_speculative_tokens\":N}' serves the tiny model with its MTP module.")
@click.option("--lmcache-without", "lmcache_without", multiple=True, metavar="PATCH_ID",
              help="LMCache sets: build lmcache from the LMCache series without this patch "
              "(repeatable; a gate that must go red).")
@click.option("--fail-fast", is_flag=True,
              help="correctness: stop at the first output that differs from the "
              "single-instance reference (no concurrent requests, no teacher-forced "
              "scoring); for a gate that must go red.")
@click.option("--expect-patched-hit", is_flag=True,
              help="Exit 1 unless every patched run gives the decode instance a local hit "
              "on the shared-prefix request and all outputs match (the CI gate).")
@click.option("--dry-run", is_flag=True,
              help="Print the server command lines of every pair (P, then D), start nothing.")
@jsonout.flag(help="Print report.json instead of the table.")
@click.pass_obj
def e2e_command(state, as_json, reap_dir, dry_run, **params):
    """Serve a hybrid model with 1 prefill + 1 decode vLLM instance and measure the
    decode side's prefix cache, patched (ON) against stock (OFF).

    Each (build, connector) gets a fresh server pair and front (vllm-router); logs, report.json,
    report.md and report.png go to --out. A process that dies or never gets ready
    ends the command with its name and log; every process started is reaped.

    \b
    CPU CI gate (red on stock, green on patched):
      hybridpd e2e --pin 0.32.0 --device cpu --tiny --scenario smoke \\
        --connector nixl --connector nixl+decodebench --compare stock --expect-patched-hit

    --scenario fleet serves 1 prefill and --decode-instances decode instances instead,
    with a router per --policy over them (docs/fleet.md).

    A run killed with SIGKILL leaves its servers running; the next run (into any
    --out), or `hybridpd e2e --reap DIR`, ends them (by process group, after checking
    each recorded process's start time).
    """
    if reap_dir is not None:
        _reap(reap_dir, as_json)
        return
    if params["pin"] is None:
        raise click.MissingParameter(param_hint="'--pin'", param_type="option")
    options = run_mod.E2EOptions(**params)
    if dry_run:
        return click.echo("\n".join(run_mod.dry_run(state.series, options, log)))
    result = run_mod.run(state.series, options, reproducing_argv(click.get_current_context()), log)
    if as_json:
        jsonout.emit(result.report.to_json())
    else:
        click.echo("\n".join(report_mod.table(result.report)))
        click.echo("")
        for name, path in result.paths.items():
            click.echo(f"{name}: {path}")
    if result.failures:
        for f in result.failures:
            click.echo(f"FAILED: {f}", err=True)
        raise CheckFailed(f"{len(result.failures)} check(s) failed; see {result.paths['md']}")


def _reap(directory: Path, as_json: bool) -> None:
    reaped = reap_mod.reap(directory)
    if as_json:
        jsonout.emit({"reaped": [r.to_json() for r in reaped]})
        return
    for r in reaped:
        click.echo(r.line())
    if not reaped:
        click.echo(f"{directory}: nothing to reap (no record of running processes)")
