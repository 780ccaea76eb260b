from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
from builders import BASE_FILES, Project
from hybridpd import cache, gitops
from hybridpd.series.checkout import checkout
from hybridpd.errors import CheckoutError, ChecksumError, GitError, UnknownPinError
from hybridpd.series.model import Series

pytestmark = pytest.mark.usefixtures("isolated")


@pytest.fixture
def project(tmp_path: Path) -> Project:
    project = Project(tmp_path)
    project.release("1.0")
    return project


def use_index(project: Project, monkeypatch: pytest.MonkeyPatch, hashes: bool = True) -> None:
    """Serve the releases from a file:// index instead of the pre-seeded cache."""
    monkeypatch.setenv("PIP_INDEX_URL", project.index(hashes))
    for path in (cache.cache_dir() / "sdists").iterdir():
        path.unlink()


def test_sdist_checkout_is_one_tagged_reproducible_commit(project: Project, tmp_path: Path) -> None:
    series = project.write()
    result = checkout(series, series.pin("v1.0"), tmp_path / "a", source="sdist")
    repo = result.dest
    assert (result.source, result.pin.version) == ("sdist", "1.0")
    tracked = gitops.check(repo, "ls-files").split()
    assert sorted(tracked) == sorted(BASE_FILES)  # PKG-INFO and egg-info are kept
    assert gitops.resolve(repo, "v1.0") == result.head
    assert gitops.check(repo, "branch", "--show-current").strip() == "hybridpd"
    release = project.releases["1.0"]
    assert gitops.commits(repo, "HEAD")[0].subject == (
        f"proj 1.0 (sdist {release.filename} sha256 {release.sha256})"  # series.project
    )
    (repo / "proj" / "__pycache__").mkdir()
    (repo / "proj" / "__pycache__" / "core.cpython-311.pyc").write_bytes(b"")
    assert not gitops.is_dirty(repo)
    assert checkout(series, series.pin("1.0"), tmp_path / "b", source="sdist").head == result.head


def test_downloads_from_index_then_reuses_cache(
    project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    series = project.write()
    use_index(project, monkeypatch)
    checkout(series, series.pin("1.0"), tmp_path / "a", source="sdist")
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "gone").as_uri())
    checkout(series, series.pin("1.0"), tmp_path / "b", source="sdist")  # from the cache alone


def test_corrupt_cache_is_downloaded_again(
    project: Project,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    series = project.write()
    monkeypatch.setenv("PIP_INDEX_URL", project.index())
    cached = cache.cache_dir() / "sdists" / project.releases["1.0"].filename
    cached.write_bytes(b"truncated")
    checkout(series, series.pin("1.0"), tmp_path / "a", source="sdist")
    assert "re-downloading" in capsys.readouterr().err
    assert cached.read_bytes() == project.releases["1.0"].path.read_bytes()


@pytest.mark.parametrize("index_has_hashes", [True, False])
def test_hash_mismatch_leaves_nothing_behind(
    project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, index_has_hashes: bool
) -> None:
    project.sha_override["1.0"] = "f" * 64
    series = project.write()
    use_index(project, monkeypatch, hashes=index_has_hashes)
    dest = tmp_path / "new" / "src"
    with pytest.raises(ChecksumError, match=f"series.toml expects {'f' * 64}"):
        checkout(series, series.pin("1.0"), dest, source="sdist")
    assert not (tmp_path / "new").exists()
    assert list((cache.cache_dir() / "sdists").iterdir()) == []


def test_failure_empties_a_given_empty_directory(
    project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project.sha_override["1.0"] = "f" * 64
    series = project.write()
    use_index(project, monkeypatch)
    dest = tmp_path / "empty"
    dest.mkdir()
    with pytest.raises(ChecksumError):
        checkout(series, series.pin("1.0"), dest, source="sdist")
    assert dest.is_dir() and list(dest.iterdir()) == []


def test_unknown_pin_and_busy_destination(project: Project, tmp_path: Path) -> None:
    series = project.write()
    with pytest.raises(UnknownPinError, match=r"9\.9 is not a pinned version \(pins: 1\.0; `hybridpd --series patches/series\.toml pin add 9\.9`"):
        checkout(series, series.pin("9.9"), tmp_path / "a")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("")
    with pytest.raises(CheckoutError, match="not an empty directory"):
        checkout(series, series.pin("1.0"), tmp_path / "busy", source="sdist")


def cache_archive(project: Project, members: dict[str, bytes]) -> Series:
    """Replace 1.0's cached sdist by an archive of ``members`` and record its hash."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path = cache.cache_dir() / "sdists" / project.releases["1.0"].filename
    path.write_bytes(buffer.getvalue())
    project.sha_override["1.0"] = cache.file_sha256(path)
    return project.write()


@pytest.mark.parametrize(
    "members",
    [
        {"proj-1.0/a.py": b"", "proj-1.0/../../escape.py": b""},
        {"proj-1.0/a.py": b"", "other-1.0/b.py": b""},
    ],
)
def test_unsafe_or_odd_archives_are_refused(
    project: Project, tmp_path: Path, members: dict[str, bytes]
) -> None:
    series = cache_archive(project, members)
    with pytest.raises(CheckoutError, match="proj-1.0.tar.gz"):
        checkout(series, series.pin("1.0"), tmp_path / "x" / "src", source="sdist")
    assert not (tmp_path / "x").exists()
    assert not (tmp_path / "escape.py").exists()


def make_upstream(tmp_path: Path) -> str:
    """A bare repository with tag v1.0, as a file:// URL."""
    work = tmp_path / "upstream-work"
    work.mkdir()
    (work / "README.txt").write_text("from git\n")
    gitops.init(work, "main")
    gitops.commit_all(work, "upstream release")
    gitops.tag(work, "v1.0")
    bare = tmp_path / "upstream.git"
    gitops.check(tmp_path, "clone", "--quiet", "--bare", str(work), str(bare))
    return bare.as_uri()


def test_git_source_clones_the_tag(project: Project, tmp_path: Path) -> None:
    series = project.write()
    url = make_upstream(tmp_path)
    result = checkout(series, series.pin("1.0"), tmp_path / "g", source="git", git_url=url)
    assert result.source == "git" and result.fallback is None
    assert (result.dest / "README.txt").read_text() == "from git\n"
    assert gitops.resolve(result.dest, "v1.0") == result.head
    assert gitops.check(result.dest, "branch", "--show-current").strip() == "hybridpd"


def test_git_failure_is_an_error_for_git_and_a_fallback_for_auto(
    project: Project, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    series = project.write()  # upstream_git does not exist
    with pytest.raises(GitError, match="git clone failed"):
        checkout(series, series.pin("1.0"), tmp_path / "g", source="git")
    assert not (tmp_path / "g").exists()
    result = checkout(series, series.pin("1.0"), tmp_path / "a")
    assert result.source == "sdist"
    assert result.fallback and "git clone of v1.0" in result.fallback
    assert "using the sdist instead" in capsys.readouterr().err
