"""``hybridpd port``: replay a pin's series on another pin and record the result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from builders import CORE, FIX_ADD, port_project, standard_project
from click.testing import CliRunner, Result
from hybridpd import cache, gitops
from hybridpd.porting import port as port_mod
from hybridpd.series.apply import TRAILER
from hybridpd.cli.main import main
from hybridpd.errors import HybridpdError
from hybridpd.series.export import check
from hybridpd.series.model import PinState, Series, load

pytestmark = pytest.mark.usefixtures("isolated")

# 2.0 edits a context line of fix-add's hunk (two lines below the change): plain
# apply fails, a 3-way merge succeeds.
SUB_RENAMED = {"proj/core.py": CORE.replace("def sub(a, b):", "def sub(a, b):  # difference")}
README_REWRITTEN = {"README.txt": "proj, rewritten\n"}


def cli(series: Series, *args: str) -> Result:
    return CliRunner().invoke(main, ["--series", str(series.path), "port", *args])


def results(report: port_mod.PortReport) -> list[tuple[str, str, str | None]]:
    return [(p.id, p.result, p.evidence) for p in report.patches]


def test_clean_port_writes_files_and_series(tmp_path: Path) -> None:
    _, series = port_project(tmp_path, {"proj/extra.py": "X = 1\n"})
    before = series.path.read_text()
    dest = tmp_path / "port"
    report = port_mod.start(series, "1.0", "2.0", dest)
    assert results(report) == [("fix-add", "clean", None), ("feature", "clean", None)]
    assert report.written == (
        "patches/2.0/fix-add.patch",
        "patches/2.0/feature.patch",
        "patches/series.toml",
    )
    ported = load(series.path)
    assert ported.pin("2.0").ported
    assert [p.id for p in ported.carried(ported.pin("2.0"))] == ["fix-add", "feature"]
    on_1 = '[patches.pins."1.0"]\nstate = "carried"\n'
    on_2 = '[patches.pins."2.0"]\nstate = "carried"\n'
    expected = before.replace("ported = false\n", "").replace(on_1, f"{on_1}\n{on_2}")
    assert series.path.read_text() == expected
    commits = gitops.commits(dest, "v2.0..HEAD")
    assert [c.trailer_values(TRAILER) for c in commits] == [["fix-add"], ["feature"]]
    assert not port_mod.PortState.path(dest).exists()
    assert gitops.resolve(dest, port_mod.BASE_REF) is None
    assert check(ported) == []


def test_three_way_port_needs_and_gets_the_old_blobs(tmp_path: Path) -> None:
    project, series = port_project(tmp_path, SUB_RENAMED)
    # Without 1.0's blobs, git cannot merge: a plain 2.0 checkout refuses fix-add.
    plain = project.checkout("2.0", "plain")
    assert not gitops.am(plain, [series.patch_path(series.pin("1.0"), "fix-add")]).ok
    report = port_mod.start(series, "1.0", "2.0", tmp_path / "port")
    assert results(report) == [("fix-add", "3way", None), ("feature", "clean", None)]
    core = (tmp_path / "port" / "proj" / "core.py").read_text()
    assert "    total = a + b\n" in core and "# difference" in core
    assert check(load(series.path)) == []


def test_change_already_in_the_release_is_upstream(tmp_path: Path) -> None:
    # fix-add's change is in 2.0 verbatim: it reverse-applies.
    _, series = port_project(tmp_path, FIX_ADD)
    report = port_mod.start(series, "1.0", "2.0", tmp_path / "port")
    assert results(report) == [
        ("fix-add", "upstream", "reverse-applies"),
        ("feature", "clean", None),
    ]
    fix_add = report.patches[0]
    assert (fix_add.release, fix_add.files) == ("2.0", ("proj/core.py",))
    assert "guess" in (fix_add.note or "")
    ported = load(series.path)
    assert ported.state(ported.pin("2.0"), "fix-add") == PinState("upstream", "2.0")
    assert not series.patch_path(ported.pin("2.0"), "fix-add").exists()
    assert check(ported) == []


def test_merge_that_changes_nothing_is_upstream_empty(tmp_path: Path) -> None:
    # 2.0 has fix-add's change but another context line: it does not reverse-apply,
    # and the 3-way merge finds nothing to do.
    merged = {
        "proj/core.py": FIX_ADD["proj/core.py"].replace("def sub(a, b):", "def sub(a, b):  #")
    }
    _, series = port_project(tmp_path, merged)
    report = port_mod.start(series, "1.0", "2.0", tmp_path / "port")
    assert results(report)[0] == ("fix-add", "upstream", "empty")
    assert check(load(series.path)) == []


def test_recorded_upstream_is_not_replayed(tmp_path: Path) -> None:
    _, series = port_project(tmp_path, extra={"gone": "upstream:0.9"})
    report = port_mod.start(series, "1.0", "2.0", tmp_path / "port")
    assert results(report)[2] == ("gone", "upstream", "recorded")
    assert report.patches[2].release == "0.9"
    ported = load(series.path)
    assert ported.state(ported.pin("2.0"), "gone") == PinState("upstream", "0.9")


def test_a_dropped_patch_is_not_replayed_and_stays_dropped(tmp_path: Path) -> None:
    project, _ = port_project(tmp_path)
    project.records[0]["states"]["1.0"] = "dropped"  # fix-add
    series = project.write()
    series.patch_path(series.pin("1.0"), "fix-add").unlink()
    report = port_mod.start(series, "1.0", "2.0", tmp_path / "port")
    assert results(report) == [
        ("fix-add", "dropped", "recorded"),
        ("feature", "clean", None),
    ]
    assert "total = a + b" not in (tmp_path / "port" / "proj" / "core.py").read_text()
    ported = load(series.path)
    assert ported.state(ported.pin("2.0"), "fix-add") == PinState("dropped")
    assert not ported.patch_path(ported.pin("2.0"), "fix-add").exists()
    assert check(ported) == []


def test_re_porting_keeps_an_upstream_state_over_a_dropped_one(tmp_path: Path) -> None:
    project, _ = port_project(tmp_path)
    project.unported.clear()
    project.records[0]["states"].update({"1.0": "dropped", "2.0": "upstream:1.5"})
    project.records[1]["states"]["2.0"] = "carried"
    series = project.write()
    series.patch_path(series.pin("1.0"), "fix-add").unlink()
    report = port_mod.start(series, "1.0", "2.0", tmp_path / "port", replace=True)
    assert results(report)[0] == ("fix-add", "upstream", "recorded")
    ported = load(series.path)
    assert ported.state(ported.pin("2.0"), "fix-add") == PinState("upstream", "1.5")


def test_re_porting_tries_a_patch_the_target_records_upstream(tmp_path: Path) -> None:
    # Re-porting: 2.0 says fix-add is upstream, but its change is not in 2.0 (the
    # record `hybridpd test` disproves). --replace replays what 1.0 carries, so the
    # fix is carried again instead of being dropped on the record's word.
    project, _ = port_project(tmp_path)
    project.unported.clear()
    project.records[0]["states"]["2.0"] = "upstream:1.5"
    project.records[1]["states"]["2.0"] = "carried"
    series = project.write()
    report = port_mod.start(series, "1.0", "2.0", tmp_path / "port", replace=True)
    assert results(report) == [
        ("fix-add", "clean", None),
        ("feature", "clean", None),
    ]
    assert "total = a + b" in (tmp_path / "port" / "proj" / "core.py").read_text()
    assert load(series.path).state(load(series.path).pin("2.0"), "fix-add") == PinState(
        "carried", None)


@pytest.mark.parametrize("as_json", [False, True])
def test_a_file_the_series_does_not_know_is_kept_and_reported(
    tmp_path: Path, as_json: bool
) -> None:
    # A forward port onto a pin that is already ported: fix-add is dropped there, so
    # its file goes; the user's my-wip.patch has no record and no commit: it stays.
    project, _ = port_project(tmp_path)
    project.unported.clear()
    project.records[0]["states"]["2.0"] = "dropped"
    project.records[1]["states"]["2.0"] = "carried"
    series = project.write()
    pin2 = series.patch_dir(series.pin("2.0"))
    pin2.mkdir(parents=True, exist_ok=True)
    (pin2 / "fix-add.patch").write_text("an old file of a record now dropped on 2.0\n")
    wip = pin2 / "my-wip.patch"
    wip.write_bytes(b"the user's work in progress\n")
    args = ["--from", "1.0", "--to", "2.0", "--dir", str(tmp_path / "port"), "--replace"]
    result = cli(series, *args, *(["--json"] if as_json else []))
    assert result.exit_code == 0, result.output
    assert wip.read_bytes() == b"the user's work in progress\n"
    assert not (pin2 / "fix-add.patch").exists()
    if as_json:
        assert json.loads(result.stdout)["kept"] == ["patches/2.0/my-wip.patch"]
        return
    kept = [line for line in result.output.splitlines() if "my-wip" in line]
    assert kept == [
        "kept patches/2.0/my-wip.patch: no record in series.toml and no commit in the port"
    ], result.output


def test_release_of_a_detected_upstream_patch_comes_from_another_pin(tmp_path: Path) -> None:
    project, _ = port_project(tmp_path, FIX_ADD)
    project.release("3.0", FIX_ADD)
    project.records[0]["states"]["3.0"] = "upstream:1.5"
    project.records[1]["states"]["3.0"] = "carried"
    series = project.write()
    report = port_mod.start(series, "1.0", "2.0", tmp_path / "port")
    assert (report.patches[0].release, report.patches[0].note) == (
        "1.5",
        "release 1.5 from the record's state on 3.0",
    )


@pytest.fixture
def stopped(tmp_path: Path) -> tuple[Series, Path, Result]:
    """A port stopped on feature, whose README line 2.0 rewrote."""
    _, series = port_project(tmp_path, README_REWRITTEN)
    dest = tmp_path / "port"
    return series, dest, cli(series, "--from", "1.0", "--to", "2.0", "--dir", str(dest))


def test_conflict_stops_resolvably_and_says_what_to_do(
    stopped: tuple[Series, Path, Result],
) -> None:
    series, dest, result = stopped
    assert result.exit_code == 1, result.output
    prefix = f"hybridpd --series {series.path}"
    for line in (
        "stopped: patch feature conflicts with 2.0",
        "  README.txt: conflict markers at lines 1-6",
        f"    {prefix} port --continue --dir {dest}",
        f"    {prefix} port --skip --upstream RELEASE --dir {dest}",
        f"    {prefix} port --abort --dir {dest}",
    ):
        assert line in result.stdout.splitlines(), result.stdout
    assert gitops.am_in_progress(dest)
    assert gitops.conflicted_files(dest) == ["README.txt"]
    assert (dest / "README.txt").read_text().startswith("<<<<<<< ")
    state = port_mod.PortState.load(dest)
    assert (state.current, [d["id"] for d in state.done]) == ("feature", ["fix-add"])
    assert "ported = false" in series.path.read_text()
    assert not series.patch_dir(series.pin("2.0")).exists()


def test_continue_after_resolution_finishes(stopped: tuple[Series, Path, Result]) -> None:
    series, dest, _ = stopped
    unresolved = cli(series, "--continue", "--dir", str(dest))
    assert unresolved.exit_code == 1
    assert "unresolved conflicts in README.txt" in unresolved.output
    (dest / "README.txt").write_text("proj, rewritten\nNow with doubling.\n")
    gitops.check(dest, "add", "README.txt")
    result = cli(series, "--continue", "--dir", str(dest), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [(p["id"], p["result"]) for p in report["patches"]] == [
        ("fix-add", "clean"),
        ("feature", "resolved"),
    ]
    ported = load(series.path)
    assert [p.id for p in ported.carried(ported.pin("2.0"))] == ["fix-add", "feature"]
    assert "Now with doubling." in series.patch_path(ported.pin("2.0"), "feature").read_text()
    assert check(ported) == []


def test_continue_with_nothing_resolved_refuses_and_loses_nothing(
    stopped: tuple[Series, Path, Result],
) -> None:
    series, dest, _ = stopped
    series_text = series.path.read_text()
    gitops.reset_hard(dest, "HEAD")  # nothing of feature staged: nothing resolved
    for _ in range(2):  # the reported case: --continue twice
        result = cli(series, "--continue", "--dir", str(dest))
        assert result.exit_code == 1, result.output
        assert (
            "nothing is staged for feature: resolve the conflicts, `git add` the files, "
            "then --continue; or, if 2.0 already has the change, --skip --upstream RELEASE"
        ) in result.output
        assert len(result.output.strip().splitlines()) == 1
    # Still stopped on feature, the earlier patch kept; nothing written.
    state = port_mod.PortState.load(dest)
    assert (state.current, [d["id"] for d in state.done]) == ("feature", ["fix-add"])
    assert gitops.am_in_progress(dest)
    assert series.path.read_text() == series_text
    assert not series.patch_dir(series.pin("2.0")).exists()
    # The explicit way out still works.
    result = cli(series, "--skip", "--upstream", "1.5", "--dir", str(dest))
    assert result.exit_code == 0, result.output


def test_a_commit_that_changes_nothing_is_refused(stopped: tuple[Series, Path, Result]) -> None:
    series, dest, _ = stopped
    before = port_mod.PortState.load(dest).before
    gitops.check(dest, "am", "--abort")  # the user ends git am by hand...
    gitops.check(dest, "commit", "--allow-empty", "-m", "feature, resolved to nothing")
    with pytest.raises(HybridpdError, match="the commit changes nothing for feature"):
        port_mod.resume(series, dest, "continue")
    assert gitops.resolve(dest, "HEAD~1") == before
    assert "ported = false" in series.path.read_text()


@pytest.mark.parametrize("text", ["{not json", "[]"])
def test_a_corrupt_port_state_is_one_line(stopped: tuple[Series, Path, Result], text) -> None:
    series, dest, _ = stopped
    state = port_mod.PortState.path(dest)
    state.write_text(text)
    result = cli(series, "--continue", "--dir", str(dest))
    assert result.exit_code in (1, 2), result.output
    (line,) = result.output.strip().splitlines()[-1:]
    assert line.startswith("Error: ") and f"{state}: unreadable port state" in line
    assert "internal error" not in result.output and state.read_text() == text


def test_skip_upstream_newer_than_the_target_is_refused(
    stopped: tuple[Series, Path, Result],
) -> None:
    series, dest, _ = stopped
    series_text = series.path.read_text()
    result = cli(series, "--skip", "--upstream", "2.1", "--dir", str(dest))
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines() == [
        "Error: --upstream 2.1 is newer than 2.0, the release this port is to: the first "
        "release with the change is 2.0 or older"
    ]
    assert port_mod.PortState.load(dest).current == "feature"  # still stopped, as it was
    assert series.path.read_text() == series_text


@pytest.mark.parametrize("release", ["0.5", "1.0"])
def test_skip_upstream_not_after_the_source_that_carries_it_is_refused(
    stopped: tuple[Series, Path, Result], release: str
) -> None:
    series, dest, _ = stopped  # 1.0 carries feature: no release up to 1.0 has it
    series_text = series.path.read_text()
    result = cli(series, "--skip", "--upstream", release, "--dir", str(dest))
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines() == [
        f"Error: --upstream {release} is not newer than 1.0, which carries feature: the "
        "first release with the change comes after 1.0"
    ]
    assert port_mod.PortState.load(dest).current == "feature"
    assert series.path.read_text() == series_text


def test_a_backwards_port_onto_a_ported_pin_is_refused_and_deletes_nothing(
    tmp_path: Path,
) -> None:
    project, series = standard_project(tmp_path)  # both pins ported, files on both
    before = {p: p.read_bytes() for p in sorted(series.dir.rglob("*")) if p.is_file()}
    result = cli(series, "--from", "2.0", "--to", "1.0", "--dir", str(tmp_path / "port"))
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines() == [
        "Error: 1.0 is older than 2.0 and already ported: porting back onto it would "
        "rewrite its committed patches (patches/1.0/); nothing was done"
    ]
    assert {p: p.read_bytes() for p in sorted(series.dir.rglob("*")) if p.is_file()} == before
    assert not (tmp_path / "port").exists()


def test_skip_marks_the_patch_upstream(stopped: tuple[Series, Path, Result]) -> None:
    series, dest, _ = stopped
    assert cli(series, "--skip", "--dir", str(dest)).exit_code == 2
    result = cli(series, "--skip", "--upstream", "1.5", "--dir", str(dest))
    assert result.exit_code == 0, result.output
    assert ["feature", "upstream", "manual", "README.txt,", "proj/feature.py"] in [
        line.split() for line in result.stdout.splitlines()
    ]
    ported = load(series.path)
    assert ported.state(ported.pin("2.0"), "feature") == PinState("upstream", "1.5")
    assert (dest / "README.txt").read_text() == README_REWRITTEN["README.txt"]
    assert check(ported) == []


def test_abort_restores_the_release(stopped: tuple[Series, Path, Result]) -> None:
    series, dest, _ = stopped
    series_text = series.path.read_text()
    stock = port_mod.PortState.load(dest).stock
    result = cli(series, "--abort", "--dir", str(dest))
    assert result.exit_code == 0, result.output
    assert f"is 2.0 stock ({stock[:12]})" in result.stdout
    assert (gitops.head(dest), gitops.status(dest)) == (stock, [])
    assert not gitops.am_in_progress(dest)
    assert not port_mod.PortState.path(dest).exists()
    assert gitops.resolve(dest, port_mod.BASE_REF) is None
    assert series.path.read_text() == series_text
    assert not series.patch_dir(series.pin("2.0")).exists()
    again = cli(series, "--continue", "--dir", str(dest))
    assert again.exit_code == 1 and "no port in progress" in again.output


def test_a_port_starts_again_in_the_directory_an_aborted_one_left(
    stopped: tuple[Series, Path, Result],
) -> None:
    series, dest, _ = stopped
    assert cli(series, "--abort", "--dir", str(dest)).exit_code == 0
    again = cli(series, "--from", "1.0", "--to", "2.0", "--dir", str(dest))
    assert again.exit_code == 1, again.output  # the same conflict, from a fresh checkout
    assert f"replacing the ended port in {dest}" in again.output
    assert "stopped: patch feature conflicts with 2.0" in again.output
    # A directory with a port in progress is never replaced.
    busy = cli(series, "--from", "1.0", "--to", "2.0", "--dir", str(dest))
    assert busy.exit_code == 1 and "a port is in progress" in busy.output


def test_a_finished_port_directory_is_replaced_by_the_next_port(tmp_path: Path) -> None:
    _, series = port_project(tmp_path)
    dest = tmp_path / "port"
    port_mod.start(series, "1.0", "2.0", dest)
    (dest / "scratch.txt").write_text("left by hand after the port\n")
    # What the user made in it is never removed: refused, naming it.
    with pytest.raises(HybridpdError, match=r"holds an ended port and changes it did not "
                       r"make \(\?\? scratch.txt\)"):
        port_mod.start(load(series.path), "1.0", "2.0", dest, replace=True)
    assert (dest / "scratch.txt").read_text() == "left by hand after the port\n"
    (dest / "scratch.txt").unlink()
    said: list[str] = []
    report = port_mod.start(load(series.path), "1.0", "2.0", dest, replace=True,
                            log=said.append)
    assert f"replacing the ended port in {dest}" in said
    assert results(report) == [("fix-add", "clean", None), ("feature", "clean", None)]


def test_abort_json_names_the_release_it_left(stopped: tuple[Series, Path, Result]) -> None:
    import json

    series, dest, _ = stopped
    stock = port_mod.PortState.load(dest).stock
    result = cli(series, "--abort", "--dir", str(dest), "--json")
    assert result.exit_code == 0, result.output
    assert list(json.loads(result.stdout).items()) == [
        ("to", "2.0"), ("dir", str(dest.absolute())), ("stock", stock)
    ]


def test_json_report_shape(tmp_path: Path) -> None:
    _, series = port_project(tmp_path, FIX_ADD)
    dest = tmp_path / "port"
    result = cli(series, "--from", "1.0", "--to", "2.0", "--dir", str(dest), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {
        "from": "1.0",
        "to": "2.0",
        "dir": str(dest),
        "patches": [
            {
                "id": "fix-add",
                "result": "upstream",
                "evidence": "reverse-applies",
                "files": ["proj/core.py"],
                "release": "2.0",
                "note": "release 2.0 is a guess (no pin records one): "
                "set the first release with it",
            },
            {
                "id": "feature",
                "result": "clean",
                "evidence": None,
                "files": ["README.txt", "proj/feature.py"],
            },
        ],
        "written": ["patches/2.0/feature.patch", "patches/series.toml"],
    }


def test_conflict_json_has_files_hunks_and_next_steps(tmp_path: Path) -> None:
    _, series = port_project(tmp_path, README_REWRITTEN)
    dest = tmp_path / "port"
    result = cli(series, "--from", "1.0", "--to", "2.0", "--dir", str(dest), "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["patches"][-1] == {
        "id": "feature",
        "result": "conflict",
        "evidence": None,
        "files": ["README.txt"],
    }
    assert report["conflict"]["files"] == [{"path": "README.txt", "hunks": [[1, 6]]}]
    assert report["conflict"]["moved"] == []
    assert report["conflict"]["next"][0].endswith(f"port --continue --dir {dest}")
    assert report["written"] == []


def test_refuses_a_busy_directory_and_bad_usage(stopped: tuple[Series, Path, Result]) -> None:
    series, dest, _ = stopped
    busy = cli(series, "--from", "1.0", "--to", "2.0", "--dir", str(dest))
    assert busy.exit_code == 1 and "a port is in progress" in busy.output
    other = dest.parent / "other"
    other.mkdir()
    (other / "file").write_text("")
    taken = cli(series, "--from", "1.0", "--to", "2.0", "--dir", str(other))
    assert taken.exit_code == 1 and "is not empty" in taken.output
    assert cli(series, "--to", "2.0").exit_code == 2
    assert cli(series, "--continue", "--abort", "--dir", str(dest)).exit_code == 2
    mismatch = cli(series, "--continue", "--to", "3.0", "--dir", str(dest))
    assert mismatch.exit_code == 2 and "from 1.0 to 2.0" in mismatch.output


def test_the_port_lock_is_held_from_the_checkout_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Once the new port's state file exists (before its first patch), a
    # `port --continue` on the same directory, from another process, is refused.
    import subprocess
    import sys

    _, series = port_project(tmp_path)
    dest = tmp_path / "port"
    save = port_mod.PortState.save
    second = []

    def save_then_probe(self, repo):
        save(self, repo)
        if not second:
            code = "import sys; from hybridpd.cli.main import main; sys.exit(main())"
            second.append(subprocess.run(
                [sys.executable, "-c", code, "--series", str(series.path), "port",
                 "--continue", "--dir", str(dest)],
                capture_output=True, text=True, timeout=60,
            ))

    monkeypatch.setattr(port_mod.PortState, "save", save_then_probe)
    port_mod.start(series, "1.0", "2.0", dest)
    (refused, *_) = second
    assert refused.returncode == 1, refused.stderr
    assert "is busy: hybridpd port" in refused.stderr


def test_a_refused_patch_is_undone_at_once_not_taken_for_an_interruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridpd import guard

    _, series = port_project(tmp_path)
    dest = tmp_path / "port"

    def refuse(repo, patch_id):
        raise port_mod.PortError(f"{patch_id}: refused")

    monkeypatch.setattr(port_mod, "_ensure_trailer", refuse)
    with pytest.raises(port_mod.PortError, match="fix-add: refused"):
        port_mod.start(series, "1.0", "2.0", dest)
    assert not (guard.git_dir(dest) / guard.JOURNAL).exists()
    assert gitops.head(dest) == port_mod.PortState.load(dest).stock
    monkeypatch.undo()
    report = port_mod.resume(series, dest, "continue")
    assert [r[1] for r in results(report)] == ["clean", "clean"]


def test_failure_before_replay_leaves_nothing(tmp_path: Path) -> None:
    _, series = port_project(tmp_path)
    # 1.0's sdist is neither cached nor on the (empty) index: the base fetch fails
    # after 2.0 was checked out.
    (cache.cache_dir() / "sdists" / "proj-1.0.tar.gz").unlink()
    dest = tmp_path / "new" / "port"
    with pytest.raises(HybridpdError, match="proj-1.0.tar.gz"):
        port_mod.start(series, "1.0", "2.0", dest)
    assert not (tmp_path / "new").exists()


def test_resume_needs_the_series_the_port_started_with(
    stopped: tuple[Series, Path, Result], tmp_path: Path
) -> None:
    series, dest, _ = stopped
    other = tmp_path / "copy" / "series.toml"
    other.parent.mkdir()
    other.write_text(series.path.read_text())
    result = CliRunner().invoke(
        main, ["--series", str(other), "port", "--continue", "--dir", str(dest)]
    )
    assert result.exit_code == 1
    assert f"was started with the series {series.path}" in result.output


def _stopped_report(series: Series, dest: Path, patch_id: str, merged: bool):
    conflict = port_mod.Conflict(patch_id, (port_mod.ConflictFile("README.txt", ()),), merged)
    return port_mod.PortReport("1.0", "2.0", dest, (), conflict=conflict)


def test_the_skip_hint_names_the_release_the_record_knows(tmp_path: Path) -> None:
    _, series = port_project(tmp_path, extra={"landed": "upstream:0.9", "later": "upstream:3.1"})
    dest = tmp_path / "port"
    steps = port_mod.next_steps(_stopped_report(series, dest, "landed", True), None, series)
    assert steps[1] == f"hybridpd port --skip --upstream 0.9 --dir {dest}"
    # A release after the target, or no upstream state at all: nothing to fill in.
    for patch_id in ("later", "feature"):
        steps = port_mod.next_steps(_stopped_report(series, dest, patch_id, True), None, series)
        assert steps[1] == f"hybridpd port --skip --upstream RELEASE --dir {dest}"


def test_a_patch_git_could_not_merge_gets_its_file_and_the_apply_commands(
    tmp_path: Path,
) -> None:
    _, series = port_project(tmp_path)
    dest = tmp_path / "port"
    patch = series.patch_path(series.pin("1.0"), "feature").resolve()
    assert port_mod.apply_by_hand(_stopped_report(series, dest, "feature", False), series) == [
        f"git -C {dest} apply --reject {patch}",
    ]
    assert port_mod.apply_by_hand(_stopped_report(series, dest, "feature", True), series) == []


def test_a_patch_on_top_of_an_earlier_one_is_merged_against_its_real_pre_image(
    tmp_path: Path,
) -> None:
    """fix-sub changes core.py after fix-add did: its pre-image is 1.0 + fix-add, a
    blob of no release. 2.0 changed a line of its context, so only a 3-way merge
    applies it, and only with the source pin's patched commits in the port."""
    from builders import commit_patch
    from hybridpd.series.export import export

    changed = {"proj/core.py": CORE.replace("def mul(a, b):", "def mul(a, b):  # times")}
    project, series = port_project(tmp_path, changed)
    project.record("fix-sub", {"1.0": "carried"})
    series = project.write()
    repo = tmp_path / "work" / "author"
    after_fix_add = (repo / "proj" / "core.py").read_text()
    commit_patch(repo, "fix-sub", {"proj/core.py": after_fix_add.replace(
        "    return a - b\n", "    diff = a - b\n    return diff\n")}, "[Core] Keep the difference")
    export(series, repo)
    series = load(series.path)

    report = port_mod.start(series, "1.0", "2.0", tmp_path / "port")

    assert report.conflict is None, report.conflict
    assert results(report) == [
        ("fix-add", "clean", None), ("feature", "clean", None), ("fix-sub", "3way", None)]
    core = (tmp_path / "port" / "proj" / "core.py").read_text()
    assert "diff = a - b" in core and "total = a + b" in core and "# times" in core


def test_a_source_series_that_does_not_apply_to_its_release_stops_the_port_cleanly(
    tmp_path: Path,
) -> None:
    _, series = port_project(tmp_path)
    patch = series.patch_path(series.pin("1.0"), "feature")
    patch.write_text(patch.read_text().replace("proj: a tiny fixture project", "proj: not it"))
    dest = tmp_path / "port"

    result = cli(series, "--from", "1.0", "--to", "2.0", "--dir", str(dest))

    assert result.exit_code == 1
    error = result.stderr.splitlines()[-1]
    assert error.startswith("Error: 1.0's own patches do not apply to its release"), error
    assert "feature" in error and "hybridpd-port-base" not in result.stderr
    assert not dest.exists()


REEXPORT = {
    "proj/core.py": '"""Moved to proj.arith."""\nfrom proj.arith import add, mul, sub\n\n'
                    '__all__ = ["add", "sub", "mul"]\n',
    "proj/arith.py": CORE.replace("    return a + b\n", "    return b + a\n"),
}


@pytest.mark.parametrize(("files", "line", "moved"), [
    # 2.0 renamed core.py and changed the line fix-add changes: git follows the rename
    # and leaves markers in the new file, and nothing said it was core.py's.
    ({"proj/core.py": None,
      "proj/arith.py": CORE.replace("    return a + b\n", "    return b + a\n")},
     "  upstream moved proj/core.py: renamed to proj/arith.py in 2.0: make the patch's "
     "change there",
     {"path": "proj/core.py", "how": "renamed", "to": ["proj/arith.py"]}),
    # 2.0 turned core.py into a module that re-exports arith's names: markers over the
    # whole file, and no word of where the code went.
    (REEXPORT,
     "  upstream moved proj/core.py: only re-exports names in 2.0; its code moved to "
     "proj/arith.py: make the patch's change there",
     {"path": "proj/core.py", "how": "re-export", "to": ["proj/arith.py"]}),
])
def test_a_stop_names_the_file_upstream_moved_and_where(
    tmp_path: Path, files: dict, line: str, moved: dict
) -> None:
    _, series = port_project(tmp_path, files)
    dest = tmp_path / "port"
    result = cli(series, "--from", "1.0", "--to", "2.0", "--dir", str(dest))
    assert result.exit_code == 1, result.output
    assert "stopped: patch fix-add conflicts with 2.0" in result.stdout
    assert line in result.stdout.splitlines(), result.stdout
    other = tmp_path / "port-json"
    result = cli(series, "--from", "1.0", "--to", "2.0", "--dir", str(other), "--json")
    assert json.loads(result.stdout)["conflict"]["moved"] == [moved], result.output


def test_a_plain_conflict_names_no_move(stopped: tuple[Series, Path, Result]) -> None:
    _, _, result = stopped
    assert "upstream moved" not in result.stdout


def test_a_port_onto_a_ported_pin_needs_replace_and_changes_nothing_without(
    tmp_path: Path,
) -> None:
    project, _ = port_project(tmp_path)
    project.unported.clear()
    project.records[0]["states"]["2.0"] = "carried"
    project.records[1]["states"]["2.0"] = "carried"
    series = project.write()
    _refused_without_a_trace(
        series, tmp_path, ("--from", "1.0", "--to", "2.0"),
        "Error: 2.0 is already ported: a port onto it rewrites its committed patches and "
        "records (patches/2.0/); pass --replace to do that (then `hybridpd test --pin 2.0` "
        "proves each upstream record)")
    bad = cli(series, "--continue", "--replace", "--dir", str(tmp_path / "port"))
    assert bad.exit_code != 0 and "--replace goes with --from and --to" in bad.output


def test_a_source_pin_that_would_lose_a_fix_the_target_lacks_is_refused(
    tmp_path: Path,
) -> None:
    """2.0 records fix-add upstream since 2.0: porting 2.0 to 1.5 would copy that
    record, and 1.5 (older than the fix) would silently lose it."""
    project, _ = port_project(tmp_path)
    project.release("1.5")
    project.unported.add("1.5")
    project.unported.discard("2.0")
    project.records[0]["states"]["2.0"] = "upstream:2.0"
    project.records[1]["states"]["2.0"] = "carried"
    series = project.write()
    pin2 = series.patch_dir(series.pin("2.0"))
    pin2.mkdir(parents=True, exist_ok=True)
    (pin2 / "feature.patch").write_bytes(
        series.patch_path(series.pin("1.0"), "feature").read_bytes())
    _refused_without_a_trace(
        series, tmp_path, ("--from", "2.0", "--to", "1.5"),
        "Error: 2.0 records fix-add upstream since a release later than 1.5, which does "
        "not have the fix, and has no patch file to replay: port from 1.0, which carries "
        "it; nothing was done")


def _refused_without_a_trace(series: Series, tmp_path: Path, args: tuple, line: str) -> None:
    """The port is refused with ``line`` last, series.toml untouched, no port directory."""
    before = series.path.read_bytes()
    result = cli(series, *args, "--dir", str(tmp_path / "port"))
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == line
    assert series.path.read_bytes() == before and not (tmp_path / "port").exists()
