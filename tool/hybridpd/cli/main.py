"""The ``hybridpd`` group: its global options, and every command registered."""

from __future__ import annotations

import signal
from pathlib import Path

import click

from hybridpd import __version__
from hybridpd.cli import jsonout
from hybridpd.cli.apply import apply, status
from hybridpd.cli.bench import bench_group
from hybridpd.cli.bundle import bundle, run_bundle
from hybridpd.cli.checkout import checkout
from hybridpd.cli.doctor import doctor_
from hybridpd.cli.e2e import e2e_command
from hybridpd.cli.explain import explain
from hybridpd.cli.export import check, export
from hybridpd.cli.export_pr import export_pr
from hybridpd.cli.install import build, install
from hybridpd.cli.listing import list_
from hybridpd.cli.options import State
from hybridpd.cli.pin import pin_group
from hybridpd.cli.port import port
from hybridpd.cli.testing import test


@click.group(cls=jsonout.JsonGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hybridpd")
@click.option(
    "--series",
    "series_path",
    type=click.Path(exists=True, path_type=Path),
    help="series.toml, or a directory holding it or patches/series.toml. Default: "
    "$HYBRIDPD_SERIES, else patches/series.toml in the current directory or a "
    "parent, else the hybridpd source checkout.",
)
@click.pass_context
def main(ctx: click.Context, series_path: Path | None) -> None:
    """Manage the hybridpd patch series against pinned vLLM releases.

    Typical flow: `checkout` a pin, `apply` the series, change or add patch commits
    (each with a `Hybridpd-Patch: <id>` trailer), `export` them back to
    patches/<pin>/, and let `check` prove the committed files are current.
    """
    ctx.obj = State(series_path)
    _interrupt_on(signal.SIGTERM, signal.SIGHUP)


def _interrupt_on(*signals: signal.Signals) -> None:
    """Make ``signals`` end a command the way Ctrl-C does, through its restore path.

    Only where the signal still has its default action (a caller that handles it,
    such as a test harness, keeps its handler).
    """

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in signals:
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, interrupt)


# In the order `hybridpd --help` has always listed them (click sorts them by name).
for _command in (
    checkout, apply, status, list_, export, doctor_, check, pin_group, port, install, build,
    test, export_pr, e2e_command, bench_group, explain, bundle, run_bundle,
):
    main.add_command(_command)
