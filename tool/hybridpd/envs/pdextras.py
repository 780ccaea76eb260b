"""What a patched vLLM venv needs beyond vLLM to serve as a PD instance: NIXL.

vLLM's NixlConnector imports ``nixl._api``, which only the ``nixl`` meta-package
provides. The meta-package's dependencies are both CUDA variants; it reads the CUDA
major from torch and loads ``nixl-cu12`` or ``nixl-cu13``, and on a host without CUDA
whichever is installed. So the backend matching the venv's torch is installed (CPU
torch: ``nixl-cu12``, which imports on a CPU host), at the version the release pins in
``requirements/kv_connectors*.txt``, and the meta-package of the same version without
its dependencies. The result is proven by importing ``nixl._api`` in the venv.
"""

from __future__ import annotations

from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

from hybridpd import proc
from hybridpd.envs.build import BuildError
from hybridpd.progress import Log, quiet

_CUDA_MAJOR = "import torch; print((torch.version.cuda or '').split('.')[0])"
_IMPORT = "import nixl._api"


def backend(py: Path) -> str:
    """``nixl-cu13`` for a CUDA 13 torch in the venv, else ``nixl-cu12``."""
    done = proc.run([py, "-c", _CUDA_MAJOR])
    if not done.ok:
        raise BuildError(f"cannot read torch's CUDA version in {py}")
    return "nixl-cu13" if done.stdout.strip() == "13" else "nixl-cu12"


def requirement(checkout: Path, name: str) -> str:
    """``name`` with the NIXL version the release pins (``nixl-cuXX`` or ``nixl`` lines
    of ``requirements/kv_connectors_cu12.txt`` for cu12 where it exists, else of
    ``kv_connectors.txt``); ``name`` alone when the release pins none."""
    files = ["kv_connectors.txt"]
    if name == "nixl-cu12":
        files.insert(0, "kv_connectors_cu12.txt")
    for file in files:
        path = checkout / "requirements" / file
        if not path.is_file():
            continue
        found: dict[str, str] = {}
        for line in path.read_text().splitlines():
            try:
                req = Requirement(line.split("#", 1)[0].strip())
            except InvalidRequirement:
                continue
            found.setdefault(req.name.lower(), str(req.specifier))
        spec = found.get(name, found.get("nixl"))
        if spec is not None:
            return f"{name}{spec}"
    return name


def install_nixl(py: Path, checkout: Path, log: Log = quiet) -> str:
    """Install NIXL into the venv of ``py`` as the release at ``checkout`` pins it and
    prove ``nixl._api`` imports; return the installed version. BuildError on failure."""
    name = backend(py)
    req = requirement(checkout, name)
    log(f"installing {req} and nixl (without its dependencies) for NixlConnector")
    if not proc.run([py, "-m", "pip", "install", "-q", req]).ok:
        raise BuildError(f"pip could not install {req} into {py}")
    probe = proc.run([py, "-c", f"from importlib.metadata import version; print(version('{name}'))"])
    version = probe.stdout.strip()
    if not probe.ok or not version:
        raise BuildError(f"{name} is not installed in {py} after pip installed it")
    if not proc.run([py, "-m", "pip", "install", "-q", "--no-deps", f"nixl=={version}"]).ok:
        raise BuildError(f"pip could not install nixl=={version} (--no-deps) into {py}")
    imported = proc.run([py, "-c", _IMPORT])
    if not imported.ok:
        raise BuildError(
            f"nixl {version} is installed in {py} but nixl._api does not import: {imported.tail()}"
        )
    return version
