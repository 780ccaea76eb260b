"""``hybridpd e2e``: real prefill/decode runs of a hybrid model, stock beside patched.

The command parses, prepares the environments (:mod:`.envs`), runs each
(build, connector) pair in turn (:mod:`.scenarios`, one pair of servers at a time),
writes the report (:mod:`.report`) and prints the ON/OFF table. Exit codes: 0 ok,
1 a run failed or a check failed, 2 usage.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from hybridpd import cache, jsonout, proc, progress
from hybridpd.errors import CheckFailed, Interrupted

from . import report as report_mod
from . import scenarios as sc
from .envs import Env, given, preflight, prepare, probe
from .servers import E2EError, Processes
from .tinymodel import ARCHITECTURES, spec_id

DEVICES = ("cpu", "cuda")


#: Options left out of a report's command: where output goes, and venvs given instead of
#: builds (a local path, and re-running with it would measure the same old venv; the
#: command rebuilds from the series instead). The report's ``options`` keeps them all.
_NOT_REPRODUCED = ("out_dir", "as_json", "patched_venv", "stock_venv")


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
            argv += [param.opts[0], str(item)]
    return argv


def _log(msg: str) -> None:
    click.echo(msg, err=True)


def tiny_model(env: Env, arch: str, seed: int, cache: Path, process_env: dict,
               variant: str = "default") -> Path:
    """The tiny model for ``arch``/``seed``/``variant``, written once under ``cache``."""
    import shutil

    dest = cache / f"tiny-{arch}-{spec_id(seed, arch, variant)}"
    if (dest / "hybridpd-tiny.json").exists():
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    done = proc.run(
        [env.python, Path(__file__).with_name("tinymodel.py"), tmp,
         "--seed", str(seed), "--arch", arch, "--variant", variant],
        env=process_env,
    )
    if not done.ok:
        shutil.rmtree(tmp, ignore_errors=True)
        raise E2EError(f"could not write the tiny model: {done.tail()}")
    tmp.rename(dest)
    return dest


@click.command("e2e")
@click.option("--pin", "version", required=True, metavar="VERSION", help="vLLM pin, e.g. 0.32.0.")
@click.option("--device", type=click.Choice(DEVICES), default="cpu", show_default=True)
@click.option("--model", metavar="ID_OR_PATH", help="Model to serve (GPU: Qwen/Qwen3.5-35B-A3B).")
@click.option("--tiny", is_flag=True, help="Write and serve a 4-layer random-weight Qwen3.5-architecture model.")
@click.option(
    "--tiny-arch",
    type=click.Choice(["auto", *sorted(ARCHITECTURES)]),
    default="auto",
    show_default=True,
    help="auto: qwen3_5 where the venv imports vLLM's Qwen3.5 module, else its text-decoder "
    "twin qwen3_next (see hybridpd.e2e.tinymodel.ARCHITECTURES).",
)
@click.option(
    "--connector",
    "connectors",
    type=click.Choice(list(sc.CONNECTORS)),
    multiple=True,
    help="Decode instance's connector set; repeat to run several. [default: nixl]",
)
@click.option("--role", type=click.Choice(sc.ROLES), default="kv_both", show_default=True,
              help="kv_both on both instances, or P kv_producer / D kv_consumer.")
@click.option("--scenario", type=click.Choice(sc.SCENARIOS), default="smoke", show_default=True)
@click.option("--compare", type=click.Choice(["stock"]), help="Also run the stock build (OFF column).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Output directory. [default: e2e-<pin>-<device>-<time>]")
@click.option("--patched-venv", type=click.Path(file_okay=False, path_type=Path),
              help="Use this venv as the patched build instead of checkout+apply+build.")
@click.option("--stock-venv", type=click.Path(file_okay=False, path_type=Path),
              help="Use this venv as the stock build instead of checkout+build.")
@click.option("--stock-only", is_flag=True, help="Run only the stock build (no patched run).")
@click.option("--torch", "torch_spec", metavar="SPEC", help="torch requirement for builds.")
@click.option("--block-size", type=int, default=128, show_default=True)
@click.option("--max-model-len", type=int, default=4096, show_default=True)
@click.option("--decode-prefix-caching/--no-decode-prefix-caching", default=True, show_default=True,
              help="The seed's D toggle (P always caches).")
@click.option("--prompt-tokens", type=int, default=1400, show_default=True, help="smoke: prompt A length.")
@click.option("--shared-tokens", type=int, default=1300, show_default=True,
              help="smoke: tokens prompt B shares with A.")
@click.option("--max-tokens", type=int, default=16, show_default=True, help="smoke: tokens generated.")
@click.option("--baseline-tokens", type=int, default=4, show_default=True,
              help="smoke: leading tokens that must equal a single-instance run.")
@click.option("--prefix-len", type=int, default=1024, show_default=True, help="prefix-repetition.")
@click.option("--suffix-len", type=int, default=128, show_default=True, help="prefix-repetition.")
@click.option("--num-prefixes", type=int, default=2, show_default=True, help="prefix-repetition.")
@click.option("--output-len", type=int, default=16, show_default=True, help="prefix-repetition.")
@click.option("--num-prompts", type=int, default=16, show_default=True, help="prefix-repetition.")
@click.option("--concurrency", type=int, default=4, show_default=True, help="prefix-repetition.")
@click.option("--decode-num-blocks", type=int, metavar="N",
              help="The decode instance's KV pool in blocks (--num-gpu-blocks-override); "
              "correctness: small enough to preempt. [default: correctness 16, else from memory]")
@click.option("--gpus", default="0,1", show_default=True, help="cuda: GPU of P, GPU of D.")
@click.option("--gpu-memory-utilization", type=float, default=0.85, show_default=True)
@click.option("--server-arg", "server_args", multiple=True, metavar="ARG",
              help="Extra argument for both servers (repeatable).")
@click.option("--ready-timeout", type=float, default=900, show_default=True, help="Seconds.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--expect-patched-hit", is_flag=True,
              help="Exit 1 unless every patched run gives the decode instance a local hit "
              "on the shared-prefix request and all outputs match (the CI gate).")
@jsonout.flag(help="Print report.json instead of the table.")
@click.pass_obj
def e2e_command(state, version, device, model, tiny, tiny_arch, connectors, role, scenario,
                compare, out_dir, patched_venv, stock_venv, stock_only, torch_spec, block_size,
                max_model_len, decode_prefix_caching, prompt_tokens, shared_tokens, max_tokens,
                baseline_tokens, prefix_len, suffix_len, num_prefixes, output_len, num_prompts,
                concurrency, decode_num_blocks, gpus, gpu_memory_utilization, server_args,
                ready_timeout, seed, expect_patched_hit, as_json):
    """Serve a hybrid model with 1 prefill + 1 decode vLLM instance and measure the
    decode side's prefix cache, patched (ON) against stock (OFF).

    Each (build, connector) gets a fresh server pair and proxy; logs, report.json,
    report.md and report.png go to --out. A process that dies or never gets ready
    ends the command with its name and log; every process started is reaped.

    \b
    CPU CI gate (red on stock, green on patched):
      hybridpd e2e --pin 0.32.0 --device cpu --tiny --scenario smoke \\
        --connector nixl --connector nixl+decodebench --compare stock --expect-patched-hit
    """
    if bool(model) == bool(tiny):
        raise click.UsageError("give exactly one of --model and --tiny")
    if device == "cpu" and not tiny and not Path(model).exists():
        _log("warning: on CPU a model hub is usually unreachable; --model should be a local path")
    connectors = list(connectors) or ["nixl"]
    if device == "cpu":
        bad = [c for c in connectors if c in sc.GPU_ONLY_CONNECTORS]
        if bad:
            raise click.UsageError(
                f"{', '.join(bad)} do not start on a CPU engine; on CPU use nixl+decodebench"
            )
    gpu_pair = tuple(g.strip() for g in gpus.split(","))
    if len(gpu_pair) != 2:
        raise click.UsageError("--gpus takes two GPU ids: P,D")
    builds = ["stock"] if stock_only else (["patched", "stock"] if compare else ["patched"])

    series = state.series
    pin = series.pin(version)
    # Before any checkout, build or output: can this host run it at all?
    builds_here = any((patched_venv if b == "patched" else stock_venv) is None for b in builds)
    preflight(
        pin.version, device, gpu_pair, needs_wheel=builds_here,
        sdist=lambda: cache.sdist(series.package, pin.sdist, pin.sha256),
    )
    out_dir = out_dir or Path(f"e2e-{pin.version}-{device}-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    out_dir = out_dir.resolve()
    t_start = time.monotonic()

    # Environments first: a build failure should not cost a server start.
    envs: dict[str, Env] = {}
    for build in builds:
        override = patched_venv if build == "patched" else stock_venv
        envs[build] = given(override, build) if override else prepare(
            series, pin.version, build, device, _log, torch=torch_spec
        )
    opts = sc.ServerOptions(
        device=device, block_size=block_size, max_model_len=max_model_len,
        decode_prefix_caching=decode_prefix_caching, gpus=gpu_pair,
        gpu_memory_utilization=gpu_memory_utilization, extra_args=tuple(server_args),
        ready_timeout=ready_timeout,
        decode_num_blocks=(
            decode_num_blocks if decode_num_blocks is not None
            else (16 if scenario == "correctness" else None)
        ),
    )
    first = envs[builds[0]]
    process_env = sc.server_env(opts, "P", 0)
    caps = {b: probe(e, process_env, device) for b, e in envs.items()}
    for b, c in caps.items():
        _log(f"[{b}] compiled ops: {c['kernels']['module']} ({c['kernels']['status']})")
        if c["kernels"]["status"] != "ok":
            raise E2EError(
                f"[{b}] vLLM's compiled ops ({c['kernels']['module']}) do not load in"
                f" {envs[b].venv}: {c['kernels']['status']}"
            )
        if c["nixl"] != "ok":
            raise E2EError(f"[{b}] NixlConnector cannot load nixl in {envs[b].venv}: {c['nixl']}")
    notes = []
    vocab = None
    if tiny:
        arch = tiny_arch
        if arch == "auto":
            arch = "qwen3_5" if all(c["qwen3_5"] == "ok" for c in caps.values()) else "qwen3_next"
            if arch != "qwen3_5":
                why = next(c["qwen3_5"] for c in caps.values() if c["qwen3_5"] != "ok")
                notes.append(
                    "tiny model: Qwen3NextForCausalLM stands in for Qwen3_5ForCausalLM "
                    f"(same Gated-DeltaNet + gated attention decoder layers) because vLLM's "
                    f"Qwen3.5 module does not import in this venv: {why}"
                )
                _log(f"note: {notes[-1]}")
        from hybridpd.cache import cache_dir

        # correctness compares outputs: its model's tokens must depend on the Mamba state.
        variant = "state-sensitive" if scenario == "correctness" else "default"
        model_path = tiny_model(first, arch, seed, cache_dir() / "e2e" / "models", process_env,
                                variant)
        manifest = json.loads((model_path / "hybridpd-tiny.json").read_text())
        vocab = manifest["vocab_size"]
        model = str(model_path)
        _log(f"tiny model {manifest['architectures'][0]} ({manifest['parameters']:,} parameters) at {model}")
    elif scenario in ("smoke", "correctness"):
        vocab = _vocab_size(model)

    report = {
        "command": reproducing_argv(click.get_current_context()),
        "options": {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
                    for k, v in click.get_current_context().params.items()},
        "pin": pin.version,
        "device": device,
        "model": model,
        "scenario": scenario,
        "role": role,
        "environments": {b: e.to_json() for b, e in envs.items()},
        "capabilities": caps,
        "server_options": {
            "block_size": block_size, "max_model_len": max_model_len,
            "decode_prefix_caching": decode_prefix_caching, "extra_args": list(server_args),
        },
        "runs": [],
        "notes": notes,
        "timings_s": {},
    }
    failures: list[str] = []
    show, done = progress.printer()
    for build in builds:
        env = envs[build]
        for connector in connectors:
            tag = f"{build}-{connector}"
            run_dir = out_dir / tag
            _log(f"== {build} / {connector}: starting prefill, decode and proxy (logs: {run_dir})")
            t0 = time.monotonic()
            try:
                with Processes(run_dir) as procs:
                    try:
                        pair = sc.start_pair(procs, env, model, connector, role, opts, show)
                        done()
                        _log(f"   ready: {pair.ready_s}")
                        t1 = time.monotonic()
                        if scenario == "smoke":
                            result = sc.run_smoke(
                                pair, procs, vocab,
                                sc.SmokeOptions(prompt_tokens, shared_tokens, max_tokens,
                                                baseline_tokens, seed),
                                _log,
                            )
                        elif scenario == "correctness":
                            result = sc.run_correctness(
                                pair, procs, vocab,
                                sc.CorrectnessOptions(block_size=block_size,
                                                      max_tokens=max_tokens, seed=seed),
                                _log,
                            )
                        else:
                            result = sc.run_prefix_repetition(
                                pair, procs, env, model,
                                sc.BenchOptions(prefix_len, suffix_len, num_prefixes, output_len,
                                                num_prompts, concurrency, seed),
                                run_dir, _log,
                            )
                        t2 = time.monotonic()
                    except E2EError:
                        # Whatever broke, a server that died is the explanation to report.
                        procs.check_soon()
                        raise
                left = procs.leftovers()
                if left:
                    raise E2EError(f"processes left running after the run: {left}")
            except (E2EError, KeyboardInterrupt) as exc:
                done()
                report["runs"].append({"build": build, "connector": connector, "error": str(exc),
                                       "logs": str(run_dir), "requests": [],
                                       "decode_prefix_cache_hits": None,
                                       "decode_prefix_cache_queries": None,
                                       "outputs_match_baseline": None})
                report_mod.write(report, out_dir, None)
                if isinstance(exc, KeyboardInterrupt):
                    raise Interrupted(f"interrupted; logs kept in {run_dir}") from None
                raise E2EError(f"{build} / {connector}: {exc}") from None
            run = {"build": build, "connector": connector, **result,
                   "ready_s": pair.ready_s, "scenario_s": round(t2 - t1, 1),
                   "total_s": round(time.monotonic() - t0, 1), "logs": str(run_dir),
                   "server_commands": pair.commands}
            report["runs"].append(run)
            failures += _failures(run, scenario, expect_patched_hit, version)
    report["timings_s"]["total"] = round(time.monotonic() - t_start, 1)
    paths = report_mod.write(report, out_dir, first.python)
    if as_json:
        jsonout.emit(report)
    else:
        click.echo("\n".join(report_mod.table(report)))
        click.echo("")
        for name, path in paths.items():
            click.echo(f"{name}: {path}")
    if failures:
        for f in failures:
            click.echo(f"FAILED: {f}", err=True)
        raise CheckFailed(f"{len(failures)} check(s) failed; see {paths['md']}")


#: Connector sets for which stock vLLM (v0.24+) already keeps the decode-side hit.
UPSTREAM_CAPABLE_CONNECTORS = frozenset({"nixl"})


def _has_upstream_gate(pin: str) -> bool:
    """Whether stock ``pin`` keeps the decode-side hit for capable connectors (v0.24+)."""
    major, minor = (int(part) for part in pin.removeprefix("v").split(".")[:2])
    return (major, minor) >= (0, 24)


def _failures(run: dict, scenario: str, expect_patched_hit: bool, pin: str) -> list[str]:
    """Checks that fail the command: outputs always; the hit only with the gate flag
    (patched must hit; on pins with upstream's capability gate (v0.24+), stock must
    hit exactly for the connector sets upstream handles)."""
    where = f"{run['build']} / {run['connector']}"
    if scenario == "correctness":
        return _correctness_failures(run, where, expect_patched_hit)
    if scenario != "smoke":
        return []
    out = []
    checks = run.get("checks", {})
    if not checks.get("warm_equals_cold_decode", True):
        out.append(f"{where}: the decode output with a local prefix hit differs from a cold decode instance's")
    if not checks.get("first_tokens_equal_single_instance", True):
        out.append(f"{where}: the first tokens differ from a single-instance run")
    if not checks.get("upstream_outputs_equal", True):
        out.append(f"{where}: the same prompt twice gave different outputs")
    if not expect_patched_hit:
        return out
    hit = checks.get("decode_local_hit")
    if run["build"] == "patched" and not hit:
        out.append(f"{where}: the decode instance took no local prefix hit for the shared-prefix request")
    if run["build"] == "stock" and _has_upstream_gate(pin):
        # Upstream keeps the hit exactly when every connector declares
        # supports_divergent_local_hybrid_hits (NIXL alone does): stock must
        # show that, or the gate proves nothing.
        capable = run["connector"] in UPSTREAM_CAPABLE_CONNECTORS
        if capable and not hit:
            out.append(f"{where}: stock lost the decode-side hit that upstream keeps for this connector")
        if not capable and hit:
            out.append(f"{where}: stock already keeps the decode-side hit, so the gate proves nothing")
    return out


def _correctness_failures(run: dict, where: str, expect_patched_hit: bool) -> list[str]:
    checks = run.get("checks", {})
    out = [
        f"{where}: {r['label']} differs from the single-instance reference: {r['note']}"
        for r in run.get("requests", []) if not r["equal"]
    ]
    if not checks.get("preemption_forced", True):
        out.append(f"{where}: no preemption on the decode instance (the pool is too large)")
    if expect_patched_hit and run["build"] == "patched" and not checks.get("decode_local_hit"):
        out.append(f"{where}: the decode instance took no local prefix hit for request B")
    return out


def _vocab_size(model: str) -> int:
    cfg = Path(model) / "config.json"
    if cfg.exists():
        data = json.loads(cfg.read_text())
        data = data.get("text_config", data)
        return int(data["vocab_size"])
    return 32000  # token ids below any real model's vocabulary
