"""``hybridpd install`` and ``hybridpd build``: a patched vLLM in a virtualenv."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from hybridpd.cli import jsonout
from hybridpd.cli.options import (
    State,
    checkout_dir,
    dir_option,
    json_flag,
    log,
    pin_option,
    torch_option,
    variant_option,
)
from hybridpd.envs import build as build_mod
from hybridpd.envs import install as install_mod
from hybridpd.envs import wheelhouse as wheelhouse_mod
from hybridpd.errors import UsageError
from hybridpd.progress import quiet
from hybridpd.series.apply import checkout_pin
from hybridpd.series.checkout import SOURCES, Source
from hybridpd.series.model import Pin


@click.command()
@pin_option(
    "none",
    help="Pin (default: the default pin; for a CPU build, the newest pin whose CPU "
    "build serves here).",
)
@dir_option(help="Checkout to create or reuse. [default: vllm-<pin>]")
@click.option(
    "--venv",
    type=click.Path(file_okay=False, path_type=Path),
    help="Virtualenv to create or update. [default: venv-<pin>]",
)
@variant_option
@click.option(
    "--source",
    type=click.Choice(SOURCES),
    default="sdist",
    show_default=True,
    help="Where the release source comes from (see `hybridpd checkout`).",
)
@torch_option()
@click.option(
    "--wheelhouse",
    type=click.Path(file_okay=False, path_type=Path),
    help="Install offline from this bundle (made by `hybridpd bundle`) instead: no "
    "checkout, no package index.",
)
@click.option(
    "--python",
    "python",
    metavar="PATH",
    help="With --wheelhouse: the host interpreter the venv is made from (it has what "
    "the bundle reuses). [default: this one]",
)
@json_flag
@click.pass_obj
def install(
    state: State,
    pin: Pin | None,
    repo: Path | None,
    venv: Path | None,
    variant: str,
    source: Source,
    torch_spec: str | None,
    wheelhouse: Path | None, python: str | None,
    as_json: bool,
) -> None:
    """Check out a pin, apply its series and build a patched vLLM, in one step.

    Runs `checkout`, `apply` and `build`; an existing checkout of the same pin is
    reused. Prints how to use the result. With --wheelhouse DIR: installs a bundle
    offline and proves it (the patched files, vllm and nixl._api import).
    """
    if wheelhouse or python:
        return _install_wheelhouse(wheelhouse, venv, python, as_json, pin, repo, torch_spec)
    result = install_mod.install(
        state.series, pin, repo, venv, variant=variant, source=source, torch=torch_spec,
        log=log,
    )
    if as_json:
        jsonout.emit(result.to_json())
        return
    built = result.build.version
    click.echo(f"checkout {result.checkout}: {built} with the series applied")
    _echo_build(result.build, result.venv)
    if result.cannot_serve is None:
        click.echo(f"  {_pd_pair_command(built, result.build.variant, result.venv)}")
    else:
        click.echo(
            f"  this venv cannot serve a PD pair here: {result.cannot_serve} (hybridpd doctor)"
        )


def _install_wheelhouse(
    bundle: Path | None, venv: Path | None, python: str | None, as_json: bool,
    pin: Pin | None, repo: Path | None, torch_spec: str | None,
) -> None:
    if bundle is None:
        raise UsageError("--python goes with --wheelhouse")
    given = [o for o, v in (("--pin", pin), ("--dir", repo), ("--torch", torch_spec)) if v]
    if given:
        raise UsageError(f"--wheelhouse installs what the bundle holds: drop {', '.join(given)}")
    manifest = wheelhouse_mod.load(bundle)
    venv = venv or Path(f"venv-{manifest['pin']}")
    result = wheelhouse_mod.install(bundle, venv, python=python,
                                    log=quiet if as_json else log)
    if as_json:
        jsonout.emit(result.to_json())
        return
    for line in result.warnings:
        log(f"warning: {line}")
    click.echo(f"installed {manifest['distribution']} {manifest['pin']} ({manifest['variant']}) "
               f"offline from {bundle} in {venv}")
    click.echo(f"  {len(result.overlaid)} patched file(s) in place and imported; nixl._api "
               f"imports; compiled ops: {result.proof.get('compiled_ops')}")


def _pd_pair_command(release: str, variant: str, venv: Path) -> str:
    """The command that starts a PD pair from ``venv``, with this hybridpd's path (the
    venv activated above has no hybridpd)."""
    entry = Path(sys.argv[0])
    hpd = str(entry.absolute()) if entry.name == "hybridpd" else "hybridpd"
    device = "cpu" if variant == "cpu" else "cuda --gpus 0,1"
    return (f"{shlex.quote(hpd)} e2e --pin {release} --device {device} --tiny --patched-venv "
            f"{shlex.quote(str(venv.absolute()))}   # a PD pair (1 prefill + 1 decode "
            "instance), tiny model")


def _echo_build(result: build_mod.BuildResult, venv: Path) -> None:
    for line in result.warnings:
        log(f"warning: {line}")
    click.echo(f"built {result.distribution} {result.version} ({result.variant}) in {venv}")
    click.echo(f"  overlaid {len(result.overlaid)} patched file(s) from {result.head[:12]}")
    for line in result.usage:
        click.echo(f"  {line}")


@click.command()
@checkout_dir
@click.option(
    "--venv",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Virtualenv to create or update.",
)
@variant_option
@torch_option()
@json_flag
@click.pass_obj
def build(
    state: State,
    repo: Path,
    venv: Path,
    variant: str,
    torch_spec: str | None,
    as_json: bool,
) -> None:
    """Install the patched checkout into a virtualenv.

    The compiled binaries come from the same release's published wheel, whose
    Python files are first proven identical to the stock sdist; then the files the
    patch commits change are written over it. Prints how to use the result.
    """
    pin = checkout_pin(state.series, repo)
    result = build_mod.build(
        repo, venv, pin, install_mod.resolve_variant(variant), torch=torch_spec
    )
    if as_json:
        jsonout.emit(result.to_json())
    else:
        _echo_build(result, venv)
