"""``hybridpd pin add``."""

from __future__ import annotations

import shlex

import click

from hybridpd.cli import jsonout
from hybridpd.cli.options import State, json_flag, log
from hybridpd.porting import pinadd
from hybridpd.progress import quiet


@click.group("pin", cls=jsonout.UsageGroup)
def pin_group() -> None:
    """The releases the series is pinned to (series.toml's [[pins]])."""


@pin_group.command("add")
@click.argument("version")
@click.option("--allow-yanked", is_flag=True,
              help="Pin a release the project yanked from the index (refused otherwise).")
@json_flag
@click.pass_obj
def add(state: State, version: str, allow_yanked: bool, as_json: bool) -> None:
    """Make release VERSION a pin, so that `port` can reach it.

    Finds VERSION's sdist on the package index pip is configured for, downloads and
    hashes it, writes its [[pins]] entry in version order with `ported = false`, and
    proposes the pin to port from: the ported pin with the largest share of hunks that
    apply to VERSION as they are, among those that record no patch upstream since a
    release after VERSION. Then: `hybridpd port --from PIN --to VERSION`, `hybridpd test
    --pin VERSION`, `hybridpd check`.
    """
    added = pinadd.add_pin(state.series, version, allow_yanked, log=quiet if as_json else log)
    if as_json:
        jsonout.emit(added.to_json())
        return
    pin = added.pin
    click.echo(f"added pin {pin.version} (tag {pin.tag}, sdist {pin.sdist}, sha256 "
               f"{pin.sha256}), not ported yet")
    series = "" if state.series_arg is None else f" --series {shlex.quote(str(state.series_arg))}"
    if added.proposed is None:
        click.echo(f"next: nothing to port from ({added.reason()})")
        return
    click.echo(f"port from {added.proposed.version}: {added.reason()}")
    click.echo(f"next: hybridpd{series} port --from {added.proposed.version} --to "
               f"{pin.version}, then hybridpd{series} test --pin {pin.version} and "
               f"hybridpd{series} check")
