"""Run pytest on a vLLM source tree in a test environment and read its JUnit XML.

The environment comes from :mod:`hybridpd.proof.testenv` (no vLLM installed in it); the tree
is selected with ``PYTHONPATH=<tree>``. pytest runs with the tree root as working
directory: vLLM's ``pyproject.toml`` there carries its pytest configuration (markers,
asyncio mode), test ids are relative to it, and the sdist's in-tree
``vllm.egg-info`` provides vLLM's metadata (nothing is installed).

CPU build identity: vLLM up to 0.2x detects its CPU platform only from the version
string (``"cpu" in importlib.metadata.version("vllm")``, as in the ``+cpu`` builds);
later releases also honour ``VLLM_TARGET_DEVICE=cpu``. A source tree's egg-info says
plain ``0.20.2``, so vLLM would run on ``UnspecifiedPlatform`` and its test teardown
calls ``torch.accelerator.empty_cache()``, which raises on a CPU-only torch. We
therefore put a copy of the in-tree egg-info whose version reads ``<version>+cpu``
(the CPU build's version) first on ``PYTHONPATH`` (:func:`cpu_metadata_overlay`) and
start pytest through the venv's ``bin/pytest`` script (``python -m pytest`` would put the
tree root first on ``sys.path``) with ``--import-mode=append`` (the default ``prepend``
mode inserts the tree root, the base of the ``tests`` package, at ``sys.path[0]`` when it
imports ``tests/conftest.py``); either way the tree root's own egg-info would win. The
tree is on ``PYTHONPATH`` already, so ``append`` changes nothing else. hybridpd writes
nothing into the tree (bytecode goes to ``PYTHONPYCACHEPREFIX=<out_dir>/pycache``), but
some tests write into the working directory (``storage_1/`` from
test_multi_connector.py): run on a scratch copy.

Environment given to pytest (everything else is inherited): ``HF_HUB_OFFLINE=1``,
``TRANSFORMERS_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1`` (no hub look-ups, which otherwise
hang until a timeout on a machine without the hub), ``HF_HOME`` (config-only snapshots,
see :mod:`hybridpd.proof.hfsnap`), ``VLLM_TARGET_DEVICE=cpu`` (otherwise vLLM fails to infer a
device), usage stats off. ``CUDA_VISIBLE_DEVICES`` is left alone: setting it to ``""``
makes Ray refuse tests that declare a GPU resource before they reach vLLM code.

Outcome vocabulary of :attr:`SuiteResult.outcomes`: ``passed``, ``failed``, ``error``
(setup/teardown or collection error), ``skipped``, ``xfailed``. Counts: ``skipped``
includes ``xfailed``; summaries treat ``error`` as failed (:attr:`SuiteResult.failed_total`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from hybridpd import proc, progress
from hybridpd.progress import Log, quiet

#: pytest exit codes (``pytest.ExitCode``), spelled out so we need not import pytest.
EXIT_OK, EXIT_TESTS_FAILED, EXIT_INTERRUPTED, EXIT_INTERNAL, EXIT_USAGE, EXIT_NO_TESTS = range(6)

#: Statuses of a run, from best to worst.
STATUSES = ("ok", "failures", "no-tests", "interrupted", "timeout", "crashed")


#: The statuses of a run that went to its end: only these prove anything (a run that
#: collected no tests proves nothing).
FINISHED = ("ok", "failures")


@dataclasses.dataclass
class Counts:
    """How many tests passed, failed, were skipped (xfailed and the like included) and
    errored: the one count type of every suite result."""

    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0

    _KEYS = {"passed": "passed", "failed": "failed", "error": "errors", "errors": "errors"}

    @classmethod
    def of(cls, outcomes: Iterable[str]) -> Counts:
        counts = cls()
        for outcome in outcomes:
            key = cls._KEYS.get(outcome, "skipped")
            setattr(counts, key, getattr(counts, key) + 1)
        return counts

    def to_json(self, errors: bool = True) -> dict[str, int]:
        """The counts; without ``errors`` where a caller folds errors into failures."""
        data = {"passed": self.passed, "failed": self.failed, "skipped": self.skipped}
        return {**data, "errors": self.errors} if errors else data


@dataclasses.dataclass
class SuiteResult:
    """What one pytest process reported.

    ``outcomes`` maps a pytest node id (``tests/v1/core/test_x.py::TestC::test_y[p]``)
    to an outcome; a collection error is recorded under the file's path. ``status`` is
    ``ok`` only when pytest exited 0 and wrote its XML. ``reason`` says why when it is not.
    """

    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0
    outcomes: dict[str, str] = dataclasses.field(default_factory=dict)
    #: First line(s) of the failure/error/skip message per test id (at most 300 chars).
    messages: dict[str, str] = dataclasses.field(default_factory=dict)
    status: str = "ok"
    reason: str | None = None
    exit_code: int | None = None
    wall_seconds: float = 0.0
    #: Sum of JUnit test times per test file (setup + call + teardown), seconds.
    file_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    log_path: Path | None = None
    junit_path: Path | None = None
    command: list[str] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        """Whether pytest ran to its end (:data:`FINISHED`)."""
        return self.status in FINISHED

    @property
    def failed_total(self) -> int:
        """Failures for summaries: failed tests, errors, and 1 for a run that did not
        finish."""
        return self.failed + self.errors + (0 if self.finished else 1)

    def counts(self) -> dict[str, int]:
        return Counts(self.passed, self.failed, self.skipped, self.errors).to_json()

    def per_file_counts(self) -> dict[str, dict[str, int]]:
        """Outcome counts per test file."""
        files: dict[str, list[str]] = {}
        for test_id, outcome in self.outcomes.items():
            files.setdefault(test_id.split("::", 1)[0], []).append(outcome)
        return {f: Counts.of(outcomes).to_json() for f, outcomes in files.items()}


def _module_of(path: str) -> str:
    p = path[:-3] if path.endswith(".py") else path
    return p.replace("/", ".")


def _test_id(classname: str, name: str, files: Sequence[str]) -> str:
    """Rebuild a pytest node id from JUnit ``classname`` and ``name``.

    pytest writes ``classname`` as the node id's path with ``/`` -> ``.`` and ``.py``
    dropped, followed by the class names, so the path is recovered by matching the
    files we asked for (longest module first). Unknown modules keep the dotted form.
    """
    if not classname:  # collection errors: name is the dotted module
        for f in files:
            if _module_of(f) == name:
                return f
        return name
    for f in sorted(files, key=len, reverse=True):
        mod = _module_of(f)
        if classname == mod or classname.startswith(mod + "."):
            rest = classname[len(mod) + 1:]
            parts = [f] + (rest.split(".") if rest else []) + [name]
            return "::".join(parts)
    return f"{classname}::{name}"


def parse_junit(xml_path: Path, files: Sequence[str] = ()) -> SuiteResult:
    """Parse a pytest JUnit XML file into a :class:`SuiteResult` (status ``ok``).

    ``files`` are the test file paths given to pytest, relative to its root, used to turn
    JUnit class names back into node ids. When one id occurs more than once (a test that
    failed and then errored in teardown), the worst outcome wins.
    """
    rank = {"passed": 0, "skipped": 1, "xfailed": 1, "failed": 2, "error": 3}
    root = ET.parse(xml_path).getroot()
    result = SuiteResult(junit_path=Path(xml_path))
    for case in root.iter("testcase"):
        test_id = _test_id(case.get("classname", ""), case.get("name", ""), files)
        outcome = "passed"
        message = ""
        for child in case:
            if child.tag in ("error", "failure", "skipped") and not message:
                message = " ".join((child.get("message") or "").split())[:300]
            if child.tag == "error":
                outcome = "error"
            elif child.tag == "failure" and outcome != "error":
                outcome = "failed"
            elif child.tag == "skipped" and outcome == "passed":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        prev = result.outcomes.get(test_id)
        if prev is None or rank[outcome] > rank[prev]:
            result.outcomes[test_id] = outcome
            if message:
                result.messages[test_id] = message
        f = test_id.split("::", 1)[0]
        try:
            result.file_seconds[f] = result.file_seconds.get(f, 0.0) + float(case.get("time", 0))
        except ValueError:
            pass
    for outcome in result.outcomes.values():
        if outcome == "passed":
            result.passed += 1
        elif outcome == "failed":
            result.failed += 1
        elif outcome == "error":
            result.errors += 1
        else:
            result.skipped += 1
    result.file_seconds = {k: round(v, 2) for k, v in result.file_seconds.items()}
    return result


def cpu_metadata_overlay(tree: Path, dest: Path) -> Path:
    """Write ``<dest>/vllm.egg-info``: the tree's egg-info with a ``+cpu`` version.

    Returns ``dest`` (a directory to put on ``sys.path`` before the tree). A version
    that already names ``cpu`` is kept as it is.
    """
    src = Path(tree) / "vllm.egg-info"
    if not (src / "PKG-INFO").is_file():
        raise FileNotFoundError(f"{src}/PKG-INFO not found: not an sdist tree?")
    target = Path(dest) / "vllm.egg-info"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(src, target)
    pkg_info = target / "PKG-INFO"
    text = pkg_info.read_text()

    def cpu(m: re.Match) -> str:
        v = m.group(1).strip()
        if "cpu" in v:
            return m.group(0)
        return f"Version: {v}{'.' if '+' in v else '+'}cpu"

    pkg_info.write_text(re.sub(r"(?m)^Version:(.*)$", cpu, text, count=1))
    return Path(dest)


def vllm_tree(tree: Path, layers: Sequence[Path] = ()) -> Path:
    """The vLLM source tree whose metadata the run uses: ``tree``, or, when ``tree``
    is another project's (LMCache's patch tests), the first layer that is a vLLM tree.
    """
    for candidate in (Path(tree), *map(Path, layers)):
        if (candidate / "vllm.egg-info").is_dir():
            return candidate
    return Path(tree)


def pytest_env(venv: Path, tree: Path, hf_home: Path,
               base: Mapping[str, str] | None = None,
               overlay: Path | None = None,
               layers: Sequence[Path] = ()) -> dict[str, str]:
    """The environment pytest runs with (see the module docstring). ``layers`` come
    after the tree on ``PYTHONPATH`` (packages kept out of the venv, see
    :data:`hybridpd.proof.testenv.LAYERS`)."""
    env = dict(os.environ if base is None else base)
    for var in ("PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV"):
        env.pop(var, None)
    path = [str(overlay)] * bool(overlay) + [str(tree)] + [str(p) for p in layers]
    env.update(
        PYTHONPATH=os.pathsep.join(path),
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        VIRTUAL_ENV=str(venv),
        HF_HOME=str(hf_home),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        VLLM_TARGET_DEVICE="cpu",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def has_plugin(venv: Path, module: str) -> bool:
    """Whether ``module`` imports in the venv (used for optional pytest plugins)."""
    py = venv / "bin" / "python"
    if not py.exists():
        return False
    return proc.run([py, "-c", f"import {module}"]).ok


class Stopped(Exception):
    """A pytest run ended because its ``stop`` event was set."""


def _wait(child, timeout: float | None, stop: threading.Event | None) -> int | None:
    """:func:`proc.wait`, also watching ``stop`` (once a second) when there is one."""
    if stop is None:
        return proc.wait(child, timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
        code = proc.wait(child, left)
        if code is not None:
            return code
        if stop.is_set():
            raise Stopped("stopped")
        if deadline is not None and time.monotonic() >= deadline:
            return None


def run_pytest(
    venv: Path,
    tree: Path,
    files: Sequence[str],
    out_dir: Path,
    *,
    hf_home: Path,
    label: str = "pytest",
    test_timeout: int | None = 600,
    session_timeout: float | None = None,
    extra_args: Sequence[str] = (),
    env_overrides: Mapping[str, str] | None = None,
    nice: int | None = 10,
    layers: Sequence[Path] = (),
    log: Log = quiet,
    stop: threading.Event | None = None,
) -> SuiteResult:
    """Run ``files`` (paths relative to ``tree``) in one pytest process.

    Writes ``<out_dir>/<label>.log`` (stdout and stderr, streamed) and
    ``<out_dir>/<label>.junit.xml``; a stale XML is removed first so a crash is never
    read as a result. ``test_timeout`` applies per test through pytest-timeout when the
    venv has it. ``session_timeout`` bounds the whole process (status ``timeout``; the
    process group is killed). Never raises for test outcomes; the status and reason say
    what happened. ``stop``, set from another thread (a run side by side with others,
    whose caller was interrupted), ends the process within a second and raises
    :class:`Stopped`.
    """
    tree, venv, out_dir = Path(tree).resolve(), Path(venv).resolve(), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / f"{label}.log"
    junit = out_dir / f"{label}.junit.xml"
    junit.unlink(missing_ok=True)
    missing = [f for f in files if not (tree / f).exists()]
    files = [f for f in files if (tree / f).exists()]

    overlay = cpu_metadata_overlay(
        vllm_tree(tree, layers), out_dir.resolve() / f"{label}.vllm-meta"
    )
    # bin/pytest, not "python -m pytest": -m would put the tree root first on sys.path.
    cmd = [str(venv / "bin" / "pytest"), *files,
           f"--junitxml={junit.resolve()}", "-p", "no:cacheprovider",
           "-o", "junit_family=xunit1", "--import-mode=append", "-rfE", "-q"]
    if test_timeout and has_plugin(venv, "pytest_timeout"):
        cmd.append(f"--timeout={test_timeout}")
    cmd += list(extra_args)
    if nice is not None:
        cmd = ["nice", "-n", str(nice)] + cmd
    env = pytest_env(venv, tree, hf_home, overlay=overlay, layers=layers)
    env["PYTHONPYCACHEPREFIX"] = str(out_dir.resolve() / "pycache")
    env.update(env_overrides or {})

    result = SuiteResult(log_path=log_path, command=cmd)
    if not files:
        result.status, result.reason = "no-tests", f"none of the files exist in {tree}"
        log_path.write_text(result.reason + "\n")
        return result
    log(f"pytest[{label}]: {len(files)} file(s) in {tree} -> {log_path}")
    start = time.monotonic()
    with log_path.open("w") as fh:
        fh.write(f"# cd {tree}\n")
        if missing:
            fh.write(f"# not in this tree, skipped: {' '.join(missing)}\n")
    child = proc.start(cmd, log_path, cwd=tree, env=env)
    try:
        with progress.ticker(f"pytest[{label}]", lambda: pytest_progress(log_path)):
            code = _wait(child, session_timeout, stop)
    except BaseException:  # Ctrl-C or SIGTERM: the pytest run must not outlive us
        proc.stop(child)
        raise
    timed_out = code is None
    if timed_out:
        code = proc.stop(child, grace=0)
    wall = round(time.monotonic() - start, 1)

    if junit.is_file():
        try:
            parsed = parse_junit(junit, files)
        except ET.ParseError as exc:
            parsed = None
            parse_error = str(exc)
    else:
        parsed, parse_error = None, "no JUnit XML written"
    if parsed is not None:
        result = dataclasses.replace(parsed, log_path=log_path, command=cmd)
    result.exit_code, result.wall_seconds = code, wall

    if timed_out:
        result.status, result.reason = "timeout", f"killed after {session_timeout} s"
    elif parsed is None:
        result.status = "crashed"
        result.reason = f"exit {code}: {parse_error}; last lines: {_tail(log_path)}"
    elif code == EXIT_OK:
        result.status = "ok"
    elif code == EXIT_TESTS_FAILED:
        result.status = "failures"
    elif code == EXIT_NO_TESTS:
        result.status, result.reason = "no-tests", "pytest collected no tests"
    elif code == EXIT_INTERRUPTED:
        result.status, result.reason = "interrupted", f"interrupted: {_tail(log_path)}"
    else:
        result.status, result.reason = "crashed", f"exit {code}: {_tail(log_path)}"
    log(f"pytest[{label}]: {result.status} in {wall} s: {result.counts()}")
    return result


_PERCENT = re.compile(rb"\[\s*(\d+)%\]\s*$", re.M)


def pytest_progress(log_path: Path) -> str:
    """How far a ``pytest -q`` run writing ``log_path`` is: its last ``[ NN%]``, and
    the failures so far (from the progress lines' ``F`` and ``E``)."""
    with log_path.open("rb") as fh:
        data = fh.read()
    marks = _PERCENT.findall(data)
    if not marks:
        return "collecting"
    lines = [l for l in data.splitlines() if _PERCENT.search(l)]
    failed = sum(l.split(b"[")[0].count(b"F") + l.split(b"[")[0].count(b"E") for l in lines)
    return f"{int(marks[-1])}%" + (f", {failed} failed" if failed else "")


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])
