"""What a bundle carries to run itself on a host that has only Python: hybridpd.

A bare host has no package index, no git and no hybridpd. Beside the payload parts
(:mod:`hybridpd.envs.bundle`) a bundle holds:

- ``tool/``: the hybridpd wheel (built from the source tree this hybridpd runs from) and
  its dependencies for the target interpreter, with ``tool/requirements.txt`` pinning
  each by version and sha256 (pip's ``--require-hashes`` checks them: a corrupt wheel
  is refused before anything is installed);
- ``series/``: the series directory, so the e2e resolves the pin as it does here;
- ``run.sh``: the one command an operator runs in the unpacked bundle. It installs
  hybridpd into ``venvs/tool`` with no index, keeps hybridpd's cache inside the bundle
  (``cache/``), lets GitPython load where git is absent, and hands over to
  ``hybridpd run-bundle`` (:mod:`hybridpd.e2e.offline_run`) with the arguments it got.

These files are small (a few MiB in all), each well under any part size, so they travel
as they are; ``bundle.json`` lists each with its sha256 (``runner``).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Sequence

from packaging.utils import canonicalize_name, parse_wheel_filename

from hybridpd import proc as proc_mod
from hybridpd.envs import wheel_overlay as wo
from hybridpd.errors import HybridpdError
from hybridpd.progress import Log, quiet

TOOL_DIR = "tool"
SERIES_DIR = "series"
SCRIPT = "run.sh"
REQUIREMENTS = "requirements.txt"

RUN_SH = r"""#!/bin/sh
# Install this bundle's patched and stock vLLM with no package index and run the
# prepared check; every argument goes to `hybridpd run-bundle` (./run.sh --help).
# PYTHON: the host interpreter (the one that has what the bundle reuses, e.g. torch)
# [default: python3]. Results: results/ in this directory unless --out DIR.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
py=$(command -v "${PYTHON:-python3}") || { echo "run.sh: no ${PYTHON:-python3} on PATH" >&2; exit 1; }
# No git on the host: GitPython must not refuse to import. Nothing may reach for an index.
export GIT_PYTHON_REFRESH=quiet PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export HYBRIDPD_CACHE="${HYBRIDPD_CACHE:-$here/cache}"
tool="$here/venvs/tool"
if [ ! -x "$tool/bin/hybridpd" ]; then
  echo "run.sh: installing hybridpd from $here/tool into $tool" >&2
  "$py" -m venv "$tool" && "$tool/bin/python" -m pip install -q --no-index --require-hashes \
      --find-links "$here/tool" -r "$here/tool/requirements.txt" \
    || { echo "run.sh: could not install hybridpd from $here/tool (pip's output above)" >&2; exit 1; }
fi
exec "$tool/bin/hybridpd" --series "$here/series" run-bundle "$here" --python "$py" "$@"
"""


class RunkitError(HybridpdError):
    """hybridpd cannot be carried in the bundle; one line."""


def source_root() -> Path:
    """The source tree this hybridpd is installed from (editable), for its wheel."""
    import hybridpd

    root = Path(hybridpd.__file__).resolve().parents[2]
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file() or 'name = "hybridpd"' not in pyproject.read_text():
        raise RunkitError(f"hybridpd does not run from its source tree ({root} has no "
                          "hybridpd pyproject.toml): bundle from a checkout of hybridpd")
    return root


def build_tool_wheels(
    dest: Path, pip_args: Sequence[str], links: Path, *, root: Path | None = None,
    python: str | Path = sys.executable, log: Log = quiet,
) -> list[Path]:
    """The hybridpd wheel of ``root`` and its dependencies for the target (``pip_args``:
    the target's ``--python-version``/``--platform`` flags) in ``dest``; ``links`` (the
    bundle's wheel cache) is offered first."""
    root = root or source_root()
    dest.mkdir(parents=True, exist_ok=True)
    links.mkdir(parents=True, exist_ok=True)
    built = dest.parent / f".{dest.name}-build"
    shutil.rmtree(built, ignore_errors=True)
    # From a copy: setuptools would leave build/ in the tree, and take stale files from
    # one left there before.
    source = built / "source"
    for name in ("pyproject.toml", "README.md"):
        source.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, source / name)
    shutil.copytree(root / "tool", source / "tool",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc"))
    log(f"building the hybridpd wheel from {root}")
    done = proc_mod.run([python, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", built,
                         source], capture=True)
    wheel = next(iter(sorted(built.glob("hybridpd-*.whl"))), None)
    if done.returncode != 0 or wheel is None:
        tail = (done.stderr or "").strip().splitlines()[-1:] or ["no output"]
        raise RunkitError(f"pip could not build the hybridpd wheel from {root}: {tail[0][:300]}")
    log("downloading hybridpd's dependencies for the target")
    done = proc_mod.run([python, "-m", "pip", "download", "-q", "--progress-bar", "off",
                         *pip_args, "--dest", dest, "--find-links", links, wheel], capture=True)
    shutil.rmtree(built, ignore_errors=True)
    if done.returncode != 0:
        errors = [l for l in (done.stderr or "").splitlines() if l.startswith("ERROR")]
        raise RunkitError("pip could not download hybridpd's dependencies: "
                          f"{(errors or ['no output'])[-1][:300]}")
    for path in dest.glob("*.whl"):  # the next bundle finds them here
        if not path.name.startswith("hybridpd-") and not (links / path.name).exists():
            shutil.copy2(path, links / path.name)
    return sorted(dest.glob("*.whl"))


def requirements(wheels: Sequence[Path]) -> str:
    """``name==version --hash=sha256:…`` for each wheel: pip's ``--require-hashes`` input."""
    lines = []
    for wheel in sorted(wheels, key=lambda w: w.name):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        lines.append(f"{canonicalize_name(name)}=={version} "
                     f"--hash=sha256:{wo.sha256_file(wheel)}")
    return "\n".join(lines) + "\n"


def write(stage: Path, wheels: Sequence[Path], series_dir: Path) -> list[dict]:
    """``tool/`` (``wheels`` and their requirements), ``series/`` (a copy of
    ``series_dir``) and ``run.sh`` into ``stage``; each file's record for the manifest."""
    tool = stage / TOOL_DIR
    tool.mkdir(parents=True, exist_ok=True)
    if not any(parse_wheel_filename(w.name)[0] == "hybridpd" for w in wheels):
        raise RunkitError("the tool wheels hold no hybridpd wheel")
    for wheel in wheels:
        if wheel.parent != tool:
            shutil.copy2(wheel, tool / wheel.name)
    (tool / REQUIREMENTS).write_text(requirements([tool / w.name for w in wheels]))
    shutil.copytree(series_dir, stage / SERIES_DIR,
                    ignore=shutil.ignore_patterns("__pycache__", "*.orig", "*.rej"))
    script = stage / SCRIPT
    script.write_text(RUN_SH)
    script.chmod(0o755)
    files = [script, *sorted(tool.iterdir()), *sorted(p for p in (stage / SERIES_DIR).rglob("*")
                                                       if p.is_file())]
    return [{"name": p.relative_to(stage).as_posix(), "size": p.stat().st_size,
             "sha256": wo.sha256_file(p)} for p in files]
