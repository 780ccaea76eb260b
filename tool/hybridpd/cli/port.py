"""``hybridpd port``."""

from __future__ import annotations

from pathlib import Path

import click

from hybridpd.cli import jsonout
from hybridpd.cli.options import State, dir_option, json_flag, log
from hybridpd.porting import abort as abort_mod
from hybridpd.porting import port as port_mod
from hybridpd.progress import quiet
from hybridpd.series.model import Series


@click.command()
@click.option("--from", "from_version", metavar="VERSION", help="Pin whose series is replayed.")
@click.option("--to", "to_version", metavar="VERSION", help="Pin to port the series to.")
@dir_option(help="Port directory (default: <cache>/port/<TO>; must not exist, or be empty).")
@click.option(
    "--continue", "go_on", is_flag=True, help="Go on after resolving and `git add`ing a conflict."
)
@click.option("--skip", is_flag=True, help="Drop the conflicting patch: TO already has it.")
@click.option(
    "--upstream",
    "release",
    metavar="RELEASE",
    help="With --skip: the first release that has the change.",
)
@click.option(
    "--abort", is_flag=True,
    help="Stop the port and restore TO stock, keeping what the port did not make.",
)
@click.option(
    "--replace",
    is_flag=True,
    help="Port onto a pin that is already ported (its patches and records are rewritten).",
)
@json_flag
@click.pass_context
def port(
    ctx: click.Context,
    from_version: str | None,
    to_version: str | None,
    repo: Path | None,
    go_on: bool,
    skip: bool,
    release: str | None,
    abort: bool,
    replace: bool,
    as_json: bool,
) -> None:
    """Port the series from one pin to another, patch by patch.

    Checks out TO, replays FROM's patches with 3-way merges and classifies each:
    clean, 3way, resolved, upstream (with its evidence: recorded, reverse-applies,
    empty, manual) or conflict. On a conflict it stops with the conflict markers in
    the directory and says what to do next (exit 1). Once every patch is through it
    writes patches/<TO>/ and the patches' states on TO in series.toml.
    """
    state: State = ctx.obj
    request = port_mod.PortRequest.parse(
        from_version, to_version, repo, go_on, skip, abort, release, replace
    )
    if request.action == "abort":
        _echo_aborted(abort_mod.abort(request.dir, log=log), request.dir, as_json)
        return
    report = port_mod.run(state.series, request, log=quiet if as_json else log)
    steps = port_mod.next_steps(report, state.series_arg, state.series)
    by_hand = port_mod.apply_by_hand(report, state.series)
    if as_json:
        _emit_json(report, steps, by_hand, state.series)
    else:
        _echo_report(report, steps, by_hand, state.series)
    if report.conflict is not None:
        ctx.exit(1)


def _emit_json(
    report: port_mod.PortReport, steps: list[str], by_hand: list[str], series: Series
) -> None:
    if report.recovered:  # said on stderr whatever the output (the run's log was quiet)
        log(report.recovered)
    data = report.to_json()
    if report.conflict is not None:
        data["conflict"]["next"] = steps
        data["conflict"]["source"] = str(port_mod.source_patch(report, series))
        if by_hand:
            data["conflict"]["apply_by_hand"] = by_hand
    jsonout.emit(data)


def _echo_aborted(stopped: abort_mod.Aborted, repo: Path, as_json: bool) -> None:
    if as_json:
        jsonout.emit(stopped.to_json())
        return
    click.echo(f"aborted: {repo} is {stopped.to_version} stock ({stopped.stock[:12]})")
    if stopped.kept:
        click.echo(f"kept (not made by the port): {', '.join(s.strip() for s in stopped.kept)}")


def _echo_report(
    report: port_mod.PortReport, steps: list[str], by_hand: list[str], series: Series
) -> None:
    click.echo(f"port {report.from_version} -> {report.to_version} in {report.dir}")
    rows = [("ID", "RESULT", "EVIDENCE", "FILES")] + [
        (p.id, p.result, p.evidence or "-", ", ".join(p.files) or "-") for p in report.patches
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        click.echo("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3])
    for p in report.patches:
        if p.release:
            click.echo(f"  {p.id}: upstream since {p.release}" + (f" ({p.note})" if p.note else ""))
    if report.conflict is None:
        for path in report.written:
            click.echo(f"wrote {path}")
        if report.kept:
            kept = ", ".join(report.kept)
            log(f"kept {kept}: no record in series.toml and no commit in the port")
    else:
        _echo_conflict(report, report.conflict, steps, by_hand,
                       port_mod.source_patch(report, series))


def _echo_conflict(
    report: port_mod.PortReport, conflict: port_mod.Conflict, steps: list[str],
    by_hand: list[str], source: Path,
) -> None:
    click.echo(f"stopped: patch {conflict.id} conflicts with {report.to_version}")
    for f in conflict.files:
        if f.hunks:
            ranges = ", ".join(f"lines {a}-{b}" for a, b in f.hunks)
            click.echo(f"  {f.path}: conflict markers at {ranges}")
        elif conflict.merged:
            click.echo(
                f"  {f.path}: no conflict markers (deleted or renamed in {report.to_version}?)"
            )
        else:
            click.echo(f"  {f.path}: does not apply, and git could not merge it (apply it by hand)")
    for move in conflict.moved:
        click.echo(f"  upstream moved {move.describe(report.to_version)}: make the patch's "
                   "change there")
    if conflict.missing_api:
        names = ", ".join(conflict.missing_api)
        click.echo(f"  the patch calls {names}, which {report.from_version} defines and "
                   f"{report.to_version} does not: resolving the markers is not enough, "
                   f"adapt the change to {report.to_version}'s API")
    click.echo(f"  source: {source}")
    click.echo("next:")
    if by_hand:
        click.echo(f"  apply {report.from_version}'s patch file hunk by hunk (git cannot merge it):")
        click.echo(f"    {by_hand[0]}")
        click.echo("  then make each .rej file's hunks by hand and delete the .rej files;")
    click.echo(f"  resolve the conflicts in {report.dir}, `git add` the files, then:")
    click.echo(f"    {steps[0]}")
    click.echo(f"  or, if {report.to_version} already has the change ({conflict.id} is upstream):")
    click.echo(f"    {steps[1]}")
    click.echo(f"  or, to stop and restore {report.to_version} stock:")
    click.echo(f"    {steps[2]}")
