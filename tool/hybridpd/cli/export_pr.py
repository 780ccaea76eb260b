"""``hybridpd export-pr``."""

from __future__ import annotations

from pathlib import Path

import click

from hybridpd.cli import jsonout
from hybridpd.cli.options import State, json_flag, log, pin_option
from hybridpd.errors import CheckFailed, UsageError
from hybridpd.series.model import Pin
from hybridpd.upstreaming.export import ExportPrResult, run
from hybridpd.upstreaming.verify import finding_lines, format_verification


@click.command(name="export-pr")
@click.argument("patch_id", required=False)
@click.option("--all", "all_patches", is_flag=True, help="Every patch carried on the pin.")
@pin_option("newest", help="Pin (default: the newest pin).")
@click.option(
    "--to",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Directory to write <id>/ directories into.",
)
@click.option(
    "--verify",
    is_flag=True,
    help="Prove each directory on a stock checkout: the added tests fail, then pass "
    "after git am (verify.json; in the CPU test environment `hybridpd test` uses for "
    "the pin: for LMCache, its host vLLM pin's); then the project's own pre-commit "
    "checks at their pinned versions on the touched files (one line per finding).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace a PR directory that holds files export-pr did not write (edits, "
    "additions); without it, export-pr refuses and writes nothing.",
)
@click.option(
    "--author",
    metavar='"NAME <EMAIL>"',
    help="Author of the PR commits: the person who will submit them (default: git's "
    "user.name and user.email where this runs; refused when neither is set).",
)
@json_flag
@click.pass_obj
def export_pr(
    state: State,
    patch_id: str | None,
    all_patches: bool,
    pin: Pin,
    out_dir: Path,
    verify: bool,
    force: bool,
    author: str | None,
    as_json: bool,
) -> None:
    """Export carried patches as upstream pull requests (to vLLM, or to LMCache
    with --series patches/lmcache).

    For each patch, DIR/<id>/ gets git format-patch files that `git am` applies to a
    stock checkout of the pin (the patch without its Hybridpd-Patch trailer, with
    its upstream-style unit test; earlier patches it needs come first) and PR.md,
    the PR body with the latest measured numbers. Exits 1 when a --verify fails.
    A directory export-pr wrote is replaced; one holding anything else (your edits
    to PR.md, files you added) is refused unless --force. The commits are authored
    by the submitter (--author, else git's configured identity), never by the
    series' project identity.
    """
    if bool(patch_id) == all_patches:
        raise UsageError("give exactly one of PATCH_ID and --all")
    result = run(
        state.series, pin, patch_id, out_dir, verify, log=log, force=force, author=author
    )
    if as_json:
        jsonout.emit(result.to_json())
    else:
        _echo_exports(result)
    if result.failed:
        raise CheckFailed(f"verification failed for {', '.join(result.failed)}")


def _echo_exports(result: ExportPrResult) -> None:
    for export in result.exports:
        click.echo(f"{export.dir}: {', '.join(export.to_json()['files'])}")
        if export.prerequisites:
            click.echo(f"  depends on {', '.join(export.prerequisites)} (included first)")
        if export.verification:
            click.echo("  " + format_verification(export.verification))
            for line in finding_lines(export.verification):
                click.echo(f"  {line}")
