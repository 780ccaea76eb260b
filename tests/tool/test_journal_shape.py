"""A journal of the right JSON syntax but the wrong shape is refused in one line, as a
corrupt one is, and nothing is changed (recovery never acts on what it cannot read)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from builders import standard_project
from click.testing import CliRunner
from hybridpd import gitops, guard
from hybridpd.cli.main import main

pytestmark = pytest.mark.usefixtures("isolated")

GOOD = {"operation": "apply", "pid": 1, "head": None, "index": None, "locks": [],
        "touching": {}}
ENTRY = {"work": [None, "b" * 40, None], "index": [None, "b" * 40 + " 0", None]}


@pytest.mark.parametrize("change", [
    {"touching": ["proj/core.py"]},
    {"touching": "proj/core.py"},
    {"touching": {"proj/core.py": "b" * 40}},
    {"touching": {"proj/core.py": {"work": "x", "index": []}}},
    {"touching": {"proj/core.py": {**ENTRY, "index": [1]}}},
    {"touching": {"proj/core.py": {"work": ENTRY["work"]}}},
    {"locks": [["index.lock"]]},
    {"locks": "index.lock"},
    {"pid": "1"},
], ids=lambda change: json.dumps(change)[:40])
@pytest.mark.parametrize("command", ["apply", "status"])
def test_a_journal_of_the_wrong_shape_is_one_line(tmp_path: Path, change, command) -> None:
    project, series = standard_project(tmp_path)
    repo = project.checkout("1.0")
    (repo / "proj" / "core.py").write_text("the user's edit\n")
    journal = guard.git_dir(repo) / guard.JOURNAL
    text = json.dumps({**GOOD, "head": gitops.head(repo), **change})
    journal.write_text(text)
    before = (gitops.head(repo), gitops.status(repo))
    result = CliRunner().invoke(main, ["--series", str(series.path), command, "--dir", str(repo)])
    message = (f"{journal} is not a hybridpd journal (corrupt); nothing was done. If no "
               f"hybridpd is running on {repo}, inspect `git -C {repo} status`, then "
               f"`rm {journal}` and run again")
    if command == "apply":
        assert result.exit_code == 1, result.output
        assert result.stderr.splitlines() == [f"Error: {message}"]
    else:  # status reads only, and says what it found
        assert result.exit_code == 0, result.output
        assert message in result.stdout + result.stderr
    assert "internal error" not in result.output
    assert (gitops.head(repo), gitops.status(repo)) == before
    assert journal.read_text() == text
