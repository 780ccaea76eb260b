"""``hybridpd checkout``."""

from __future__ import annotations

from pathlib import Path

import click

from hybridpd.cli.options import State, dir_option, pin_argument
from hybridpd.series.checkout import SOURCES, Source
from hybridpd.series.checkout import checkout as make_checkout
from hybridpd.series.model import Pin


@click.command()
@pin_argument()
@dir_option(required=True, help="Directory to create (must not exist, or be empty).")
@click.option(
    "--source",
    type=click.Choice(SOURCES),
    default="auto",
    show_default=True,
    help="sdist: the release's sdist from the package index pip uses, verified "
    "against series.toml; git: a shallow clone of the release tag; auto: git, "
    "falling back to the sdist.",
)
@click.option(
    "--git-url",
    metavar="URL",
    help="Repository to clone (default: upstream_git in series.toml).",
)
@click.pass_obj
def checkout(state: State, pin: Pin, repo: Path, source: Source, git_url: str | None) -> None:
    """Check out a pinned release as a git tree.

    VERSION is a pinned version, e.g. 0.20.2 or v0.20.2. The tree is on branch
    `hybridpd`, with the release commit tagged v<VERSION>. On failure nothing is
    left behind.
    """
    result = make_checkout(state.series, pin, repo, source=source, git_url=git_url)
    click.echo(
        f"checked out {result.pin.version} ({result.source}) at {result.dest}, "
        f"commit {result.head[:12]} tagged {result.pin.tag}"
    )
