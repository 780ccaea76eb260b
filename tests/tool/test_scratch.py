"""Temporary trees live in the cache (:mod:`hybridpd.scratch`): a killed ``check``,
``export-pr`` or ``port`` leaves its tree there, and the next run removes it; a live
process's tree is never touched; a signal removes the tree at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from builders import port_project, standard_project
from hybridpd import guard, scratch
from hybridpd.series.model import Series

pytestmark = pytest.mark.usefixtures("isolated")

CLI = "import sys; from hybridpd.cli.entry import main; sys.exit(main())"
SUBMITTER = "PR Submitter <submitter@example.invalid>"
HOLD = """
import sys, time
from hybridpd import scratch
with scratch.tree("held-") as tree:
    (tree / "big").write_bytes(b"x" * 1000)
    print(tree, flush=True)
    time.sleep(120)
"""


def hybridpd(series: Series, *args: str, tmp: Path, fault: str | None = None):
    env = {**os.environ, "TMPDIR": str(tmp)}
    env.pop(guard.FAULT_ENV, None)
    if fault:
        env[guard.FAULT_ENV] = fault
    return subprocess.run([sys.executable, "-c", CLI, "--series", str(series.path), *args],
                          capture_output=True, text=True, env=env, timeout=180)


def trees() -> list[str]:
    return sorted(p.name for p in scratch.root().iterdir() if p.is_dir())


def holder() -> tuple[subprocess.Popen, Path]:
    child = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True)
    return child, Path(child.stdout.readline().strip())


def test_a_killed_processs_tree_goes_with_the_next_tree_a_live_ones_stays() -> None:
    live, live_tree = holder()
    dead, dead_tree = holder()
    try:
        dead.kill()
        dead.wait()
        assert dead_tree.is_dir()  # SIGKILL: nothing could remove it
        with scratch.tree("next-") as mine:
            assert not dead_tree.exists()
            assert live_tree.is_dir() and (live_tree / "big").is_file()
            assert mine.is_dir() and list(mine.iterdir()) == []
        assert not mine.exists()
    finally:
        live.kill()
        live.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=str)
def test_a_signal_removes_the_tree(tmp_path: Path, sig: signal.Signals) -> None:
    code = ("import sys; from hybridpd.cli import signals; signals.install()\n"
            "with signals.armed():\n" + "".join(f"    {line}\n" for line in HOLD.splitlines()))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    tree = Path(child.stdout.readline().strip())
    assert tree.is_dir()
    child.send_signal(sig)
    child.communicate(timeout=60)
    assert not tree.exists() and trees() == []


def test_a_killed_check_leaves_nothing_after_the_next_run(tmp_path: Path) -> None:
    _, series = standard_project(tmp_path)
    (tmp := tmp_path / "tmp").mkdir()
    killed = hybridpd(series, "check", fault="check:round-trip", tmp=tmp)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert [t.startswith("check-") for t in trees()] == [True] and list(tmp.iterdir()) == []
    again = hybridpd(series, "check", tmp=tmp)
    assert again.returncode == 0, again.stderr
    assert trees() == [] and list(tmp.iterdir()) == []


def test_a_killed_export_pr_leaves_nothing_after_the_next_run(tmp_path: Path) -> None:
    _, series = standard_project(tmp_path)
    (tmp := tmp_path / "tmp").mkdir()
    killed = hybridpd(series, "export-pr", "fix-add", "--pin", "1.0", "--to",
                      str(tmp_path / "out"), "--author", SUBMITTER,
                      fault="export-pr:checked-out", tmp=tmp)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    [left] = trees()
    assert left.startswith("export-pr-") and list(tmp.iterdir()) == []
    assert (scratch.root() / left / "stock" / "proj").is_dir()  # the stock checkout
    again = hybridpd(series, "check", tmp=tmp)
    assert again.returncode == 0, again.stderr
    assert trees() == [] and list(tmp.iterdir()) == []


def test_a_killed_port_leaves_nothing_after_the_next_run(tmp_path: Path) -> None:
    _, series = port_project(tmp_path)
    (tmp := tmp_path / "tmp").mkdir()
    dest = tmp_path / "port"
    killed = hybridpd(series, "port", "--from", "1.0", "--to", "2.0", "--dir", str(dest),
                      fault="port:base-checked-out", tmp=tmp)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert [t.startswith("port-base-") for t in trees()] == [True]
    assert list(tmp.iterdir()) == []
    again = hybridpd(series, "check", tmp=tmp)
    assert again.returncode == 0, again.stderr
    assert trees() == [] and list(tmp.iterdir()) == []
