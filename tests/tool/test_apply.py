from __future__ import annotations

from pathlib import Path

import pytest
from builders import BASE_FILES, FIX_ADD, commit_patch, standard_project
from hybridpd import gitops
from hybridpd.series.apply import TRAILER, apply, status
from hybridpd.errors import ApplyError, DirtyTreeError, PatchCommitError, UnknownPinError

pytestmark = pytest.mark.usefixtures("isolated")


def test_apply_applies_in_order_and_is_idempotent(tmp_path: Path) -> None:
    project, series = standard_project(tmp_path)
    repo = project.checkout("1.0")
    first = apply(series, repo)
    assert (first.applied, first.already, first.upstream) == (("fix-add", "feature"), (), ())
    commits = gitops.commits(repo, "v1.0..HEAD")
    assert [c.trailer_values(TRAILER) for c in commits] == [["fix-add"], ["feature"]]
    assert commits[0].subject == "[Core] Keep the sum in a local"
    head = gitops.head(repo)
    again = apply(series, repo)
    assert (again.applied, again.already) == ((), ("fix-add", "feature"))
    assert gitops.head(repo) == head


def test_apply_is_reproducible(tmp_path: Path) -> None:
    project, series = standard_project(tmp_path)
    one, two = project.checkout("1.0", "one"), project.checkout("1.0", "two")
    apply(series, one)
    apply(series, two)
    assert gitops.head(one) == gitops.head(two)


def test_apply_finishes_a_partly_applied_checkout(tmp_path: Path) -> None:
    project, series = standard_project(tmp_path)
    repo = project.checkout("1.0")
    apply(series, repo)
    gitops.reset_hard(repo, "HEAD~1")
    result = apply(series, repo)
    assert (result.applied, result.already) == (("feature",), ("fix-add",))


def test_dirty_tree_is_refused(tmp_path: Path) -> None:
    project, series = standard_project(tmp_path)
    repo = project.checkout("1.0")
    (repo / "README.txt").write_text("edited\n")
    (repo / "scratch.py").write_text("")
    with pytest.raises(DirtyTreeError, match=r"M README.txt, \?\? scratch.py"):
        apply(series, repo)


def test_work_beside_an_applied_series_is_no_reason_to_refuse(tmp_path: Path) -> None:
    """`install` and `build` run apply on a checkout the user works in: with nothing
    left to apply, their edits and new files are kept and apply says "already"."""
    project, series = standard_project(tmp_path)
    repo = project.checkout("1.0")
    apply(series, repo)
    (repo / "README.txt").write_text("edited\n")
    (repo / "scratch.py").write_text("mine\n")
    head = gitops.head(repo)
    result = apply(series, repo)
    assert (result.applied, result.already) == ((), ("fix-add", "feature"))
    assert gitops.head(repo) == head
    assert (repo / "README.txt").read_text() == "edited\n"
    assert (repo / "scratch.py").read_text() == "mine\n"


def test_an_edit_of_a_file_a_present_patch_touched_is_no_wrong_error(tmp_path: Path) -> None:
    """2.0 has fix-add's change already; the user then edits proj/core.py. With nothing
    left to apply, apply reads nothing of the work tree (its reverse-apply check would
    see the user's edit as fix-add missing)."""
    project, series = standard_project(tmp_path, FIX_ADD)
    repo = project.checkout("2.0")
    first = apply(series, repo)
    assert (first.applied, first.upstream) == (("feature",), ("fix-add",))
    (repo / "proj" / "core.py").write_text("# the user's edit\n")
    again = apply(series, repo)
    assert (again.applied, again.already, again.upstream) == ((), ("feature",), ("fix-add",))
    assert (repo / "proj" / "core.py").read_text() == "# the user's edit\n"


def test_conflict_restores_the_checkout_exactly(tmp_path: Path) -> None:
    # 2.0 rewrote the README line `feature` changes; `fix-add` still applies first.
    project, series = standard_project(tmp_path, {"README.txt": "proj, rewritten\n"})
    repo = project.checkout("2.0")
    (repo / "ignored.pyc").write_bytes(b"")
    head, before = gitops.head(repo), gitops.status(repo)
    with pytest.raises(ApplyError, match=r"patch feature .* conflicts in README.txt; checkout"):
        apply(series, repo)
    assert gitops.head(repo) == head
    assert gitops.status(repo) == before
    assert not gitops.am_in_progress(repo)
    assert (repo / "ignored.pyc").exists()


def test_three_way_conflict_names_the_conflicted_file(tmp_path: Path) -> None:
    # Shipping 1.0's README under another name gives git the preimage blob, so
    # `git am --3way` gets as far as a real merge conflict.
    rewritten = {"README.txt": "proj, rewritten\n", "old/README.txt": BASE_FILES["README.txt"]}
    project, series = standard_project(tmp_path, rewritten)
    repo = project.checkout("2.0")
    head = gitops.head(repo)
    with pytest.raises(ApplyError, match=r"conflicts in README.txt; checkout left unchanged"):
        apply(series, repo)
    assert (gitops.head(repo), gitops.status(repo)) == (head, [])


def test_change_already_in_the_tree_is_reported_upstream(tmp_path: Path) -> None:
    project, series = standard_project(tmp_path, FIX_ADD)
    repo = project.checkout("2.0")
    before = status(series, repo)
    assert (before.applied, before.pending, before.upstream) == ((), ("feature",), ("fix-add",))
    result = apply(series, repo)
    assert (result.applied, result.upstream) == (("feature",), ("fix-add",))
    again = apply(series, repo)
    assert (again.applied, again.already, again.upstream) == ((), ("feature",), ("fix-add",))


def test_hand_made_patch_gets_its_trailer(tmp_path: Path) -> None:
    project, series = standard_project(tmp_path)
    author = project.checkout("1.0", "hand")
    sha = commit_patch(author, None, FIX_ADD, "Hand-made")
    series.patch_path(series.pin("1.0"), "fix-add").write_bytes(gitops.format_patch(author, sha))
    repo = project.checkout("1.0")
    apply(series, repo)
    first = gitops.commits(repo, "v1.0..HEAD")[0]
    assert (first.subject, first.trailer_values(TRAILER)) == ("Hand-made", ["fix-add"])


def test_commit_without_trailer_is_named(tmp_path: Path) -> None:
    project, series = standard_project(tmp_path)
    repo = project.checkout("1.0")
    commit_patch(repo, None, {"notes.txt": "wip\n"}, "WIP notes")
    with pytest.raises(
        PatchCommitError, match=r'commit [0-9a-f]{12} "WIP notes" needs exactly one'
    ):
        status(series, repo)


def test_missing_earlier_patch_is_refused(tmp_path: Path) -> None:
    project, series = standard_project(tmp_path)
    repo = project.checkout("1.0")
    assert gitops.am(repo, [series.patch_path(series.pin("1.0"), "feature")]).ok
    with pytest.raises(ApplyError, match="fix-add not applied but later patches are"):
        apply(series, repo)


def test_checkout_without_pin_tag_is_unknown(tmp_path: Path) -> None:
    _, series = standard_project(tmp_path)
    repo = tmp_path / "plain"
    repo.mkdir()
    gitops.init(repo, "main")
    gitops.commit_all(repo, "unrelated")
    with pytest.raises(UnknownPinError, match="does not descend from a pinned release tag"):
        apply(series, repo)
    with pytest.raises(UnknownPinError, match="is not a git checkout"):
        status(series, tmp_path / "nowhere")
