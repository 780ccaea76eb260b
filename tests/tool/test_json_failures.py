"""The --json contract on failure: one JSON document on stdout, exit codes kept."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
from builders import standard_project
from click.testing import CliRunner
from hybridpd.cli.main import main

pytestmark = pytest.mark.usefixtures("isolated")


def run(series_path: Path, *args: str):
    return CliRunner().invoke(main, ["--series", str(series_path), *args])


def test_a_failed_operation_prints_the_failure_document(tmp_path: Path) -> None:
    project, series = standard_project(tmp_path)
    result = run(series.path, "apply", "--dir", str(tmp_path / "nowhere"), "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["ok"] is False and doc["error"]
    assert f"Error: {doc['error']}" in result.stderr


def test_a_usage_error_in_the_command_keeps_exit_2(tmp_path: Path) -> None:
    _, series = standard_project(tmp_path)
    result = run(series.path, "port", "--skip", "--dir", str(tmp_path), "--json")
    assert result.exit_code == 2
    assert json.loads(result.stdout) == {
        "ok": False,
        "error": "--skip needs --upstream RELEASE (the first release with the change)",
    }


@pytest.mark.parametrize(
    "args,error",
    [
        (["apply", "--json", "--bogus"], "No such option '--bogus'."),
        (["status", "--json", "--dir"], "Option '--dir' requires an argument."),
        (["bench", "replay", "--json", "--nope"], "No such option '--nope'."),
    ],
)
def test_a_parse_error_before_json_is_read_still_prints_the_document(
    tmp_path: Path, args: list[str], error: str
) -> None:
    """click's parser stops before the --json option's callback runs: the command line
    itself says that JSON was asked for."""
    _, series = standard_project(tmp_path)
    result = run(series.path, *args)
    assert result.exit_code == 2
    assert json.loads(result.stdout) == {"ok": False, "error": error}
    assert f"Error: {error}" in result.stderr


@pytest.mark.parametrize(
    "args,error",
    [
        (["--series", "patches/nonexistent", "list", "--json"],
         "Invalid value for '--series': Path 'patches/nonexistent' does not exist."),
        (["--bogus", "list", "--json"], "No such option '--bogus'."),
    ],
)
def test_a_usage_error_in_the_groups_options_prints_the_document(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], error: str
) -> None:
    """The group's options are parsed before the command's: the command line says that
    JSON was asked for."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert json.loads(result.stdout) == {"ok": False, "error": error}
    assert f"Error: {error}" in result.stderr
    result = CliRunner().invoke(main, args[:-1])
    assert (result.exit_code, result.stdout) == (2, "")


def test_a_parse_error_without_json_prints_nothing_on_stdout(tmp_path: Path) -> None:
    _, series = standard_project(tmp_path)
    result = run(series.path, "apply", "--bogus", "--", "--json")
    assert result.exit_code == 2 and result.stdout == ""


def test_a_command_that_describes_its_failure_prints_one_document(tmp_path: Path) -> None:
    _, series = standard_project(tmp_path)
    (series.patch_dir(series.pin("1.0")) / "fix-add.patch").unlink()
    result = run(series.path, "check", "--no-apply", "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)  # one document: check's own
    assert doc["ok"] is False and doc["problems"]


def test_without_json_stdout_stays_empty_on_failure(tmp_path: Path) -> None:
    _, series = standard_project(tmp_path)
    result = run(series.path, "apply", "--dir", str(tmp_path / "nowhere"))
    assert result.exit_code == 1 and result.stdout == ""


@pytest.mark.parametrize("as_json", [True, False])
def test_a_crash_is_one_line_and_with_json_one_document(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, as_json: bool
) -> None:
    # An unexpected exception (a bug) stands in for any crash inside a command.
    apply_cli = importlib.import_module("hybridpd.cli.apply")
    _, series = standard_project(tmp_path)

    def crash(*_args, **_kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(apply_cli, "checkout_status", crash)
    monkeypatch.delenv("HYBRIDPD_DEBUG", raising=False)
    result = run(series.path, "status", "--dir", str(tmp_path), *(["--json"] if as_json else []))
    assert result.exit_code == 1
    message = "internal error: RuntimeError: boom (a hybridpd bug; HYBRIDPD_DEBUG=1 shows where)"
    assert result.stderr.strip().splitlines() == [f"Error: {message}"]
    if as_json:
        assert json.loads(result.stdout) == {"ok": False, "error": message}
    else:
        assert result.stdout == ""
