"""``hybridpd port --abort`` keeps what the port did not make, or refuses naming it.

The model is ``git am --abort``: the user's untracked files and edits to files the
port never changed stay; the conflict in flight and the port's commits go.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from builders import CORE, port_project
from click.testing import CliRunner, Result
from hybridpd import gitops
from hybridpd.cli.main import main
from hybridpd.porting import port as port_mod
from hybridpd.series.model import Series

pytestmark = pytest.mark.usefixtures("isolated")

USER = ["-c", "user.name=U", "-c", "user.email=u@example.com"]


def cli(series: Series, *args: str) -> Result:
    return CliRunner().invoke(main, ["--series", str(series.path), "port", *args])


@pytest.fixture
def stopped(tmp_path: Path) -> tuple[Series, Path]:
    """A port stopped on feature (2.0 rewrote README.txt); fix-add is committed."""
    _, series = port_project(tmp_path, {"README.txt": "proj, rewritten\n"})
    dest = tmp_path / "port"
    result = cli(series, "--from", "1.0", "--to", "2.0", "--dir", str(dest))
    assert result.exit_code == 1 and "conflicts" in result.output, result.output
    return series, dest


def _users_work(dest: Path) -> dict[str, bytes]:
    """An untracked file, an untracked folder, an unstaged and a staged edit of files
    the port never changed."""
    (dest / "NOTES.md").write_text("my notes\n")
    (dest / "mywork").mkdir()
    (dest / "mywork" / "fix.py").write_text("FIX = 1\n")
    (dest / "proj" / "__init__.py").write_text("# my edit\n")
    (dest / "setup.cfg").write_text("[mine]\n")
    subprocess.run(["git", *USER, "add", "setup.cfg"], cwd=dest, check=True)
    return {p: (dest / p).read_bytes()
            for p in ("NOTES.md", "mywork/fix.py", "proj/__init__.py", "setup.cfg")}


def test_abort_keeps_untracked_files_and_unrelated_edits(stopped) -> None:
    series, dest = stopped
    stock = port_mod.PortState.load(dest).stock
    mine = _users_work(dest)
    result = cli(series, "--abort", "--dir", str(dest))
    assert result.exit_code == 0, result.output
    assert {p: (dest / p).read_bytes() for p in mine} == mine
    # The port's work is gone: HEAD, its commit's file and the conflict in flight.
    assert gitops.head(dest) == stock and not gitops.am_in_progress(dest)
    assert (dest / "proj" / "core.py").read_text() == CORE
    assert (dest / "README.txt").read_text() == "proj, rewritten\n"
    assert not (dest / "proj" / "feature.py").exists()
    # (The staged file is unstaged, as `git reset --keep` does; its content stays.)
    assert sorted(gitops.status(dest)) == [" M proj/__init__.py", "?? NOTES.md",
                                          "?? mywork/fix.py", "?? setup.cfg"]
    assert result.stdout.splitlines()[-1] == (
        "kept (not made by the port): M proj/__init__.py, A  setup.cfg, ?? NOTES.md, "
        "?? mywork/fix.py"
    )
    assert not port_mod.PortState.path(dest).exists()


def test_abort_json_lists_what_it_kept(stopped) -> None:
    series, dest = stopped
    (dest / "NOTES.md").write_text("my notes\n")
    result = cli(series, "--abort", "--dir", str(dest), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["kept"] == ["?? NOTES.md"]


def test_abort_refuses_to_discard_an_edit_of_a_file_the_port_changed(stopped) -> None:
    series, dest = stopped
    with open(dest / "proj" / "core.py", "a") as fh:  # fix-add's commit changed it
        fh.write("# mine\n")
    edited = (dest / "proj" / "core.py").read_bytes()
    head, status = gitops.head(dest), gitops.status(dest)
    result = cli(series, "--abort", "--dir", str(dest))
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"Error: {dest}: --abort would discard what the port did not make (proj/core.py "
        "(edited after the port changed it)); nothing was done: commit or move them out of "
        f"the directory (git -C {dest} stash -u keeps them all), then run again"
    ]
    assert (dest / "proj" / "core.py").read_bytes() == edited
    assert (gitops.head(dest), gitops.status(dest)) == (head, status)
    assert gitops.am_in_progress(dest) and port_mod.PortState.path(dest).exists()


def test_abort_refuses_to_drop_a_commit_the_port_did_not_make(stopped) -> None:
    series, dest = stopped
    gitops.check(dest, "am", "--abort")  # the user leaves the am, then commits their work
    (dest / "mine.txt").write_text("mine\n")
    subprocess.run(["git", *USER, "add", "mine.txt"], cwd=dest, check=True)
    subprocess.run(["git", *USER, "commit", "-qm", "my work"], cwd=dest, check=True)
    (dest / "other.txt").write_text("more\n")
    subprocess.run(["git", *USER, "add", "other.txt"], cwd=dest, check=True)
    subprocess.run(["git", *USER, "commit", "-qm", "more work"], cwd=dest, check=True)
    mine = gitops.head(dest)
    result = cli(series, "--abort", "--dir", str(dest))
    assert result.exit_code == 1
    (line,) = result.output.strip().splitlines()
    assert "(my work)" in line and f"commit {mine[:12]} (more work)" in line
    assert gitops.head(dest) == mine


def test_a_port_does_not_replace_an_aborted_one_holding_the_users_files(stopped) -> None:
    series, dest = stopped
    (dest / "NOTES.md").write_text("my notes\n")
    assert cli(series, "--abort", "--dir", str(dest)).exit_code == 0
    again = cli(series, "--from", "1.0", "--to", "2.0", "--dir", str(dest))
    assert again.exit_code == 1
    assert again.output.strip().splitlines() == [
        f"Error: {dest} holds an ended port and changes it did not make (?? NOTES.md); "
        "nothing was done: move them out of it, or pass another --dir"
    ]
    assert (dest / "NOTES.md").read_text() == "my notes\n"
