from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from builders import FIX_ADD, Project, standard_project
from click.testing import CliRunner, Result
from hybridpd.cli.main import main

pytestmark = pytest.mark.usefixtures("isolated")


def run(series_path: Path, *args: str) -> Result:
    return CliRunner().invoke(main, ["--series", str(series_path), *args])


@pytest.fixture
def project(tmp_path: Path) -> Project:
    project, _ = standard_project(tmp_path, FIX_ADD)
    project.record("landed", {"1.0": "upstream:0.5", "2.0": "upstream:1.5"})
    project.write()
    return project


def test_list_json_contract(project: Project) -> None:
    result = run(project.series_path, "list", "--pin", "v2.0", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {
        "pins": [
            {
                "version": "2.0",
                "tag": "v2.0",
                "sha256": project.releases["2.0"].sha256,
                "ported": True,
                "patches": [
                    {"id": "fix-add", "title": "title of fix-add", "state": "carried"},
                    {"id": "feature", "title": "title of feature", "state": "carried"},
                    {
                        "id": "landed",
                        "title": "title of landed",
                        "state": "upstream",
                        "release": "1.5",
                    },
                ],
            }
        ]
    }


def test_checkout_apply_status_flow(project: Project, tmp_path: Path) -> None:
    repo = tmp_path / "v2"
    result = run(project.series_path, "checkout", "v2.0", "--dir", str(repo), "--source", "sdist")
    assert result.exit_code == 0, result.output
    assert "checked out 2.0 (sdist)" in result.stdout

    status = run(project.series_path, "status", "--dir", str(repo), "--json")
    assert json.loads(status.stdout) == {
        "pin": "2.0",
        "applied": [],
        "pending": ["feature"],
        "upstream": ["landed", "fix-add"],
        "interrupted": None,
    }

    applied = run(project.series_path, "apply", "--dir", str(repo))
    assert applied.exit_code == 0, applied.output
    assert applied.stdout.splitlines() == [
        "applied   feature",
        "upstream  fix-add (its change is already in the tree; skipped)",
    ]
    again = run(project.series_path, "apply", "--dir", str(repo), "--json")
    assert json.loads(again.stdout) == {
        "pin": "2.0",
        "applied": [],
        "already": ["feature"],
        "upstream": ["fix-add"],
        "recovered": None,
    }
    assert "already applied" in run(project.series_path, "apply", "--dir", str(repo)).stdout


def test_check_exits_1_with_the_problem_list(project: Project) -> None:
    problem = "patches/2.0/fix-add.patch: already in 2.0; mark it upstream and delete the file"
    result = run(project.series_path, "check", "--json")
    assert result.exit_code == 1
    assert json.loads(result.stdout) == {"ok": False, "problems": [problem]}
    human = run(project.series_path, "check")
    assert (human.exit_code, human.stdout, human.stderr) == (
        1,
        f"{problem}\n",
        "Error: 1 problem(s) found\n",
    )
    assert run(project.series_path, "check", "--no-apply").stdout == "ok\n"


def test_errors_are_one_line_with_exit_code_1(project: Project, tmp_path: Path) -> None:
    result = run(project.series_path, "checkout", "9.9", "--dir", str(tmp_path / "x"))
    assert result.exit_code == 1
    assert result.stderr == ("Error: 9.9 is not a pinned version (pins: 1.0, 2.0; "
                             "`hybridpd --series patches/series.toml pin add 9.9` makes it one)\n")


def test_usage_errors_exit_2(project: Project) -> None:
    assert run(project.series_path, "checkout", "1.0").exit_code == 2
    assert (
        run(project.series_path, "checkout", "1.0", "--dir", "d", "--source", "ftp").exit_code == 2
    )


@pytest.mark.parametrize("command", ["checkout", "apply", "status", "list", "export", "check"])
def test_every_command_has_help(command: str) -> None:
    result = CliRunner().invoke(main, [command, "--help"])
    assert result.exit_code == 0
    assert result.stdout.startswith(f"Usage: main {command} [OPTIONS]")


def test_export_reports_what_it_wrote(project: Project) -> None:
    author = project.root / "work" / "author"
    (author / "README.txt").write_text("uncommitted\n")
    (project.series_path.parent / "1.0" / "feature.patch").unlink()
    result = run(project.series_path, "export", "--dir", str(author))
    assert result.exit_code == 0, result.output
    assert result.stdout == "wrote     1.0/feature.patch\n1 unchanged, in patches/1.0\n"
    assert result.stderr == f"warning: {author} has uncommitted changes; they were not exported\n"


def test_ctrl_c_while_the_cli_starts_is_one_line_and_exit_130(project: Project) -> None:
    # The console script calls the launcher; a Ctrl-C while it imports the CLI (before
    # the CLI's error handler exists) gets the same one line as a Ctrl-C later
    # (test_startup_signals: every signal, at any time).
    code = "import sys; from hybridpd.cli.entry import main; sys.exit(main())"
    env = {**os.environ, "HYBRIDPD_FAULT": "startup:INT"}
    result = subprocess.run([sys.executable, "-c", code, "--series", str(project.series_path),
                             "list"], capture_output=True, text=True, env=env, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (130, "", "Error: interrupted\n")
    env.pop("HYBRIDPD_FAULT")
    result = subprocess.run([sys.executable, "-c", code, "--series", str(project.series_path),
                             "list"], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0 and "fix-add" in result.stdout


def test_ctrl_c_while_the_cli_starts_with_json_prints_the_failure_document(
    project: Project,
) -> None:
    # --json runs always print one JSON document on stdout: the one the CLI prints for
    # any failure ({"ok": false, "error": ...}), also before the CLI is imported.
    code = "import sys; from hybridpd.cli.entry import main; sys.exit(main())"
    env = {**os.environ, "HYBRIDPD_FAULT": "startup:INT"}
    result = subprocess.run([sys.executable, "-c", code, "--series", str(project.series_path),
                             "list", "--json"], capture_output=True, text=True, env=env,
                            timeout=60)
    assert (result.returncode, result.stderr) == (130, "Error: interrupted\n")
    assert result.stdout.count("\n") == 1
    assert json.loads(result.stdout) == {"ok": False, "error": "interrupted"}
