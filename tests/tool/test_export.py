from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from builders import FIX_ADD, Project, commit_patch, standard_project
from hybridpd import gitops
from hybridpd.series.apply import apply
from click.testing import CliRunner
from hybridpd.cli.main import main
from hybridpd.errors import ExportError, PatchCommitError
from hybridpd.series.export import check, export
from hybridpd.series.model import Pin, Series

pytestmark = pytest.mark.usefixtures("isolated")


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.patch"))}


def test_export_is_byte_stable(tmp_path: Path) -> None:
    project, series = standard_project(tmp_path)
    patch_dir = series.patch_dir(series.pin("1.0"))
    exported = snapshot(patch_dir)
    author = project.root / "work" / "author"
    again = export(series, author)
    assert (again.written, again.unchanged) == ((), ("fix-add", "feature"))
    assert snapshot(patch_dir) == exported
    # Applying the files to a fresh checkout and exporting reproduces them exactly.
    shutil.rmtree(patch_dir)
    shutil.copytree(series.patch_dir(series.pin("2.0")), patch_dir)
    repo = project.checkout("1.0", "fresh")
    apply(series, repo)
    export(series, repo, tmp_path / "out")
    assert snapshot(tmp_path / "out") == exported


def test_export_removes_dropped_patches_only_with_prune(tmp_path: Path) -> None:
    project, series = standard_project(tmp_path)
    repo = project.checkout("1.0")
    apply(series, repo)
    gitops.reset_hard(repo, "HEAD~1")  # drop `feature`, which series.toml carries
    commit_patch(repo, "brand-new", {"new.txt": "new\n"}, "Brand new")
    before = snapshot(series.patch_dir(series.pin("1.0")))
    with pytest.raises(ExportError, match=r"1 patch\(es\) carried on 1.0 have no commit in .*: feature"):
        export(series, repo)
    assert snapshot(series.patch_dir(series.pin("1.0"))) == before  # nothing written
    result = export(series, repo, prune=True)
    assert (result.written, result.removed, result.unrecorded) == (
        ("brand-new",),
        ("feature",),
        ("brand-new",),
    )
    assert sorted(snapshot(series.patch_dir(series.pin("1.0")))) == [
        "brand-new.patch",
        "fix-add.patch",
    ]


def test_export_of_an_unapplied_checkout_keeps_the_series(tmp_path: Path) -> None:
    project, series = standard_project(tmp_path)
    repo = project.checkout("1.0")  # stock: no patch commits
    patch_dir = series.patch_dir(series.pin("1.0"))
    before = snapshot(patch_dir)
    result = CliRunner().invoke(main, ["--series", str(series.path), "export", "--dir", str(repo)])
    assert result.exit_code == 1
    assert "2 patch(es) carried on 1.0 have no commit" in result.output
    assert "fix-add, feature" in result.output or "feature, fix-add" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert snapshot(patch_dir) == before
    assert check(series, round_trip=False) == []


def test_export_keeps_a_file_it_does_not_know_unless_pruned(tmp_path: Path) -> None:
    # my-wip.patch: no record, no commit (the user's own); dropped.patch: a record.
    project, _ = standard_project(tmp_path)
    project.record("dropped", {"1.0": "dropped", "2.0": "dropped"})
    series = project.write()
    repo = project.checkout("1.0")
    apply(series, repo)
    wip = series.patch_dir(series.pin("1.0")) / "my-wip.patch"
    wip.write_text("my work in progress\n")
    known = series.patch_dir(series.pin("1.0")) / "dropped.patch"
    known.write_text("x")
    result = CliRunner().invoke(main, ["--series", str(series.path), "export", "--dir", str(repo)])
    assert result.exit_code == 0, result.output
    assert "removed   1.0/dropped.patch" in result.output
    assert "kept 1.0/my-wip.patch: no record and no commit; --prune removes it" in result.output
    assert wip.read_text() == "my work in progress\n" and not known.exists()
    assert export(series, repo, prune=True).removed == ("my-wip",)
    assert not wip.exists()


def test_export_refuses_a_commit_without_trailer(tmp_path: Path) -> None:
    project, series = standard_project(tmp_path)
    repo = project.checkout("1.0")
    commit_patch(repo, None, {"x.txt": "x\n"}, "Quick fix")
    before = snapshot(series.patch_dir(series.pin("1.0")))
    with pytest.raises(PatchCommitError, match=r'"Quick fix" needs exactly one "Hybridpd-Patch'):
        export(series, repo)
    assert snapshot(series.patch_dir(series.pin("1.0"))) == before


def test_check_passes_on_a_freshly_exported_series(tmp_path: Path) -> None:
    _, series = standard_project(tmp_path)
    assert check(series) == []


def test_check_finds_a_stale_patch_file(tmp_path: Path) -> None:
    project, series = standard_project(tmp_path)
    # Plain `git format-patch` output: applies fine, but is not what export writes.
    plain = gitops.check(project.root / "work" / "author", "format-patch", "-1", "--stdout")
    assert plain.startswith("From ") and "[PATCH] Add doubling" in plain
    series.patch_path(series.pin("2.0"), "feature").write_text(plain)
    assert check(series) == ["patches/2.0/feature.patch: not up to date (run hybridpd export)"]
    assert check(series, round_trip=False) == []


def test_check_finds_records_and_files_that_disagree(tmp_path: Path) -> None:
    project, _ = standard_project(tmp_path)
    project.record("dropped", {"1.0": "carried", "2.0": "upstream:2.0"})
    project.records[0]["states"]["2.0"] = "upstream:2.0"  # fix-add, whose 2.0 file exists
    series = project.write()
    patches = series.dir
    (patches / "1.0" / "orphan.patch").write_text("")
    (patches / "0.9").mkdir()
    (patches / "0.9" / "old.patch").write_text("")
    assert check(series, round_trip=False) == [
        "patches/0.9/: patch directory for 0.9, which is not a pin",
        "patches/1.0/dropped.patch: missing (carried on 1.0)",
        "patches/1.0/orphan.patch: no record in series.toml",
        "patches/2.0/fix-add.patch: patch is upstream in 2.0 (since 2.0); delete the file",
    ]


def test_check_refuses_a_patch_file_not_authored_by_the_project(tmp_path: Path) -> None:
    # A committed patch carries the neutral project identity; a person's or an invented
    # organisation's (here folded over two lines, as git writes a long one) is refused.
    _, series = standard_project(tmp_path)
    path = series.patch_path(series.pin("1.0"), "feature")
    text = path.read_text()
    assert "From: hybridpd <hybridpd@localhost>\n" in text
    path.write_text(
        text.replace(
            "From: hybridpd <hybridpd@localhost>\n",
            "From: Some maintainers\n <maintainers@example.org>\n",
        )
    )
    assert check(series, round_trip=False) == [
        "patches/1.0/feature.patch: authored by 'Some maintainers <maintainers@example.org>'; "
        "committed patches carry the project identity 'hybridpd <hybridpd@localhost>' "
        "(export-pr sets the submitter's)"
    ]


def test_check_refuses_the_file_of_a_dropped_patch(tmp_path: Path) -> None:
    project, _ = standard_project(tmp_path)
    project.records[1]["states"]["2.0"] = "dropped"  # feature, whose 2.0 file exists
    series = project.write()
    assert check(series, round_trip=False) == [
        "patches/2.0/feature.patch: patch is dropped on 2.0; delete the file"
    ]
    series.patch_path(series.pin("2.0"), "feature").unlink()
    assert check(series) == []


def test_check_reports_a_carried_patch_already_in_the_release(tmp_path: Path) -> None:
    _, series = standard_project(tmp_path, FIX_ADD)
    assert check(series) == [
        "patches/2.0/fix-add.patch: already in 2.0; mark it upstream and delete the file"
    ]


def test_check_uses_the_injected_checkout(tmp_path: Path) -> None:
    project, series = standard_project(tmp_path)
    made: list[str] = []

    def fresh(series: Series, pin: Pin, dest: Path) -> None:
        made.append(pin.version)
        shutil.copytree(project.checkout(pin.version, f"fresh-{pin.version}"), dest)

    assert check(series, fresh_checkout=fresh) == []
    assert made == ["1.0", "2.0"]


def test_check_skips_pins_without_carried_patches(tmp_path: Path) -> None:
    project = Project(tmp_path)
    project.release("1.0")
    project.record("gone", {"1.0": "upstream:0.9"})
    series = project.write()

    def no_checkout(series: Series, pin: Pin, dest: Path) -> None:
        raise AssertionError("nothing to verify, so nothing to check out")

    assert check(series, fresh_checkout=no_checkout) == []


def test_a_write_cut_short_never_leaves_a_half_written_patch_file(tmp_path: Path) -> None:
    # A file size limit makes the write of feature.patch fail halfway (EFBIG), as a
    # kill or a full disk would cut it: the file holds its old bytes or its new ones.
    import resource
    import subprocess
    import sys

    project, series = standard_project(tmp_path)
    repo = project.checkout("1.0")
    apply(series, repo)
    target = series.patch_path(series.pin("1.0"), "feature")
    new = target.read_bytes()
    target.write_bytes(b"an older export\n")
    limit = len(new) // 2

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    code = "import sys; from hybridpd.cli.main import main; sys.exit(main())"
    result = subprocess.run(
        [sys.executable, "-c", code, "--series", str(series.path), "export", "--dir", str(repo)],
        capture_output=True, text=True, preexec_fn=small_files, timeout=120,
    )
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("Error: local file system: ") and "File too large" in line
    assert target.read_bytes() == b"an older export\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["feature.patch", "fix-add.patch"]
    # A writer killed mid-write leaves its temporary file: the next export removes it
    # (never one of a writer still running), then writes the file whole.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    left = target.with_name(f".feature.patch.{dead}.hybridpd-tmp")
    left.write_bytes(new[:limit])
    live = target.with_name(".feature.patch.1.hybridpd-tmp")  # pid 1 runs
    live.write_bytes(b"a live writer's\n")
    assert export(series, repo).written == ("feature",)
    assert target.read_bytes() == new
    assert not left.exists() and live.exists()


def test_check_refuses_an_upstream_record_from_a_later_release(tmp_path: Path) -> None:
    """A fix cannot be upstream on a pin older than the release that first shipped it
    (a backwards port once wrote 0.20.2 "upstream since 0.23.0" and check said ok)."""
    project, _ = standard_project(tmp_path)
    project.records[1]["states"]["1.0"] = "upstream:2.0"  # feature, upstream "since 2.0" on 1.0
    series = project.write()
    series.patch_path(series.pin("1.0"), "feature").unlink()
    assert check(series, round_trip=False) == [
        "series.toml: feature on 1.0: upstream since 2.0, a later release than the pin"
    ]
    project.records[1]["states"]["1.0"] = "upstream:next"
    series = project.write()
    assert check(series, round_trip=False) == [
        "series.toml: feature on 1.0: upstream since 'next', which is not a release"
    ]
    project.records[1]["states"]["1.0"] = "upstream:1.0"
    assert check(project.write(), round_trip=False) == []
