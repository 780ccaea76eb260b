"""``hybridpd install``: a ready patched vLLM of a pin in one step.

checkout (from the verified sdist unless told otherwise) -> apply the pin's series ->
build a virtualenv over the release wheel. Each step is the library function the
single-step commands use; an existing checkout of the same pin is reused (apply is
idempotent), so running it again only refreshes what changed.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from hybridpd import build as build_mod
from hybridpd import cache, pdextras, serving
from hybridpd.apply import ApplyResult, apply, checkout_pin
from hybridpd.checkout import Source, checkout
from hybridpd.errors import HybridpdError
from hybridpd.series import Series

VARIANTS = ("auto", *sorted(build_mod.DISTRIBUTIONS))


def resolve_variant(variant: str) -> str:
    """``auto`` means ``cuda`` where an NVIDIA driver is visible (``nvidia-smi`` on
    PATH), else ``cpu``."""
    if variant != "auto":
        return variant
    return "cuda" if shutil.which("nvidia-smi") else "cpu"


def choose_pin(
    series: Series, variant: str, log: Callable[[str], None] = lambda _: None
) -> str:
    """The pin ``install`` builds when none is given.

    A CUDA build: the default pin. A CPU build: the newest ported pin whose CPU build
    serves here (:func:`hybridpd.serving.cpu_problem`), said in one line when it is not
    the default; when none does, the default pin, whose Python code still runs tests.
    """
    if resolve_variant(variant) != "cpu":
        return series.default_pin
    skipped = []
    for pin in sorted((p for p in series.pins if p.ported), key=lambda p: Version(p.version),
                      reverse=True):
        problem = serving.cpu_problem(
            pin.version, lambda pin=pin: cache.sdist(series.package, pin.sdist, pin.sha256)
        )
        if problem is None:
            if pin.version != series.default_pin:
                log(f"install: no GPU here: {pin.version} is the newest pin whose CPU build "
                    f"serves ({'; '.join(skipped) or 'default ' + series.default_pin}); "
                    "--pin V installs another")
            return pin.version
        skipped.append(f"{pin.version}: {problem}")
    log(f"install: no pin's CPU build serves here ({'; '.join(skipped)}); installing "
        f"{series.default_pin}, whose Python code runs tests: serving needs a GPU")
    return series.default_pin


@dataclass
class InstallResult:
    checkout: Path
    applied: ApplyResult
    build: build_mod.BuildResult


def install(
    series: Series,
    version: str,
    dest: Path,
    venv: Path,
    *,
    variant: str = "auto",
    source: Source = "sdist",
    torch: str | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> InstallResult:
    """Check out ``version`` into ``dest`` (or reuse a checkout of it there), apply
    its series and build ``venv``. Raises HybridpdError with one line on failure."""
    pin = series.pin(version)
    if dest.exists() and any(dest.iterdir()):
        found = checkout_pin(series, dest)
        if found.version != pin.version:
            raise HybridpdError(f"{dest} is a checkout of {found.version}, not {pin.version}")
        log(f"reusing the checkout of {pin.version} in {dest}")
    else:
        log(f"checking out {pin.version} into {dest}")
        checkout(series, pin.version, dest, source=source)
    applied = apply(series, dest)
    log(f"series: {len(applied.applied)} applied, {len(applied.already)} already applied")
    variant = resolve_variant(variant)
    log(f"building {venv} ({variant})")
    try:
        built = build_mod.build(dest, venv, pin.version, pin.tag, variant, torch=torch)
        pdextras.install_nixl(built.python, log)  # NixlConnector: the PD instance's transfer
    except build_mod.BuildError as exc:
        raise HybridpdError(str(exc)) from exc
    return InstallResult(dest, applied, built)
