"""Local file system trouble and concurrent writers: one line, nothing half-done.

Covers issue 11's cases: a ``--dir`` whose parent is a file or cannot be written,
``HYBRIDPD_CACHE`` that is a file, an empty repository, a cache entry that is a
directory, a local write error during a download, and two processes on one new
directory or one cache entry.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from builders import PACKAGE, Project, standard_project
from click.testing import CliRunner
from hybridpd import cache, gitops, guard, pkgindex
from hybridpd.cli.main import main
from hybridpd.errors import LocalFileError

pytestmark = pytest.mark.usefixtures("isolated")

CLI = "import sys; from hybridpd.cli.main import main; sys.exit(main())"


def run(series_path: Path, *args: str):
    return CliRunner().invoke(main, ["--series", str(series_path), *args])


def one_error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ")
    return lines[0].removeprefix("Error: ")


@pytest.fixture
def project(tmp_path: Path) -> Project:
    project = Project(tmp_path)
    project.release("1.0")
    project.write()
    return project


def test_a_dir_under_a_file_is_one_line(project: Project, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    result = run(project.series_path, "checkout", "1.0", "--dir", str(tmp_path / "afile" / "sub"))
    assert result.exit_code == 1
    assert one_error_line(result) == f"local file system: {tmp_path / 'afile' / 'sub'}: Not a directory"


def test_a_dir_that_cannot_be_created_is_one_line(
    project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A read-only parent, as a user other than root sees it (root may write anywhere).
    real_mkdir = Path.mkdir

    def mkdir(self: Path, *args, **kwargs) -> None:
        if self.name == "sub":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    result = run(project.series_path, "checkout", "1.0", "--dir", str(tmp_path / "ro" / "sub"))
    assert result.exit_code == 1
    assert one_error_line(result) == (
        f"local file system: {tmp_path / 'ro' / 'sub'}: Permission denied"
    )


def test_a_cache_that_is_a_file_is_one_line(
    project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cachefile").write_text("")
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cachefile"))
    result = run(project.series_path, "checkout", "1.0", "--dir", str(tmp_path / "a"),
                 "--source", "sdist")
    assert result.exit_code == 1
    assert one_error_line(result) == (
        f"local file system: {tmp_path / 'cachefile' / 'sdists'}: Not a directory"
    )
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("command", ["apply", "status", "export"])
def test_an_empty_repository_is_one_line(project: Project, tmp_path: Path, command: str) -> None:
    repo = tmp_path / "empty"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    result = run(project.series_path, command, "--dir", str(repo))
    assert result.exit_code == 1
    assert one_error_line(result) == (
        f"{repo} is a git repository without commits (see hybridpd checkout)"
    )


def test_a_cache_entry_that_is_a_directory_is_reported_before_any_download(
    project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = project.releases["1.0"]
    entry = cache.cache_dir() / "sdists" / release.filename
    entry.unlink()
    entry.mkdir()
    monkeypatch.setattr(pkgindex, "find_file", lambda *a: pytest.fail("looked up the index"))
    result = run(project.series_path, "checkout", "1.0", "--dir", str(tmp_path / "a"),
                 "--source", "sdist")
    assert result.exit_code == 1
    assert one_error_line(result) == f"cache entry {entry} is not a file; remove it and run again"


def test_a_local_write_error_while_downloading_is_not_a_network_error(
    project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = project.releases["1.0"]
    url = project.index()
    settings = pkgindex.PipSettings(index_urls=(url,))
    found = pkgindex.find_file(PACKAGE, release.filename, settings)

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path))

    monkeypatch.setattr(pkgindex.tempfile, "mkstemp", full)
    with pytest.raises(LocalFileError, match=f"local file system: {tmp_path}: No space left"):
        pkgindex.download(found.url, tmp_path / release.filename, release.sha256, settings)


class _FailingFile:
    """The temporary file of a download whose write or flush hits a full disk."""

    def __init__(self, real, fail_on: str):
        self.real, self.fail_on = real, fail_on

    def __enter__(self):
        self.real.__enter__()
        return self

    def __exit__(self, *exc):
        return self.real.__exit__(*exc)

    def write(self, data):
        if self.fail_on == "write":
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.real.write(data)

    def flush(self):
        if self.fail_on == "flush":
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.real.flush()


@pytest.mark.parametrize("fail_on", ["write", "flush", "replace"])
def test_a_full_disk_or_a_refused_rename_while_downloading_leaves_nothing(
    project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_on: str
) -> None:
    release = project.releases["1.0"]
    settings = pkgindex.PipSettings(index_urls=(project.index(),))
    found = pkgindex.find_file(PACKAGE, release.filename, settings)
    dest = tmp_path / "dl" / release.filename
    dest.parent.mkdir()
    if fail_on == "replace":
        def refuse(src, dst):
            raise OSError(errno.EACCES, "Permission denied", str(dst))

        monkeypatch.setattr(pkgindex.os, "replace", refuse)
        message = f"local file system: {dest}: Permission denied"
    else:
        real_fdopen = pkgindex.os.fdopen
        monkeypatch.setattr(
            pkgindex.os, "fdopen", lambda *a, **k: _FailingFile(real_fdopen(*a, **k), fail_on)
        )
        message = rf"local file system: {dest.parent}/\.{release.filename}\..*\.part: No space left"
    with pytest.raises(LocalFileError, match=message):
        pkgindex.download(found.url, dest, release.sha256, settings)
    assert list(dest.parent.iterdir()) == []  # no partial file, no temporary file


# --------------------------------------------------------------------------- concurrency


def cli(series_path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CLI, "--series", str(series_path), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_concurrent_checkouts_into_one_new_directory(project: Project, tmp_path: Path) -> None:
    dest = tmp_path / "new" / "tree"
    procs = [cli(project.series_path, "checkout", "1.0", "--dir", str(dest), "--source", "sdist")
             for _ in range(4)]
    outcomes = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    for code, err in outcomes:
        assert "Traceback" not in err, err
        assert code == 0 or (
            err.strip().startswith("Error: ")
            and ("is busy" in err or "already exists and is not an empty directory" in err)
        ), err
    assert sum(code == 0 for code, _ in outcomes) >= 1
    assert gitops.resolve(dest, "v1.0") == gitops.head(dest)
    assert not gitops.is_dirty(dest)


def test_a_checkout_into_a_directory_being_written_fails_and_touches_nothing(
    project: Project, tmp_path: Path
) -> None:
    dest = tmp_path / "tree"
    dest.mkdir()
    with guard.directory(dest):
        result = subprocess.run(
            [sys.executable, "-c", CLI, "--series", str(project.series_path),
             "checkout", "1.0", "--dir", str(dest), "--source", "sdist"],
            capture_output=True, text=True, timeout=120,
        )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"Error: {dest} is busy: another hybridpd process is writing it; run again when it ends"
    ]
    assert dest.is_dir() and list(dest.iterdir()) == []


def test_a_port_into_a_directory_being_written_fails_and_touches_nothing(tmp_path: Path) -> None:
    _, series = standard_project(tmp_path)
    dest = tmp_path / "port"
    dest.mkdir()
    with guard.directory(dest):
        result = subprocess.run(
            [sys.executable, "-c", CLI, "--series", str(series.path),
             "port", "--from", "1.0", "--to", "2.0", "--dir", str(dest), "--replace"],
            capture_output=True, text=True, timeout=120,
        )
    assert result.returncode == 1
    assert "is busy: another hybridpd process is writing it" in result.stderr
    assert list(dest.iterdir()) == []


def test_a_second_download_of_one_cache_entry_waits_for_the_first(
    project: Project, tmp_path: Path
) -> None:
    release = project.releases["1.0"]
    entry = cache.cache_dir() / "sdists" / release.filename
    waiting = f"waiting for another hybridpd process that is writing {entry}"
    lines: list[str] = []
    with cache.lock(entry, lambda _m: None):
        proc = cli(project.series_path, "checkout", "1.0", "--dir", str(tmp_path / "a"),
                   "--source", "sdist")
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(waiting in line for line in lines):
            time.sleep(0.1)
        assert any(waiting in line for line in lines), lines
        assert proc.poll() is None  # held up while the entry is ours
    assert proc.wait(timeout=120) == 0, lines
    reader.join(timeout=10)
    assert gitops.resolve(tmp_path / "a", "v1.0") == gitops.head(tmp_path / "a")


def test_a_closed_stdout_is_not_a_local_file_error(
    project: Project, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `hybridpd list --json | head`: click ends quietly on EPIPE, as before.
    from hybridpd.cli import jsonout

    def closed(_data) -> None:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(jsonout, "emit", closed)
    result = run(project.series_path, "list", "--json")
    assert result.exit_code == 1
    assert "local file system" not in result.stderr and "Error" not in result.stderr


@pytest.mark.parametrize("url", ["notaurl", "http://bad host/", "http://[::1"])
@pytest.mark.parametrize("command", ["checkout", "install"])
def test_an_unusable_index_url_is_one_line(
    project: Project, tmp_path: Path, url: str, command: str
) -> None:
    (cache.cache_dir() / "sdists" / "proj-1.0.tar.gz").unlink()  # it must be downloaded
    args = (["checkout", "1.0", "--dir", str(tmp_path / "src")] if command == "checkout"
            else ["install", "--pin", "1.0", "--dir", str(tmp_path / "src"),
                  "--venv", str(tmp_path / "venv")])
    env = {**os.environ, "PIP_INDEX_URL": url}
    result = subprocess.run([sys.executable, "-c", CLI, "--series", str(project.series_path),
                             *args], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("Error: proj-1.0.tar.gz not found") and (
        "is not a usable index URL" in error and "check PIP_INDEX_URL" in error
    ), result.stderr
