"""CPU-only virtual environments for running vLLM's own unit tests.

One environment per pinned vLLM release, at ``<cache_dir>/envs/<version>-cpu/``.
It holds a CPU torch, the release's ``requirements/common.txt`` and the few test-only
packages the selected upstream test files import at module level (see
``TEST_PACKAGES``). vLLM itself is **not** installed: the tests select a source tree
with ``PYTHONPATH=<tree>`` and find vLLM's metadata in the sdist's in-tree
``vllm.egg-info`` (see :mod:`hybridpd.proof.pytestrun`). The same environment therefore
serves the stock and the patched tree of a release.

Invariants:

- An environment is reused only when its marker file (``MARKER_NAME``) exists and
  records the same input hash. The marker is written last, atomically, so a build that
  was interrupted is never reused; it is deleted and rebuilt instead.
- The input hash covers everything that decides what gets installed: the release
  version, the text of ``requirements/common.txt`` after relaxations, the torch spec,
  the test requirement lines, the Python version and ``ENV_SCHEMA``.
- Packages come from pip with pip's own configuration (``pip.conf``, ``PIP_*``
  variables: indexes, find-links, constraints, certificates). No index host is named
  here. uv is not used: it does not read pip's configuration files, and translating
  them (``find-links``, ``extra-index-url``, ``constraint``) is one more thing to get
  wrong for a build that happens once per release and is cached.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from hybridpd import cache, proc, progress
from hybridpd.errors import HybridpdError
from hybridpd.progress import Log, quiet
from hybridpd.series.model import Pin

#: Bump when the way an environment is built changes, so old environments are rebuilt.
ENV_SCHEMA = 1

#: File written into the venv when (and only when) it is complete.
MARKER_NAME = "hybridpd-env.json"

#: Environment variable that overrides the default torch requirement.
TORCH_ENV_VAR = "HYBRIDPD_TORCH"

#: Default torch requirement.
#:
#: Why 2.13.0: the unit tests we run load no compiled vLLM extension, so they do not
#: need the exact torch a release was built against (0.20.2 pins 2.11, 0.32.0 2.13,
#: 0.33.0 2.14); they need *a* torch that imports without a GPU and that vLLM's Python
#: accepts. 2.13.0 is the version whose CPU build (``2.13.0+cpu``) this project's
#: machines serve from local find-links, and pip prefers ``2.13.0+cpu`` over a plain
#: ``2.13.0`` from an index (a local version label sorts higher), so the spec yields the
#: CPU build wherever that wheel is offered. Where it is not (plain PyPI), it yields
#: the CUDA build, which also imports on a CPU-only machine but weighs several GB; set
#: ``HYBRIDPD_TORCH=torch==2.13.0+cpu`` and point pip (``PIP_EXTRA_INDEX_URL``) at a
#: CPU wheel index there. The build checks that the installed torch imports and logs
#: whether it is a CUDA build.
DEFAULT_TORCH_SPEC = "torch==2.13.0"

#: Test-only packages, with the reason each is needed. Versions are taken from the
#: release's own test lock file (``TEST_LOCK_FILES``) when it pins them. This is the
#: minimum for the files in :mod:`hybridpd.proof.upstream`, not the whole test lock file.
TEST_PACKAGES: dict[str, str] = {
    "pytest": "the runner",
    "pytest-asyncio": "async tests in the connector unit tests",
    "pytest-timeout": "per-test timeout, so one hung test cannot eat the run",
    "tblib": "imported at module level by tests/conftest.py",
    "ray": "imported at module level by tests/v1/kv_connector/unit/test_nixl_connector.py",
    "hypothesis": "the property-based Mamba-state tests in tests/patches",
}

#: Lock files a release may carry for its test dependencies, first match wins.
TEST_LOCK_FILES = (
    "requirements/test/cpu.txt",
    "requirements/test/cuda.txt",
    "requirements/test.txt",
)


@dataclasses.dataclass(frozen=True)
class Relaxation:
    """One requirement line of ``requirements/common.txt`` we deliberately change.

    ``package`` names the requirement (PEP 503 normalised comparison); the line is
    replaced by ``replacement`` (an empty string drops it). Applied only when the line is
    present, so a relaxation that no longer matches a release is a no-op, not an error.
    """

    package: str
    replacement: str
    reason: str


#: Every change we make to a release's common.txt. Keep it short and say why.
RELAXATIONS: tuple[Relaxation, ...] = (
    # vLLM 0.33.0 asks for certifi>=2026.10.19, newer than any certifi the package
    # index serves (2026.10.18 is the newest); the line alone makes the install fail.
    # certifi only supplies a CA bundle, which no unit test depends on.
    Relaxation(
        package="certifi",
        replacement="certifi",
        reason="0.33.0 pins certifi>=2026.10.19, newer than the index serves",
    ),
)


class TestEnvError(HybridpdError):
    """The environment could not be built."""


@dataclasses.dataclass(frozen=True)
class Layer:
    """Packages the patch tests import that cannot join the environment's package set.

    Installed with ``pip --no-deps --target`` into ``<env>.layers/<name>/`` and put on
    ``PYTHONPATH`` after the source tree for the patch tests only (vLLM's own suites
    never see them). ``requirements`` pin every distribution installed, dependencies
    included: nothing is resolved. ``releases`` (PEP 440) are the vLLM releases whose
    patch tests use it.
    """

    name: str
    requirements: tuple[str, ...]
    releases: str
    reason: str


#: Every layer, and why it is one.
LAYERS: tuple[Layer, ...] = (
    Layer(
        name="lmcache",
        requirements=(
            "lmcache==0.5.6", "aiofile==3.12.3", "caio==0.12.10", "numba==0.68.1",
            "llvmlite==0.50.0",
        ),
        releases=">=0.20",  # its scheduler side runs on every pin (v0.20.2 included)
        reason=(
            "LMCache's real vLLM adapter for tests/patches/lmcache. lmcache's own pins "
            "would downgrade numpy, protobuf, opentelemetry, prometheus_client and "
            "setuptools below what vLLM's requirements install, so only lmcache and the "
            "two modules its adapter imports that the environment lacks are added. Its "
            "compiled CUDA ops are stubbed by the tests. numba (and its llvmlite): "
            "lmcache's CPU device ops need it; the LMCache series' patch tests run "
            "lmcache's server and take lmcache's compiled modules from this layer."
        ),
    ),
    Layer(
        name="lmcache-tests",
        requirements=("redis==8.1.0",),
        releases=">=0.20",
        reason=(
            "LMCache's own test suite: its tests/conftest.py patches redis in autouse "
            "fixtures, so the upstream-style LMCache tests export-pr --verify runs "
            "(data/upstream_tests/lmcache-*) need it. A layer of its own, so that the "
            "lmcache layer the patch tests use does not change for it."
        ),
    ),
)


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _requirement_name(line: str) -> str | None:
    """The project name of a requirement line, or None for comments and options."""
    stripped = line.split("#", 1)[0].strip()
    if not stripped or stripped.startswith("-"):
        return None
    m = _REQ_NAME.match(stripped)
    return _normalise(m.group(1)) if m else None


def relax_requirements(text: str) -> tuple[str, list[Relaxation]]:
    """Apply ``RELAXATIONS`` to the text of a requirements file.

    Returns the new text and the relaxations that matched a line.
    """
    by_name = {_normalise(r.package): r for r in RELAXATIONS}
    applied: list[Relaxation] = []
    out: list[str] = []
    for line in text.splitlines():
        name = _requirement_name(line)
        relax = by_name.get(name) if name else None
        if relax is None:
            out.append(line)
            continue
        applied.append(relax)
        out.append(f"{relax.replacement}  # hybridpd relaxed: {line.strip()}")
    return "\n".join(out) + "\n", applied


def test_requirements(source_tree: Path) -> list[str]:
    """Requirement lines for ``TEST_PACKAGES``, pinned as the release's lock file pins them."""
    pins: dict[str, str] = {}
    for rel in TEST_LOCK_FILES:
        lock = source_tree / rel
        if not lock.is_file():
            continue
        for line in lock.read_text().splitlines():
            m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;#]+)", line)
            if m:
                pins[_normalise(m.group(1))] = m.group(2).split("+", 1)[0]
        break
    return [f"{p}=={pins[_normalise(p)]}" if _normalise(p) in pins else p for p in TEST_PACKAGES]


def resolve_torch_spec(torch_spec: str | None = None) -> str:
    """The torch requirement to install: the argument, else ``$HYBRIDPD_TORCH``, else the default."""
    return torch_spec or os.environ.get(TORCH_ENV_VAR) or DEFAULT_TORCH_SPEC


def env_dir(cache_dir: Path, pin: Pin) -> Path:
    """Where the environment for ``pin`` lives."""
    return cache_dir / "envs" / f"{pin.version}-cpu"


def venv_python(venv: Path) -> Path:
    """The interpreter of a venv."""
    return venv / "bin" / "python"


def env_inputs(
    pin: Pin,
    source_tree: Path,
    torch_spec: str | None = None,
    extra_requirements: Sequence[str] = (),
    python: str | None = None,
) -> dict:
    """Everything that decides the content of the environment, plus its hash (``"hash"``)."""
    common = source_tree / "requirements" / "common.txt"
    if not common.is_file():
        raise TestEnvError(f"{common} not found: is {source_tree} a vLLM source tree?")
    relaxed, applied = relax_requirements(common.read_text())
    python = python or sys.executable
    py_version = proc.run(
        [python, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
        check=True, what=f"{python}",
    ).stdout.strip()
    inputs = {
        "schema": ENV_SCHEMA,
        "version": pin.version,
        "python": py_version,
        "torch_spec": resolve_torch_spec(torch_spec),
        "common_txt": relaxed,
        "relaxations": [dataclasses.asdict(r) for r in applied],
        "test_requirements": test_requirements(source_tree),
        "extra_requirements": list(extra_requirements),
    }
    blob = json.dumps(inputs, sort_keys=True).encode()
    inputs["hash"] = hashlib.sha256(blob).hexdigest()[:16]
    return inputs


def read_marker(venv: Path) -> dict | None:
    """The marker of a complete environment, or None."""
    return cache.Marker(venv / MARKER_NAME).read()


def _run(cmd: Sequence[str], log_file: Path, log: Log, what: str) -> None:
    log(f"testenv: {what}")
    with progress.ticker(f"testenv: {what}"):
        done = proc.run(cmd, capture=False, log_file=log_file)
    if not done.ok:
        raise TestEnvError(f"{what} failed (exit {done.returncode}); see {log_file}")


def ensure_test_env(
    pin: Pin,
    source_tree: Path,
    cache_dir: Path,
    torch_spec: str | None = None,
    log: Log = quiet,
    *,
    extra_requirements: Sequence[str] = (),
    python: str | None = None,
) -> Path:
    """Return a complete CPU test environment for ``pin``, building it if needed.

    ``source_tree`` is a vLLM source tree of that release (stock or patched: only its
    ``requirements/`` files are read). ``torch_spec`` overrides ``$HYBRIDPD_TORCH`` and
    ``DEFAULT_TORCH_SPEC``. ``extra_requirements`` are added to the final install (for
    example ``torchvision==0.28.0``); they change the hash. The build log goes to
    ``<cache_dir>/envs/<version>-cpu.build.log``. Concurrent callers for the same
    version serialise on a lock file; the second one reuses the first one's result.

    Raises :class:`TestEnvError` when a pip step fails or torch does not import.
    """
    source_tree = Path(source_tree)
    cache_dir = Path(cache_dir)
    inputs = env_inputs(pin, source_tree, torch_spec, extra_requirements, python)
    venv = env_dir(cache_dir, pin)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with cache.lock(venv, log):
        marker = read_marker(venv)
        if marker and marker.get("hash") == inputs["hash"] and venv_python(venv).exists():
            log(f"testenv: reusing {venv} (inputs {inputs['hash']})")
        else:
            if venv.exists():
                why = "inputs changed" if marker else "no completion marker"
                log(f"testenv: removing {venv} ({why})")
                shutil.rmtree(venv)
            _build(venv, inputs, python or sys.executable, log)
            marker = read_marker(venv)
        used = (marker.get("torch") or {}).get("version")
        if warning := torch_substitution(pin, release_torch(source_tree), used):
            log(warning)
        return venv


def release_torch(source_tree: Path) -> str | None:
    """The torch version the release pins for CPU builds (``requirements/cpu.txt``, else
    ``cuda.txt``), without its local part; None when it pins none."""
    for name in ("cpu.txt", "cuda.txt"):
        path = Path(source_tree) / "requirements" / name
        if path.is_file():
            found = re.search(r"^torch==([0-9][^\s;+]*)", path.read_text(), re.M)
            if found:
                return found.group(1)
    return None


def torch_substitution(pin: Pin, pinned: str | None, used: str | None) -> str | None:
    """The warning line for an environment whose torch is not the release's (a CPU
    torch of the release's version may not be on the index; DEFAULT_TORCH_SPEC)."""
    if not pinned or not used:
        return None
    try:
        same = Version(Version(used).base_version) == Version(pinned)
    except InvalidVersion:
        same = False
    if same:
        return None
    return (f"testenv: warning: vLLM {pin.version} pins torch=={pinned}; this environment uses "
            f"torch {used} (${TORCH_ENV_VAR} chooses another)")


def _build(venv: Path, inputs: dict, python: str, log: Log) -> None:
    start = time.monotonic()
    log_file = venv.parent / f"{venv.name}.build.log"
    log_file.write_text(f"hybridpd test env build {datetime.now(timezone.utc).isoformat()}\n")
    log(f"testenv: building {venv} for vLLM {inputs['version']} (log {log_file})")
    for r in inputs["relaxations"]:
        log(f"testenv: relaxed {r['package']}: {r['reason']}")

    _run([python, "-m", "venv", venv], log_file, log, "create venv")
    py = venv_python(venv)
    pip = [py, "-m", "pip", "install", "--progress-bar", "off"]
    torch_spec = inputs["torch_spec"]
    # Torch first and alone: later requirements (xgrammar, compressed-tensors...) depend
    # on torch, and with torch already satisfied pip does not pick a build of its own.
    _run(pip + [torch_spec], log_file, log, f"install {torch_spec}")
    torch_info = _torch_info(py)
    log(f"testenv: torch {torch_info['version']} (cuda build: {torch_info['cuda']})")

    req_file = venv / "hybridpd-requirements.txt"
    req_file.write_text(inputs["common_txt"])
    # torch_spec again so the resolver keeps the torch we just installed.
    _run(
        pip + ["-r", req_file, torch_spec, *inputs["test_requirements"],
               *inputs["extra_requirements"]],
        log_file, log, "install requirements/common.txt + test packages",
    )
    after = _torch_info(py)
    if after["version"] != torch_info["version"]:
        raise TestEnvError(
            f"requirements replaced torch {torch_info['version']} by {after['version']}"
        )
    freeze = proc.run([py, "-m", "pip", "freeze"])
    (venv / "hybridpd-freeze.txt").write_text(freeze.stdout)

    marker = dict(inputs)
    marker.pop("common_txt")  # kept beside it as hybridpd-requirements.txt
    marker.update(
        torch=after,
        built_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        build_seconds=round(time.monotonic() - start, 1),
    )
    cache.Marker(venv / MARKER_NAME).write(marker)
    log(f"testenv: done in {marker['build_seconds']} s: {venv}")


def _torch_info(py: Path) -> dict:
    """Version and CUDA flavour of the torch in a venv; raises if it does not import."""
    done = proc.run(
        [py, "-c", "import json, torch; print(json.dumps("
         "{'version': torch.__version__, 'cuda': torch.version.cuda}))"],
    )
    if not done.ok:
        raise TestEnvError(f"torch does not import in {py}: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


LAYER_MARKER = "hybridpd-layer.json"


def layer_dir(venv: Path, layer: Layer) -> Path:
    return venv.parent / f"{venv.name}.layers" / layer.name


def ensure_layers(
    venv: Path, pin: Pin, log: Log = quiet
) -> list[Path]:
    """The layers of ``pin``'s patch tests, built beside ``venv`` if needed.

    Under the environment's lock; a layer is reused only when its marker records the
    same requirements and Python, and it is built in a temporary directory that is
    renamed into place, so an interrupted build is never reused.
    """
    py = venv_python(venv)
    paths = []
    with cache.lock(venv, log):
        python = (read_marker(venv) or {}).get("python")
        for layer in LAYERS:
            if not SpecifierSet(layer.releases).contains(pin.version, prereleases=True):
                continue
            target = layer_dir(venv, layer)
            want = {"requirements": list(layer.requirements), "python": python}
            if cache.Marker(target / LAYER_MARKER).read() != want:
                log_file = venv.parent / f"{venv.name}.build.log"
                tmp = target.with_name(target.name + ".tmp")
                shutil.rmtree(tmp, ignore_errors=True)
                _run([py, "-m", "pip", "install", "--progress-bar", "off", "--no-deps",
                      "--target", tmp, *layer.requirements],
                     log_file, log, f"install layer {layer.name}: {' '.join(layer.requirements)}")
                cache.Marker(tmp / LAYER_MARKER).write(want)
                shutil.rmtree(target, ignore_errors=True)
                tmp.rename(target)
            paths.append(target)
    return paths
