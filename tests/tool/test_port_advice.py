"""What commands say about a port directory: one under way (status and apply name it),
and one a killed port left before its first patch (port says what it is and clears it
when nothing changed since)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from builders import port_project
from click.testing import CliRunner
from hybridpd import gitops, guard
from hybridpd.cli.main import main

pytestmark = pytest.mark.usefixtures("isolated")

CLI = "import sys; from hybridpd.cli.entry import main; sys.exit(main())"


def cli(series_path: Path, *args: str):
    return CliRunner().invoke(main, ["--series", str(series_path), *args])


@pytest.mark.parametrize("command", ["status", "apply"])
def test_status_and_apply_in_a_port_under_way_say_so(tmp_path: Path, command: str) -> None:
    _, series = port_project(tmp_path, {"README.txt": "proj, rewritten\n"})
    dest = tmp_path / "port"
    stopped = cli(series.path, "port", "--from", "1.0", "--to", "2.0", "--dir", str(dest))
    assert stopped.exit_code == 1 and "stopped: patch feature conflicts" in stopped.output
    before = (gitops.head(dest), gitops.status(dest))
    result = cli(series.path, command, "--dir", str(dest))
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"Error: {dest} holds a `hybridpd port` from 1.0 to 2.0 in progress: `hybridpd port "
        f"--continue --dir {dest}` (or --skip --upstream RELEASE, or --abort) ends it, then "
        "status and apply work on the checkout"]
    assert (gitops.head(dest), gitops.status(dest)) == before


def killed_port(series_path: Path, dest: Path, tmp_path: Path) -> None:
    """A port SIGKILLed after its checkout, while it fetches the base to merge against."""
    env = {**os.environ, guard.FAULT_ENV: "port:base-checked-out", "TMPDIR": str(tmp_path)}
    killed = subprocess.run([sys.executable, "-c", CLI, "--series", str(series_path), "port",
                             "--from", "1.0", "--to", "2.0", "--dir", str(dest)],
                            capture_output=True, text=True, env=env, timeout=180)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (dest / "proj").is_dir()


def test_a_port_killed_after_its_checkout_is_cleared_by_the_next_port(tmp_path: Path) -> None:
    _, series = port_project(tmp_path)
    dest = tmp_path / "port"
    killed_port(series.path, dest, tmp_path)
    again = cli(series.path, "port", "--from", "1.0", "--to", "2.0", "--dir", str(dest))
    assert again.exit_code == 0, again.output
    assert (f"removing the checkout a killed port left in {dest} (unchanged since)"
            in again.stderr)
    log = gitops.check(dest, "log", "--format=%s", "v2.0..HEAD").splitlines()
    assert log == ["Add doubling", "[Core] Keep the sum in a local"]


def test_a_killed_ports_checkout_with_the_users_work_is_kept_and_named(tmp_path: Path) -> None:
    _, series = port_project(tmp_path)
    dest = tmp_path / "port"
    killed_port(series.path, dest, tmp_path)
    (dest / "NOTES.md").write_text("mine\n")
    again = cli(series.path, "port", "--from", "1.0", "--to", "2.0", "--dir", str(dest))
    assert again.exit_code == 1
    assert again.stderr.splitlines() == [
        f"Error: {dest} holds the checkout of a port killed before its first patch, changed "
        "since (NOTES.md); remove it, or pass another --dir"]
    assert (dest / "NOTES.md").read_text() == "mine\n"


@pytest.mark.parametrize("given", [True, False], ids=["--dir", "default"])
def test_a_directory_that_is_not_empty_names_the_way_out(tmp_path: Path, given: bool) -> None:
    from hybridpd.porting.port import default_dir

    _, series = port_project(tmp_path)
    dest = tmp_path / "port" if given else default_dir("2.0")
    dest.mkdir(parents=True)
    (dest / "mine.txt").write_text("mine\n")
    result = cli(series.path, "port", "--from", "1.0", "--to", "2.0",
                 *(["--dir", str(dest)] if given else []))
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"Error: {dest} already exists and is not empty; remove it or pass "
        f"{'another ' if given else ''}--dir"]
    assert (dest / "mine.txt").read_text() == "mine\n"
