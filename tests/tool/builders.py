"""Small builders for hybridpd tests: fixture releases, indexes, series and patches.

A fixture "release" is a tiny source tree packed like an sdist
(``proj-<version>.tar.gz`` with a ``proj-<version>/`` top directory). Patch files are
made the way maintainers make them: commit in a checkout, then ``export``.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import shutil
import tarfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from hybridpd import cache, gitops
from hybridpd.envs import wheel_overlay as wo
from hybridpd.series.apply import TRAILER
from hybridpd.series.checkout import checkout
from hybridpd.series.export import export
from hybridpd.series.model import Pin, Series, load

PACKAGE = "proj"

CORE = '''"""Core arithmetic."""


def add(a, b):
    return a + b


def sub(a, b):
    return a - b


def mul(a, b):
    return a * b
'''

BASE_FILES = {
    "PKG-INFO": "Metadata-Version: 2.1\nName: proj\n",
    "proj.egg-info/PKG-INFO": "Metadata-Version: 2.1\nName: proj\n",
    "proj/__init__.py": "",
    "proj/core.py": CORE,
    "README.txt": "proj: a tiny fixture project\n",
}

# The changes the fixture patches make, as {path: new content}.
FIX_ADD = {
    "proj/core.py": CORE.replace("    return a + b\n", "    total = a + b\n    return total\n")
}
FEATURE = {
    "proj/feature.py": "def double(x):\n    return 2 * x\n",
    "README.txt": "proj: a tiny fixture project\nNow with doubling.\n",
}


def stub_pin(version: str) -> Pin:
    """A :class:`Pin` of ``version`` outside any series (tag ``v<version>``), for the
    functions that take a pin where a test has no series."""
    return Pin(version, f"v{version}", f"{PACKAGE}-{version}.tar.gz", "0" * 64)


@dataclass(frozen=True)
class Release:
    """A packed fixture release and its sha256."""

    version: str
    path: Path

    @property
    def filename(self) -> str:
        return self.path.name

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()


def pack_release(out_dir: Path, version: str, files: dict[str, str]) -> Release:
    """Pack ``files`` as ``proj-<version>.tar.gz`` (byte-reproducible)."""
    top = f"{PACKAGE}-{version}"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{top}.tar.gz"
    with gzip.GzipFile(path, "wb", mtime=0) as gz:
        gz.write(buffer.getvalue())
    return Release(version, path)


def make_index(
    root: Path, releases: list[Release], hashes: bool = True, yanked: dict[str, str] | None = None
) -> str:
    """A PEP 503 ``file://`` simple index serving ``releases``; returns its URL.
    ``yanked``: version -> reason of releases marked yanked (PEP 592)."""
    files = root / "files"
    files.mkdir(parents=True, exist_ok=True)
    anchors = []
    for release in releases:
        shutil.copy(release.path, files / release.filename)
        fragment = f"#sha256={release.sha256}" if hashes else ""
        mark = (f' data-yanked="{yanked[release.version]}"'
                if yanked and release.version in yanked else "")
        anchors.append(f'<a href="../../files/{release.filename}{fragment}"{mark}>'
                       f'{release.filename}</a>')
    page = root / "simple" / PACKAGE / "index.html"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(f"<!DOCTYPE html><html><body>\n{chr(10).join(anchors)}\n</body></html>\n")
    return (root / "simple").as_uri()


def make_wheel(
    path: Path, files: dict[str, bytes], name: str = "pkg", version: str = "1.0"
) -> Path:
    """A minimal wheel: the files, METADATA and a RECORD with real hashes."""
    dist_info = f"{name}-{version}.dist-info"
    files = dict(files)
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    files[f"{dist_info}/METADATA"] = metadata.encode()
    rows = [[p, wo.record_hash(d), str(len(d))] for p, d in files.items()]
    rows.append([f"{dist_info}/RECORD", "", ""])
    files[f"{dist_info}/RECORD"] = wo.write_record(rows).encode()
    with zipfile.ZipFile(path, "w") as zf:
        for p, d in files.items():
            zf.writestr(p, d)
    return path


def seed_cache(release: Release) -> Path:
    """Put ``release`` in the sdist cache, as if downloaded earlier."""
    path = cache.cache_dir() / "sdists" / release.filename
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(release.path, path)
    return path


def commit_patch(repo: Path, patch_id: str | None, changes: dict[str, str], subject: str) -> str:
    """Commit ``changes`` in ``repo`` as one patch commit (trailer unless id is None)."""
    for name, text in changes.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    message = f"{subject}\n\nWhy this change exists.\n"
    if patch_id is not None:
        message += f"\n{TRAILER}: {patch_id}\n"
    return gitops.commit_all(repo, message)


@dataclass
class Project:
    """A fixture series under construction: releases, patch records, series.toml.

    Every release is put in the sdist cache and on a ``file://`` index, so checkouts
    work offline.
    """

    root: Path
    releases: dict[str, Release] = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)
    sha_override: dict[str, str] = field(default_factory=dict)
    unported: set[str] = field(default_factory=set)

    @property
    def series_path(self) -> Path:
        return self.root / "repo" / "patches" / "series.toml"

    def release(self, version: str, files: dict[str, str | None] | None = None) -> Release:
        # A file mapped to None is not in the release (upstream removed or moved it).
        files = {k: v for k, v in {**BASE_FILES, **(files or {})}.items() if v is not None}
        release = pack_release(self.root / "dist", version, files)
        self.releases[version] = release
        seed_cache(release)
        return release

    def index(self, hashes: bool = True) -> str:
        return make_index(self.root / "index", list(self.releases.values()), hashes)

    def record(self, patch_id: str, states: dict[str, str]) -> None:
        """Add a record; ``states`` maps version to "carried", "dropped" or
        "upstream:<release>"."""
        self.records.append({"id": patch_id, "states": states})

    def write(self) -> Series:
        lines = [
            "schema = 1",
            f'package = "{PACKAGE}"',
            'upstream_git = "file:///nonexistent/proj.git"',
            f'default_pin = "{next(iter(self.releases))}"',
        ]
        for version, release in self.releases.items():
            sha = self.sha_override.get(version, release.sha256)
            lines += [
                "",
                "[[pins]]",
                f'version = "{version}"',
                f'tag = "v{version}"',
                f'sdist = "{release.filename}"',
                f'sha256 = "{sha}"',
            ]
            if version in self.unported:
                lines.append("ported = false")
        for record in self.records:
            lines += ["", "[[patches]]", f'id = "{record["id"]}"']
            lines += [
                f'{key} = "{key} of {record["id"]}"'
                for key in ("title", "why", "design", "removal")
            ]
            lines.append('upstream = "example/proj#1"')
            if any(s == "dropped" for s in record["states"].values()):
                lines.append(f'dropped = "dropped of {record["id"]}. Evidence."')
            for version, state in record["states"].items():
                name, _, since = state.partition(":")
                lines += ["", f'[patches.pins."{version}"]', f'state = "{name}"']
                if since:
                    lines.append(f'release = "{since}"')
        self.series_path.parent.mkdir(parents=True, exist_ok=True)
        self.series_path.write_text("\n".join(lines) + "\n")
        return load(self.series_path)

    def checkout(self, version: str, name: str | None = None) -> Path:
        dest = self.root / "work" / (name or version)
        series = load(self.series_path)
        checkout(series, series.pin(version), dest, source="sdist")
        return dest


def standard_project(
    root: Path, pin2_files: dict[str, str] | None = None
) -> tuple[Project, Series]:
    """Pins 1.0 and 2.0, patches fix-add then feature, both carried on both pins.

    The patch files of 1.0 are exported from real commits and copied to 2.0, whose
    tree is 1.0's plus ``pin2_files``.
    """
    project = Project(root)
    project.release("1.0")
    project.release("2.0", pin2_files)
    project.record("fix-add", {"1.0": "carried", "2.0": "carried"})
    project.record("feature", {"1.0": "carried", "2.0": "carried"})
    series = project.write()
    repo = project.checkout("1.0", "author")
    commit_patch(repo, "fix-add", FIX_ADD, "[Core] Keep the sum in a local")
    commit_patch(repo, "feature", FEATURE, "Add doubling")
    export(series, repo)
    shutil.copytree(series.dir / "1.0", series.dir / "2.0")
    return project, series


def port_project(
    root: Path, pin2_files: dict[str, str] | None = None, extra: dict[str, str] | None = None
) -> tuple[Project, Series]:
    """Pins 1.0 and 2.0 (not ported), patches fix-add then feature carried on 1.0.

    ``extra`` adds records (id -> state on 1.0, e.g. "upstream:0.9") after them.
    series.toml starts with a comment, which a port must keep.
    """
    project = Project(root)
    project.release("1.0")
    project.release("2.0", pin2_files)
    project.unported.add("2.0")
    project.record("fix-add", {"1.0": "carried"})
    project.record("feature", {"1.0": "carried"})
    for patch_id, state in (extra or {}).items():
        project.record(patch_id, {"1.0": state})
    series = project.write()
    series.path.write_text("# Keep this comment.\n" + series.path.read_text())
    repo = project.checkout("1.0", "author")
    commit_patch(repo, "fix-add", FIX_ADD, "[Core] Keep the sum in a local")
    commit_patch(repo, "feature", FEATURE, "Add doubling")
    export(series, repo)
    return project, load(series.path)


def killed_apply(series, repo: Path) -> None:
    """Run `hybridpd apply` on ``repo`` and SIGKILL it after its first patch: the
    checkout holds a half-applied series and the apply's journal."""
    import os
    import signal
    import subprocess
    import sys

    from hybridpd import guard

    code = "import sys; from hybridpd.cli.main import main; sys.exit(main())"
    killed = subprocess.run(
        [sys.executable, "-c", code, "--series", str(series.path), "apply", "--dir", str(repo)],
        env={**os.environ, guard.FAULT_ENV: "apply:patch-2"}, capture_output=True, text=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (guard.git_dir(repo) / guard.JOURNAL).is_file()
