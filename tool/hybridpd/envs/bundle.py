"""``hybridpd bundle``: what ``hybridpd install`` puts into a venv, carried to a host that
reaches no package index.

The bundle is made here for a target interpreter and platform other than this
machine's (``pip download --only-binary=:all: --python-version --platform``):

1. the pin's patched checkout (checked out and applied as ``install`` does, or reused);
2. the release wheel, proven to hold the stock sdist's Python files as ``build`` proves
   it, and the CUDA major its compiled ops link (``libcudart.so.N``);
3. its dependencies for the target, without the ``--reuse-host`` distributions: pip
   resolves them against a metadata-only stand-in wheel of each (so nothing of torch's
   gigabytes is fetched), and what the bundled wheels require of them is recorded, for
   the install side to check on the host before it installs anything
   (:mod:`hybridpd.envs.wheelhouse`); NIXL's build for that CUDA major at the version
   the release pins, and the ``nixl`` meta-package without its dependencies; for a CPU
   release, without what ``install`` leaves out of a CPU venv
   (:data:`hybridpd.envs.build.CPU_DROPPED`: the index's builds of them fail at import
   beside a CPU torch, and vLLM imports torchvision), stood in for the same way and
   recorded as ``dropped`` (the install side then installs the bundled wheels as they
   are, without resolving);
4. the files the patch commits change, with their sha256 (the host has no git and no
   sdist), and the overlay manifest ``build`` writes;
5. the e2e's tiny seeded models (the caller checks them against their manifests);
6. one uncompressed tar of all of it, written straight into parts of at most
   ``--split-mib`` MiB (:mod:`hybridpd.envs.parts`), and ``bundle.json`` listing every
   part and every file with its sha256 and the time each step took.

Everything is written into a temporary directory beside ``--out``, renamed at the end:
a failure leaves no half-written bundle.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from hybridpd import cache, scratch
from hybridpd import proc as proc_mod
from hybridpd.envs import build as build_mod
from hybridpd.envs import parts as parts_mod
from hybridpd.envs import pdextras
from hybridpd.envs import runkit
from hybridpd.envs import wheel_overlay as wo
from hybridpd.errors import HybridpdError, UsageError
from hybridpd.progress import Log, quiet
from hybridpd.series.model import Pin

FORMAT = 1
MANIFEST = "bundle.json"
PAYLOAD = "payload.tar"
#: glibc 2.35 (the vLLM CUDA wheels need manylinux_2_35) and every older manylinux tag.
DEFAULT_PLATFORMS = tuple(
    [f"manylinux_2_{g}_x86_64" for g in (35, 34, 31, 28, 27, 24, 17)] + ["manylinux2014_x86_64"]
)
_CUDART = re.compile(rb"libcudart\.so\.(\d+)")


class BundleError(HybridpdError):
    """A bundle step failed; one line."""


@dataclass(frozen=True)
class Target:
    """The interpreter and platform the bundle is for."""

    python_version: str  # "3.12"
    platforms: tuple[str, ...] = DEFAULT_PLATFORMS

    def __post_init__(self) -> None:
        if not re.fullmatch(r"3\.\d+", self.python_version):
            raise UsageError(f"--python-version takes MAJOR.MINOR (e.g. 3.12), not {self.python_version!r}")

    def markers(self) -> dict[str, str]:
        """The environment markers of a CPython ``python_version`` on x86-64 Linux."""
        env = dict(default_environment())
        env.update(
            python_version=self.python_version, python_full_version=f"{self.python_version}.0",
            sys_platform="linux", platform_system="Linux", platform_machine="x86_64",
            os_name="posix", implementation_name="cpython",
            platform_python_implementation="CPython", extra="",
        )
        return env

    def pip_args(self) -> list[str]:
        args = ["--only-binary=:all:", "--python-version", self.python_version,
                "--implementation", "cp"]
        for platform in self.platforms:
            args += ["--platform", platform]
        return args


def parse_reuse(spec: str | None) -> dict[str, str | None]:
    """``--reuse-host torch,triton==3.6.0`` -> ``{"torch": None, "triton": "3.6.0"}``."""
    out: dict[str, str | None] = {}
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, _, version = item.partition("==")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name.strip()) or (_ and not version):
            raise UsageError(f"--reuse-host takes NAME or NAME==VERSION, comma-separated, not {item!r}")
        out[canonicalize_name(name)] = version.strip() or None
    return out


def wheel_requirements(wheel: Path, markers: Mapping[str, str]) -> list[Requirement]:
    """The wheel's Requires-Dist (no extras) whose markers hold for ``markers``."""
    with zipfile.ZipFile(wheel) as zf:
        meta = wo.wheel_metadata(zf)
    out = []
    for line in re.findall(r"^Requires-Dist:\s*(.+)$", meta, re.M):
        req = Requirement(line.strip())
        if req.marker is None or req.marker.evaluate(dict(markers)):
            out.append(req)
    return out


def cuda_extras(
    wheels: Mapping[str, Path], cuda: str, markers: Mapping[str, str]
) -> dict[str, list[Requirement]]:
    """``{dist: requirements}``: what each wheel's ``cu<cuda>`` extra adds, for the wheels
    that offer one. nvidia-cutlass-dsl, which vLLM requires, brings its CUDA 12 libraries
    by default and its CUDA 13 ones only with ``[cu13]``."""
    extra = f"cu{cuda}"
    out = {}
    for name, wheel in sorted(wheels.items()):
        with zipfile.ZipFile(wheel) as zf:
            meta = wo.wheel_metadata(zf)
        if extra not in re.findall(r"^Provides-Extra:\s*(\S+)\s*$", meta, re.M):
            continue
        base = {str(r) for r in wheel_requirements(wheel, markers)}
        out[name] = [r for r in wheel_requirements(wheel, {**markers, "extra": extra})
                     if str(r) not in base]
    return out


def cuda_major(wheel: Path, package: str = build_mod.PACKAGE) -> str | None:
    """The CUDA major the wheel's compiled modules link (``libcudart.so.N``); None when
    none does (a CPU wheel)."""
    found = set()
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith(package + "/") and re.search(r"\.so$", name):
                with zf.open(name) as f:
                    tail = b""
                    while chunk := f.read(1 << 22):
                        found.update(_CUDART.findall(tail + chunk))
                        tail = chunk[-32:]
    if len(found) > 1:
        raise BundleError(f"{wheel.name} links several CUDA runtimes: {sorted(found)}")
    return found.pop().decode() if found else None


def stub_wheel(dest: Path, name: str, release: str) -> Path:
    """A wheel with only metadata: pip's stand-in for a distribution the host has."""
    stem = canonicalize_name(name).replace("-", "_")
    dist_info = f"{stem}-{release}.dist-info"
    files = {
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {release}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: hybridpd\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    rows = [[p, wo.record_hash(d), str(len(d))] for p, d in files.items()]
    rows.append([f"{dist_info}/RECORD", "", ""])
    files[f"{dist_info}/RECORD"] = wo.write_record(rows).encode()
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"{stem}-{release}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in files.items():
            zf.writestr(member, data)
    return path


def _satisfying(specifier) -> str:
    """A version ``specifier`` (a SpecifierSet) allows: one it names, else 0."""
    for candidate in [*(s.version for s in specifier), "0"]:
        if specifier.contains(candidate, prereleases=True):
            return candidate
    raise BundleError(f"no stand-in version satisfies {specifier}")


def _wheels(directory: Path) -> dict[str, Path]:
    """``normalized name -> wheel`` of the wheels in ``directory``."""
    out = {}
    for path in sorted(directory.glob("*.whl")):
        out[canonicalize_name(parse_wheel_filename(path.name)[0])] = path
    return out


def pip_download(
    requirements: Sequence[str | Path],
    dest: Path,
    target: Target,
    links: Path,
    *,
    no_deps: bool = False,
    python: str | Path = sys.executable,
) -> None:
    """``pip download`` for ``target`` into ``dest``; ``links`` (the cache) is offered as
    find-links, so a wheel fetched before is copied, not fetched again."""
    cmd = [python, "-m", "pip", "download", "--progress-bar", "off", "-q", *target.pip_args(),
           "--dest", dest, "--find-links", links]
    if no_deps:
        cmd.append("--no-deps")
    done = proc_mod.run([*cmd, *requirements], capture=True)
    if done.returncode != 0:
        lines = (done.stderr or "").strip().splitlines() or ["no output"]
        errors = [line for line in lines if line.startswith("ERROR")]
        # "ERROR: Exception:" is pip's own crash: its traceback's last line says why.
        tail = errors[-1] if errors and not errors[-1].endswith("Exception:") else lines[-1]
        raise BundleError(f"pip could not download {' '.join(map(str, requirements))[:200]} "
                          f"for Python {target.python_version}: {tail[:300]}")


def _cuda_extras(
    got: Mapping[str, Path], cuda: str, markers: Mapping[str, str], wheels: Path,
    target: Target, links: Path, reuse: Mapping[str, str | None],
) -> dict[str, list[Requirement]]:
    """The wheels of every dependency's ``cu<cuda>`` extra (:func:`cuda_extras`) into
    ``wheels``, each without dependencies, which must be bundled already."""
    extras = cuda_extras(got, cuda, markers)
    wanted = [f"{r.name}{r.specifier}" for reqs in extras.values() for r in reqs]
    if not wanted:
        return extras
    pip_download(wanted, wheels, target, links, no_deps=True)
    have = _wheels(wheels)
    for reqs in extras.values():
        for req in reqs:
            wheel = have.get(canonicalize_name(req.name))
            if wheel is None:
                raise BundleError(f"pip downloaded no {req.name} wheel")
            missing = sorted({canonicalize_name(r.name) for r in wheel_requirements(wheel, markers)}
                             - set(have) - set(reuse))
            if missing:
                raise BundleError(f"{wheel.name} needs {', '.join(missing)}, which the "
                                  "bundle's dependencies do not hold")
    return extras


@dataclass
class Reused:
    """A distribution the host provides: what the bundled wheels require of it."""

    name: str
    requires: list[dict] = field(default_factory=list)  # {"by": dist, "specifier": ">=1"}
    cuda: str | None = None  # the CUDA major its build must have (torch)

    def to_json(self) -> dict:
        return {"requires": self.requires, "cuda": self.cuda}


def reused_requirements(
    wheels: Mapping[str, Path], reuse: Mapping[str, str | None], markers: Mapping[str, str]
) -> dict[str, Reused]:
    """What every wheel in ``wheels`` requires of each reused distribution."""
    out = {name: Reused(name) for name in reuse}
    for by, wheel in sorted(wheels.items()):
        for req in wheel_requirements(wheel, markers):
            name = canonicalize_name(req.name)
            if name in out:
                out[name].requires.append({"by": by, "specifier": str(req.specifier)})
    return out


@dataclass
class BundleResult:
    out: Path
    manifest: dict

    @property
    def size(self) -> int:
        return sum(p["size"] for p in self.manifest["parts"])


class _Clock:
    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self.started = self._last = time.monotonic()

    def lap(self, step: str) -> None:
        now = time.monotonic()
        self.timings[step] = round(now - self._last, 1)
        self._last = now


def wheel_cache(target: Target) -> Path:
    """Where downloads for ``target`` are kept, so a second bundle fetches only what changed."""
    return cache.cache_dir() / "bundle" / "wheels" / f"cp{target.python_version.replace('.', '')}"


def check_options(out: Path, variant: str, split_mib: int | None) -> None:
    if variant not in build_mod.DISTRIBUTIONS:
        raise UsageError(f"unknown variant {variant!r} (choose {', '.join(build_mod.DISTRIBUTIONS)})")
    if split_mib is not None and split_mib < 1:
        raise UsageError(f"--split-mib takes a whole number of MiB >= 1, not {split_mib}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} exists and is not an empty directory")


def make_bundle(
    checkout: Path,
    pin: Pin,
    out: Path,
    *,
    variant: str = "cuda",
    target: Target,
    reuse: Mapping[str, str | None],
    split_mib: int | None,
    models: Sequence[Path] = (),
    links: Path | None = None,
    tool_wheels: Sequence[Path] = (),
    series_dir: Path | None = None,
    log: Log = quiet,
    clock: _Clock | None = None,
) -> BundleResult:
    """Write the bundle of the patched ``checkout`` (of ``pin``) into ``out``, which must
    not exist or be empty. With ``series_dir``, also what runs it on the host
    (:mod:`hybridpd.envs.runkit`: ``tool_wheels``, the series, ``run.sh``). BundleError
    (one line) on failure, with nothing at ``out``."""
    out = Path(out).absolute()
    check_options(out, variant, split_mib)
    clock = clock or _Clock()
    links = links or wheel_cache(target)
    links.mkdir(parents=True, exist_ok=True)
    stage = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(stage, ignore_errors=True)
    (stage / "parts").mkdir(parents=True)
    try:
        # A scratch tree: held while this process lives, swept after it dies.
        with scratch.tree("bundle-") as work:
            manifest = _make(checkout, pin, stage, work, variant, target, reuse, split_mib,
                             models, links, log, clock)
        if series_dir is not None:
            manifest["runner"] = {"script": runkit.SCRIPT,
                                  "files": runkit.write(stage, tool_wheels, series_dir)}
            clock.timings.pop("total")
            clock.lap("runner")
            clock.timings["total"] = round(time.monotonic() - clock.started, 1)
        (stage / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if out.exists():
            out.rmdir()
        stage.rename(out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return BundleResult(out, manifest)


def _make(
    checkout: Path, pin: Pin, stage: Path, work: Path, variant: str, target: Target,
    reuse: Mapping[str, str | None], split_mib: int | None, models: Sequence[Path], links: Path,
    log: Log, clock: _Clock,
) -> dict:
    distribution = build_mod.DISTRIBUTIONS[variant]
    markers = target.markers()
    wheels = work / "wheels"
    wheels.mkdir()

    # 2. The release wheel, proven stock, and the CUDA it links.
    log(f"downloading {distribution}=={pin.version} for Python {target.python_version}")
    # Not into `wheels`: the dependencies' download gets this file as a requirement and
    # copies it there (pip stops at a local file that is already at its destination).
    pip_download([f"{distribution}=={pin.version}"], work / "release", target, links,
                 no_deps=True)
    release = _wheels(work / "release").get(canonicalize_name(distribution))
    if release is None:
        raise BundleError(f"pip downloaded no {distribution} {pin.version} wheel")
    clock.lap("release wheel")
    log(f"verifying {release.name} against {pin.tag}")
    verify = build_mod.verify_release_wheel(checkout, release, pin.tag, distribution, pin.version)
    if not verify.ok:
        raise BundleError(verify.summary())
    cuda = cuda_major(release) if variant == "cuda" else None
    if variant == "cuda" and cuda is None:
        raise BundleError(f"{release.name} links no libcudart: cannot tell its CUDA build")
    clock.lap("verify")

    # 3. Its dependencies, the reused distributions standing in as metadata-only wheels.
    pins = {canonicalize_name(r.name): r.specifier for r in wheel_requirements(release, markers)}
    stubs_dir, stubs = work / "stubs", []
    for name, version in reuse.items():
        spec = pins.get(name)
        exact = version or next((s.version for s in spec or () if s.operator == "=="), None)
        if exact is not None:
            stubs.append(f"{name} @ {stub_wheel(stubs_dir, name, exact).as_uri()}")
    dropped = sorted(n for n in build_mod.CPU_DROPPED if n in pins) if variant == "cpu" else []
    for name in dropped:
        stubs.append(f"{name} @ {stub_wheel(stubs_dir, name, _satisfying(pins[name])).as_uri()}")
    nixl_name = f"nixl-cu{cuda}" if cuda else "nixl-cu12"
    nixl_req = pdextras.requirement(checkout, nixl_name)
    left_out = [*reuse, *dropped]
    log(f"downloading its dependencies and {nixl_req} (leaving out {', '.join(left_out) or 'nothing'})")
    pip_download([release, *stubs, nixl_req], wheels, target, links)
    got = _wheels(wheels)
    nixl_wheel = got.get(nixl_name)
    if nixl_wheel is None:
        raise BundleError(f"pip downloaded no {nixl_name} wheel")
    nixl_version = str(parse_wheel_filename(nixl_wheel.name)[1])
    pip_download([f"nixl=={nixl_version}"], wheels, target, links, no_deps=True)
    for name in left_out:  # the stand-ins, and a reused distribution nothing pinned
        if name in got:
            got[name].unlink()
    got = _wheels(wheels)
    extras = _cuda_extras(got, cuda, markers, wheels, target, links, reuse) if cuda else {}
    got = _wheels(wheels)
    reused = reused_requirements(got, reuse, markers)
    if "torch" in reused:
        reused["torch"].cuda = cuda
    for wheel in got.values():  # the next bundle finds them here
        cached = links / wheel.name
        if not cached.exists():
            shutil.copy2(wheel, cached)
    clock.lap("dependencies")

    # 4. The patched files and the overlay manifest.
    changes = build_mod.patch_changes(checkout, pin.tag)
    head = build_mod.gitops.resolve(checkout, "HEAD")
    stock = build_mod.gitops.resolve(checkout, pin.tag)
    overlay = build_mod.overlay_manifest(
        checkout, distribution, pin, variant, stock, head, release, wo.sha256_file(release),
        f"torch{pins['torch']}" if "torch" in pins else "", [],
    )
    overlay.pop("checkout")  # a path on this machine
    overlay_dir = work / "overlay"
    files = []
    for change in changes:
        entry = {"path": change.path, "status": change.status}
        if change.data is not None:
            target_path = overlay_dir / change.path
            target_path.parent.mkdir(parents=True, exist_ok=True)
            target_path.write_bytes(change.data)
            entry.update(sha256=hashlib.sha256(change.data).hexdigest(), size=len(change.data))
        files.append(entry)
    clock.lap("overlay")

    # 6. One tar, in parts.
    members = [(w, f"wheels/{w.name}") for w in sorted(got.values())]
    members += [(overlay_dir / f["path"], f"overlay/{f['path']}") for f in files if "sha256" in f]
    for model in models:
        members += [(p, f"models/{model.name}/{p.name}") for p in sorted(model.iterdir())]
    limit = (split_mib or 1 << 20) * parts_mod.MIB
    log(f"writing {len(members)} files into parts of at most {limit // parts_mod.MIB} MiB")
    payload_files = []
    writer = parts_mod.PartWriter(stage / "parts", PAYLOAD, limit)
    with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for path, name in members:
            payload_files.append({"name": name, "size": path.stat().st_size,
                                  "sha256": wo.sha256_file(path)})
            info = tar.gettarinfo(str(path), arcname=name)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            with open(path, "rb") as f:
                tar.addfile(info, f)
    writer.close()
    clock.lap("parts")
    clock.timings["total"] = round(time.monotonic() - clock.started, 1)
    return {
        "format": FORMAT, "tool": "hybridpd", "pin": pin.version, "variant": variant,
        "distribution": distribution, "python_version": target.python_version,
        "platforms": list(target.platforms), "cuda": cuda,
        "reuse": {name: r.to_json() for name, r in reused.items()},
        "install": [f"{distribution}=={pin.version}", f"{nixl_name}=={nixl_version}",
                    *(f"{name}[cu{cuda}]=={parse_wheel_filename(got[name].name)[1]}"
                      for name in extras)],
        "cuda_extras": {name: [str(r) for r in reqs] for name, reqs in extras.items()},
        "no_deps": [f"nixl=={nixl_version}"],
        "dropped": dropped,
        "nixl": {"distribution": nixl_name, "version": nixl_version},
        "wheels": sorted(got),
        "overlay": {"manifest": overlay, "files": files},
        "models": [m.name for m in models],
        "payload": {"stem": PAYLOAD, "size": writer.size, "sha256": writer.total.hexdigest(),
                    "files": payload_files},
        "split_mib": split_mib,
        "parts": writer.parts,
        "timings": clock.timings,
    }


def bundle(
    series,
    pin: Pin,
    out: Path,
    *,
    checkout: Path | None = None,
    variant: str = "cuda",
    target: Target,
    reuse: Mapping[str, str | None],
    split_mib: int | None,
    models: Sequence[Path] = (),
    log: Log = quiet,
) -> BundleResult:
    """:func:`make_bundle` from ``pin``'s patched checkout: ``checkout`` (created or
    reused, as ``install --dir`` does), by default one kept in the cache."""
    from hybridpd.envs.install import patched_checkout  # install imports build, as we do

    check_options(Path(out).absolute(), variant, split_mib)  # before the checkout
    clock = _Clock()
    dest = checkout or cache.cache_dir() / "bundle" / "trees" / pin.version
    dest.parent.mkdir(parents=True, exist_ok=True)
    patched_checkout(series, pin, dest, log=log)
    clock.lap("checkout")
    links = wheel_cache(target)
    links.mkdir(parents=True, exist_ok=True)
    with scratch.tree("bundle-tool-") as work:
        tool_wheels = runkit.build_tool_wheels(work / "tool", target.pip_args(), links, log=log)
        clock.lap("hybridpd wheels")
        return make_bundle(dest, pin, out, variant=variant, target=target, reuse=reuse,
                           split_mib=split_mib, models=models, links=links,
                           tool_wheels=tool_wheels, series_dir=series.path.parent, log=log,
                           clock=clock)
