"""``hybridpd pin add``: a release becomes a pin (found and hashed on the index pip is
configured for, written in version order, not ported), with the pin to port from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from builders import (
    BASE_FILES,
    FEATURE,
    FIX_ADD,
    Project,
    commit_patch,
    make_index,
    pack_release,
    standard_project,
)
from click.testing import CliRunner, Result
from hybridpd.cli.main import main
from hybridpd.series.export import export
from hybridpd.series.model import load

pytestmark = pytest.mark.usefixtures("isolated")


def run(series_path: Path, *args: str) -> Result:
    return CliRunner().invoke(main, ["--series", str(series_path), *args])


def _publish(project: Project, monkeypatch: pytest.MonkeyPatch, version: str,
             files: dict[str, str] | None = None, hashes: bool = True,
             yanked: str | None = None):
    """Pack ``version`` and serve it, with the project's releases, on pip's index (not
    in hybridpd's cache: pin add must download it)."""
    release = pack_release(project.root / "new", version, {**BASE_FILES, **(files or {})})
    index = make_index(project.root / "index", [*project.releases.values(), release], hashes,
                       None if yanked is None else {version: yanked})
    monkeypatch.setenv("PIP_INDEX_URL", index)
    return release


def test_the_pin_is_written_in_version_order_and_not_ported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project, series = standard_project(tmp_path)
    before = series.path.read_text()
    release = _publish(project, monkeypatch, "1.5")

    result = run(series.path, "pin", "add", "v1.5")

    assert result.exit_code == 0, result.output
    after = load(series.path)
    assert [(p.version, p.ported) for p in after.pins] == [
        ("1.0", True), ("1.5", False), ("2.0", True)]
    added = after.pin("1.5")
    assert (added.tag, added.sdist, added.sha256) == ("v1.5", release.filename, release.sha256)
    # Only the new table: the rest of the file is as it was.
    new_table = (f'[[pins]]\nversion = "1.5"\ntag = "v1.5"\nsdist = "{release.filename}"\n'
                 f'sha256 = "{release.sha256}"\nported = false\n\n')
    assert series.path.read_text().replace(new_table, "") == before
    assert "next: hybridpd --series" in result.stdout and "port --from 1.0 --to 1.5" in result.stdout
    assert run(series.path, "check", "--no-apply").stdout == "ok\n"
    # The sdist is in the cache, verified: port and checkout need no other download.
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "empty-index").as_uri())
    assert run(series.path, "checkout", "1.5", "--dir", str(tmp_path / "co"),
               "--source", "sdist").exit_code == 0


def test_a_release_after_the_last_pin_goes_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project, series = standard_project(tmp_path)
    _publish(project, monkeypatch, "2.1")
    assert run(series.path, "pin", "add", "2.1").exit_code == 0
    assert [p.version for p in load(series.path).pins] == ["1.0", "2.0", "2.1"]


def test_an_index_without_hashes_gets_the_downloaded_files_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project, series = standard_project(tmp_path)
    release = _publish(project, monkeypatch, "2.1", hashes=False)
    result = run(series.path, "pin", "add", "2.1", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["sha256"] == release.sha256 == load(series.path).pin(
        "2.1").sha256


def _diverged_project(root: Path) -> Project:
    """Pins 1.0 and 2.0 whose releases differ in README.txt (a file the feature patch
    changes), each pin's patches exported from its own checkout: a fix-add hunk that
    applies to both, a README hunk whose context is each release's own README."""
    project = Project(root)
    project.release("1.0")
    project.release("2.0", {"README.txt": "proj: the 2.0 readme\n"})
    project.record("fix-add", {"1.0": "carried", "2.0": "carried"})
    project.record("feature", {"1.0": "carried", "2.0": "carried"})
    series = project.write()
    for version in ("1.0", "2.0"):
        repo = project.checkout(version, f"author-{version}")
        commit_patch(repo, "fix-add", FIX_ADD, "[Core] Keep the sum in a local")
        commit_patch(repo, "feature", {**FEATURE, "README.txt": "new readme\n"}, "Add doubling")
        export(series, repo)
    return project


def test_the_proposed_source_is_the_pin_whose_hunks_apply_best(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = _diverged_project(tmp_path)
    # 0.9 is nearest to 1.0, but its files are 2.0's.
    _publish(project, monkeypatch, "0.9", {"README.txt": "proj: the 2.0 readme\n"})

    result = run(project.series_path, "pin", "add", "0.9", "--json")

    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["proposed_from"] == "2.0"
    assert out["candidates"] == [
        {"version": "2.0", "hunks_applying": 2, "hunks": 2, "would_lose": []},
        {"version": "1.0", "hunks_applying": 1, "hunks": 2, "would_lose": []},
    ]
    assert out["reason"] == ("2 of the 2 hunks of its patches apply to 0.9 as they are "
                             "(other pins: 1.0 1/2)")
    assert {k: out[k] for k in ("version", "tag", "ported")} == {
        "version": "0.9", "tag": "v0.9", "ported": False}


def test_a_tie_goes_to_the_nearest_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project = _diverged_project(tmp_path)
    _publish(project, monkeypatch, "3.0", {"README.txt": "proj: a 3.0 readme\n"})
    out = json.loads(run(project.series_path, "pin", "add", "3.0", "--json").stdout)
    assert [c["version"] for c in out["candidates"]] == ["2.0", "1.0"]
    assert out["candidates"][0]["hunks_applying"] == out["candidates"][1]["hunks_applying"] == 1


@pytest.mark.parametrize(
    ("version", "code", "error"),
    [
        ("2.0", 1, "Error: 2.0 is already a pin of "),
        ("3.0", 1, "Error: proj-3.0.tar.gz not found ("),
        ("three", 2, "Error: 'three' is not a release version"),
        ("3.00", 2, "Error: '3.00' is not a release version as the index names it (did you mean "
                    "3.0?)"),
    ],
)
def test_refusals_are_one_line_and_write_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str, code: int, error: str
) -> None:
    project, series = standard_project(tmp_path)
    _publish(project, monkeypatch, "2.1")
    before = series.path.read_text()

    result = run(series.path, "pin", "add", version)

    assert result.exit_code == code
    # Exit 1: the error line alone; exit 2 (a usage error): after click's usage lines.
    lines = result.stderr.splitlines()
    assert lines[-1].startswith(error) and (code == 2 or len(lines) == 1), result.stderr
    assert series.path.read_text() == before
    assert not any((tmp_path / "cache" / "sdists").glob("proj-3*"))


@pytest.mark.parametrize("url", ["http://[::1", "https://[::1]x:y/", "notaurl"])
def test_an_unusable_index_url_is_one_line_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    _, series = standard_project(tmp_path)
    before = series.path.read_text()
    monkeypatch.setenv("PIP_INDEX_URL", url)
    result = run(series.path, "pin", "add", "2.1")
    assert result.exit_code == 1
    [line] = result.stderr.splitlines()
    assert line.startswith("Error: proj-2.1.tar.gz not found") and "internal error" not in line
    assert f"{url.rstrip('/')}/proj/ is not a usable index URL" in line, line
    assert series.path.read_text() == before


def test_commands_on_a_release_that_is_not_a_pin_say_how_to_add_it(tmp_path: Path) -> None:
    _, series = standard_project(tmp_path)
    result = run(series.path, "port", "--from", "2.0", "--to", "2.1")
    assert result.exit_code == 1
    assert result.stderr == ("Error: 2.1 is not a pinned version (pins: 1.0, 2.0; "
                             "`hybridpd --series patches/series.toml pin add 2.1` makes it one)\n")


def test_a_pin_that_records_a_later_fix_upstream_is_not_proposed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2.0 records "landed" upstream since 1.8: porting 1.5 from it would copy the record
    and 1.5 would lose a fix it does not have. 1.0 carries it."""
    project = _diverged_project(tmp_path)
    project.record("landed", {"1.0": "carried", "2.0": "upstream:1.8"})
    series = project.write()
    repo = tmp_path / "work" / "author-1.0"
    commit_patch(repo, "landed", {"proj/extra.py": "x = 1\n"}, "Land it")
    export(series, repo)
    # 1.5's files are 2.0's: 2.0's hunks all apply, 1.0's only half.
    _publish(project, monkeypatch, "1.5", {"README.txt": "proj: the 2.0 readme\n"})

    out = json.loads(run(project.series_path, "pin", "add", "1.5", "--json").stdout)

    assert out["proposed_from"] == "1.0"
    assert out["candidates"][1] == {"version": "2.0", "hunks_applying": 2, "hunks": 2,
                                    "would_lose": ["landed"]}
    assert out["reason"].endswith("(other pins: 2.0 2/2 and would lose landed)")


def test_hunks_are_read_as_git_applies_them() -> None:
    from hybridpd.series.source import _patch_hunks

    text = "\n".join([
        "Subject: x", "", "---", "diff --git a/a.py b/a.py", "index 1..2 100644",
        "--- a/a.py", "+++ b/a.py", "@@ -1,3 +1,3 @@", " one", "-two", "+TWO", " three",
        "@@ -9,2 +9,2 @@ def f():", " x = 1", "-y = 2", "\\ No newline at end of file",
        "+y = 3", "\\ No newline at end of file",
        "diff --git a/new.py b/new.py", "new file mode 100644", "index 0000000..3",
        "--- /dev/null", "+++ b/new.py", "@@ -0,0 +1 @@", "+hello",
        "diff --git a/old.py b/renamed.py", "similarity index 90%", "rename from old.py",
        "rename to renamed.py", "index 4..5 100644", "--- a/old.py", "+++ b/renamed.py",
        "@@ -1,2 +1,2 @@", " keep\x0cpage", "-gone", "+come", "-- ", "2.43.0", "",
    ])
    assert _patch_hunks(text) == [
        ("a.py", "one\ntwo\nthree\n"),
        ("a.py", "x = 1\ny = 2"),  # the file ends without a newline
        ("old.py", "keep\x0cpage\ngone\n"),  # a rename's pre-image is the old file
    ]


def test_a_yanked_release_is_pinned_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project, series = standard_project(tmp_path)
    _publish(project, monkeypatch, "2.1", yanked="broken wheel")
    before = series.path.read_text()

    refused = run(series.path, "pin", "add", "2.1")

    assert refused.exit_code == 1
    assert refused.stderr == ("Error: proj-2.1.tar.gz is yanked on the index (broken wheel); "
                              "pin it anyway with --allow-yanked\n")
    assert series.path.read_text() == before
    allowed = run(series.path, "pin", "add", "2.1", "--allow-yanked", "--json")
    assert allowed.exit_code == 0, allowed.output
    assert json.loads(allowed.stdout)["yanked"] == "broken wheel"


@pytest.mark.parametrize("fault", ["missing", "not-a-hash", "other-hash"])
def test_an_index_that_lists_a_file_wrongly_says_what_is_wrong(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """A file the index lists but does not have, and a hash on its page that is not one
    or not the file's: one line that names the file, the URL and both hashes, and says
    the expectation is the index's (pin add has no series.toml hash yet)."""
    project, series = standard_project(tmp_path)
    release = _publish(project, monkeypatch, "2.1")
    files = project.root / "index" / "files"
    page = project.root / "index" / "simple" / "proj" / "index.html"
    url = (files / release.filename).as_uri()
    if fault == "missing":
        (files / release.filename).unlink()
        error = (f"the index lists {release.filename} at {url}, but it is not there (no such "
                 f"file: {files / release.filename})")
    elif fault == "not-a-hash":
        page.write_text(page.read_text().replace(release.sha256, "00"))
        error = (f"the index lists {release.filename} with sha256 '00', which is not a sha256 "
                 "(64 hex digits): the index's page is wrong")
    else:
        page.write_text(page.read_text().replace(release.sha256, "0" * 64))
        error = (f"{release.filename} from {url} has sha256 {release.sha256}, the index "
                 f"expects {'0' * 64}")
    before = series.path.read_text()
    result = run(series.path, "pin", "add", "2.1")
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == f"Error: {error}"
    assert series.path.read_text() == before
    assert not (tmp_path / "cache" / "sdists" / release.filename).exists()
