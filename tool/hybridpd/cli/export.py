"""``hybridpd export`` and ``hybridpd check``: the checkout's commits as the pin's patch
files, and the proof that the committed files are current."""

from __future__ import annotations

from pathlib import Path

import click

from hybridpd.cli import jsonout
from hybridpd.cli.options import State, checkout_dir, json_flag, log
from hybridpd.errors import CheckFailed
from hybridpd.series.export import CheckResult
from hybridpd.series.export import check as check_series
from hybridpd.series.export import export as export_series


@click.command()
@checkout_dir
@click.option(
    "--prune",
    is_flag=True,
    help="Also remove the files of patches series.toml carries on the pin that have "
    "no commit in the checkout (without it, export refuses and writes nothing), and "
    "files that neither a record nor a commit names (without it, they are kept).",
)
@click.pass_obj
def export(state: State, repo: Path, prune: bool) -> None:
    """Write the checkout's patch commits to patches/<pin>/<id>.patch.

    Output is byte-stable. Files of recorded patches no longer in the checkout are
    removed, except those series.toml carries on the pin (that needs --prune); a file
    that neither a record nor a commit names is kept (that needs --prune too).
    series.toml is never edited, but patches without a record are reported.
    """
    series = state.series
    result = export_series(series, repo, prune=prune, log=log)
    for label, ids in (("wrote", result.written), ("removed", result.removed)):
        for patch_id in ids:
            click.echo(f"{label:<9} {result.pin}/{patch_id}.patch")
    click.echo(f"{len(result.unchanged)} unchanged, in {series.relative(series.dir / result.pin)}")
    for patch_id in result.kept:
        log(f"kept {result.pin}/{patch_id}.patch: no record and no commit; --prune removes it")
    for patch_id in result.unrecorded:
        log(f"warning: {patch_id} has no [[patches]] record in series.toml")
    if result.dirty:
        log(f"warning: {repo} has uncommitted changes; they were not exported")


@click.command()
@click.option(
    "--no-apply",
    is_flag=True,
    help="Only compare records with files; skip the fresh checkout, apply and export.",
)
@json_flag
@click.pass_obj
def check(state: State, no_apply: bool, as_json: bool) -> None:
    """Check that the patch files match series.toml and a fresh export.

    Records and files must agree for every pin. For each pin with carried
    patches, a fresh sdist checkout is patched and exported; the result must
    equal the committed files byte for byte. Exits 1 and lists the problems
    otherwise.
    """
    result = CheckResult(check_series(state.series, round_trip=not no_apply))
    if as_json:
        jsonout.emit(result.to_json())
    else:
        for problem in result.problems:
            click.echo(problem)
    if not result.ok:
        raise CheckFailed(f"{len(result.problems)} problem(s) found")
    if not as_json:
        click.echo("ok")
