"""``hybridpd list``."""

from __future__ import annotations

import click

from hybridpd.cli import jsonout
from hybridpd.cli.options import State, json_flag, pin_option
from hybridpd.errors import UsageError
from hybridpd.series.model import Pin, Series
from hybridpd.upstreaming.candidates import format_candidates, upstream_candidates


@click.command(name="list")
@pin_option("none", help="Only this pin.")
@click.option(
    "--upstream-candidates",
    "candidates",
    is_flag=True,
    help="Per patch: carried with no upstream release yet (a candidate to propose), "
    "or upstream since a release (and the pins it can be dropped from).",
)
@json_flag
@click.pass_obj
def list_(state: State, pin: Pin | None, candidates: bool, as_json: bool) -> None:
    """List the pins and each patch's state on them, in apply order."""
    series = state.series
    if candidates:
        if pin:
            raise UsageError("--upstream-candidates looks at every pin; drop --pin")
        found = upstream_candidates(series)
        if as_json:
            jsonout.emit({"patches": [c.to_json() for c in found]})
        else:
            for line in format_candidates(found):
                click.echo(line)
        return
    pins = [pin] if pin else list(series.pins)
    if as_json:
        jsonout.emit({"pins": [series.pin_json(pin) for pin in pins]})
        return
    for pin in pins:
        _echo_pin(series, pin)


def _echo_pin(series: Series, pin: Pin) -> None:
    click.echo(f"{pin.version}  tag {pin.tag}  sdist {pin.sdist}")
    if not pin.ported:
        click.echo("  (the series is not ported to this pin yet: hybridpd port)")
    for patch, pin_state in series.records(pin):
        since = f" (since {pin_state.release})" if pin_state.release else ""
        click.echo(f"  {pin_state.state:<9} {patch.id}{since}: {patch.title}")
        if pin_state.state == "dropped" and patch.why_dropped:
            click.echo(f"            why dropped: {patch.why_dropped}")
