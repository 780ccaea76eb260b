"""``hybridpd doctor``."""

from __future__ import annotations

import click

from hybridpd.cli import jsonout
from hybridpd.cli.options import State, json_flag
from hybridpd.envs import doctor
from hybridpd.errors import DoctorFailed


@click.command(name="doctor")
@json_flag
@click.pass_obj
def doctor_(state: State, as_json: bool) -> None:
    """Say what this machine can do with each pin, and what to fix.

    One line per check (ok, warn or fail, with the fix): GPU, CPU kernels, the
    package index pip is configured with, which pins can test and serve here,
    NIXL, known index traps, free disk and the cache. Installs nothing. Exits 1
    when a check fails.
    """
    report = doctor.diagnose(
        state.series, probe=doctor.default_probe, nixl=doctor.default_nixl
    )
    if as_json:
        jsonout.emit(report.to_json())
    else:
        for line in report.lines():
            click.echo(line)
    if not report.ok:
        raise DoctorFailed(
            f"{len(report.failed)} check(s) failed: {', '.join(report.failed)} "
            "(see each fix above)"
        )
