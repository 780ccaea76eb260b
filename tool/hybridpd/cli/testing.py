"""``hybridpd test``."""

from __future__ import annotations

import click

from hybridpd.cli import jsonout
from hybridpd.cli.options import State, json_flag, log, pin_option, torch_option
from hybridpd.errors import CheckFailed
from hybridpd.proof import testrun
from hybridpd.series.model import Pin


@click.command()
@pin_option("default", help="Pin to test (default: the default pin).")
@click.option(
    "--suite",
    type=click.Choice(testrun.SUITES),
    default="all",
    show_default=True,
    help="patches: the red->green patch tests; upstream: vLLM's own tests of the "
    "touched modules, stock vs patched; all: both.",
)
@click.option(
    "--full-upstream",
    is_flag=True,
    help="Run vLLM's whole upstream selection instead of the reduced one.",
)
@click.option(
    "--stock-baseline",
    is_flag=True,
    help="Compare the patched upstream run with the committed stock baseline "
    "instead of running stock again.",
)
@torch_option(help="torch requirement for the test env.")
@json_flag
@click.pass_obj
def test(
    state: State,
    pin: Pin,
    suite: str,
    full_upstream: bool,
    stock_baseline: bool,
    torch_spec: str | None,
    as_json: bool,
) -> None:
    """Prove the series on real vLLM code, stock beside patched.

    Prepares (or reuses) the pin's CPU test environment, checks out the stock
    release and the patched one, and runs the suites on both. Every carried patch
    needs a test that fails on stock and without the patch, and passes patched;
    the patched tree must pass every upstream test the stock tree passes. Exits 1
    otherwise.
    """
    series = state.series
    report = testrun.run(
        series,
        pin,
        suite,
        full_upstream=full_upstream,
        stock_baseline=stock_baseline,
        torch_spec=torch_spec,
        log=log,
    )
    if as_json:
        jsonout.emit(report.to_json())
    else:
        click.echo(testrun.format_table(report))
    if not report.ok:
        raise CheckFailed(f"{len(report.problems)} problem(s) found")
