from __future__ import annotations

from pathlib import Path

import pytest
from hybridpd import gitops

pytestmark = pytest.mark.usefixtures("isolated")


def make_repo(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text)
    gitops.init(path, "main")
    gitops.commit_all(path, "base")
    return path


def test_commit_all_is_reproducible_across_directories(tmp_path: Path) -> None:
    one = make_repo(tmp_path / "one", {"a.txt": "a\n", "b.txt": "b\n"})
    two = make_repo(tmp_path / "two", {"b.txt": "b\n", "a.txt": "a\n"})
    assert gitops.head(one) == gitops.head(two)


def test_status_counts_untracked_files(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", {"a.txt": "a\n"})
    assert not gitops.is_dirty(repo)
    (repo / "new.txt").write_text("x\n")
    assert gitops.status(repo) == ["?? new.txt"]


def test_commits_parse_trailers(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", {"a.txt": "a\n"})
    gitops.tag(repo, "base")
    (repo / "a.txt").write_text("b\n")
    gitops.commit_all(repo, "[Core] change\n\nbody\n\nHybridpd-Patch: x\nSigned-off-by: me <m@e>\n")
    (commit,) = gitops.commits(repo, "base..HEAD")
    assert commit.subject == "[Core] change"
    assert commit.trailer_values("hybridpd-patch") == ["x"]
    assert commit.trailers == (("Hybridpd-Patch", "x"), ("Signed-off-by", "me <m@e>"))


def test_format_patch_ignores_user_diff_config(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", {"a.txt": "a\n"})
    (repo / "a.txt").write_text("b\n")
    sha = gitops.commit_all(repo, "change")
    before = gitops.format_patch(repo, sha)
    for setting in ("diff.noprefix true", "format.signature evil", "diff.context 9"):
        gitops.check(repo, "config", *setting.split())
    assert gitops.format_patch(repo, sha) == before
    assert before.startswith(b"From 0000000000000000000000000000000000000000 ")
    assert b"--- a/a.txt\n+++ b/a.txt\n" in before


def test_am_then_reverse_applies(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", {"a.txt": "a\n"})
    base = gitops.head(repo)
    (repo / "a.txt").write_text("b\n")
    patch = tmp_path / "p.patch"
    patch.write_bytes(gitops.format_patch(repo, gitops.commit_all(repo, "[Tag] change")))
    gitops.reset_hard(repo, base)
    assert not gitops.reverse_applies(repo, patch)
    assert gitops.am(repo, [patch]).ok
    assert gitops.reverse_applies(repo, patch)
    assert gitops.commits(repo, f"{base}..HEAD")[0].subject == "[Tag] change"
    assert gitops.patch_files(repo, patch) == ["a.txt"]


def test_worktree_is_removed_whatever_the_body_does(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", {"a.txt": "one\n"})
    first = gitops.head(repo)
    (repo / "a.txt").write_text("two\n")
    gitops.commit_all(repo, "two")
    tree = tmp_path / "wt"
    with pytest.raises(RuntimeError):
        with gitops.worktree(repo, first, tree):
            assert (tree / "a.txt").read_text() == "one\n"
            raise RuntimeError("body failed")
    assert not tree.exists()
    assert "wt" not in gitops.run(repo, "worktree", "list").stdout


def test_named_reads(tmp_path: Path) -> None:
    (tmp_path / "repo" / "pkg").mkdir(parents=True)
    (tmp_path / "repo" / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "repo" / "pkg" / "b.py").write_text("y = 1\n")
    gitops.init(tmp_path / "repo", "main")
    gitops.commit_all(tmp_path / "repo", "base")
    repo = tmp_path / "repo"
    base = gitops.head(repo)
    (repo / "pkg" / "a.py").write_text("x = 2\n")
    (repo / "pkg" / "b.py").unlink()
    (repo / "pkg" / "c.py").write_text("z = 1\n")
    new = gitops.commit_all(repo, "change\n\nbody\n")
    assert gitops.changed_files(repo, base, new, "pkg") == [
        ("M", "pkg/a.py"), ("D", "pkg/b.py"), ("A", "pkg/c.py")
    ]
    assert gitops.read_blob(repo, base, "pkg/a.py") == b"x = 1\n"
    assert set(gitops.tree_files(repo, new, "pkg")) == {"pkg/a.py", "pkg/c.py"}
    assert gitops.tree_files(repo, new, "pkg")["pkg/a.py"][0] == 0o100644
    assert sorted(gitops.files_of(repo, new)) == ["pkg/a.py", "pkg/b.py", "pkg/c.py"]
    assert gitops.message(repo).startswith("change\n\nbody")
    assert gitops.tree_id(repo, new) != gitops.tree_id(repo, base)
    assert not gitops.has_tracked_changes(repo, "pkg")
    (repo / "pkg" / "a.py").write_text("x = 3\n")
    assert gitops.has_tracked_changes(repo, "pkg") and gitops.has_changes(repo, "pkg/a.py")
    assert gitops.is_tracked(repo, "pkg/a.py") and not gitops.is_tracked(repo, "pkg/zz.py")
