"""What a patched vLLM venv needs beyond vLLM to serve as a PD instance: NIXL.

vLLM's NixlConnector imports ``nixl._api``, which only the ``nixl`` meta-package
provides; the meta-package's dependencies are both CUDA variants (``nixl-cu12`` and
``nixl-cu13``), and it picks whichever backend is installed when it finds no CUDA. So
``nixl-cu12`` is installed with its dependencies and the meta-package of the same
version without them (``nixl-cu12`` alone imports on a CPU host; a CUDA 13 build may
want ``nixl-cu13``, which is not tried here).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

from hybridpd.build import BuildError

BACKEND = "nixl-cu12"


def install_nixl(py: Path, log: Callable[[str], None] = lambda _: None) -> str:
    """Install NIXL into the venv of ``py``; return its version. BuildError on failure."""
    log(f"installing {BACKEND} and nixl (without its dependencies) for NixlConnector")
    if subprocess.run([str(py), "-m", "pip", "install", "-q", BACKEND]).returncode != 0:
        raise BuildError(f"pip could not install {BACKEND} into {py}")
    probe = subprocess.run(
        [str(py), "-c", f"from importlib.metadata import version; print(version('{BACKEND}'))"],
        capture_output=True, text=True,
    )
    version = probe.stdout.strip()
    if probe.returncode != 0 or not version:
        raise BuildError(f"{BACKEND} is not installed in {py} after pip installed it")
    command = [str(py), "-m", "pip", "install", "-q", "--no-deps", f"nixl=={version}"]
    if subprocess.run(command).returncode != 0:
        raise BuildError(f"pip could not install nixl=={version} (--no-deps) into {py}")
    return version
