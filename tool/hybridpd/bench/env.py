"""Where a bench runs: a pin's stock and patched trees and its CPU test environment.

The trees are kept under ``<cache>/bench/<pin>/`` and made current on every run
(:func:`hybridpd.series.releasetree.prepare`: the release, plus the series for ``patched``);
the environment is the pin's test environment (:func:`hybridpd.proof.testenv.ensure_test_env`),
shared with ``hybridpd test``. Scripts run with the tree first on ``PYTHONPATH``, as the
patch tests do, and with ``tests/patches`` importable for the builders.

The ``stock`` build is the release, except where the release cannot run a remote
prefill of a hybrid model at all: there it carries the patches of
:data:`BASELINE_PATCHES` (on 0.20.2 the scheduler asserts "External KV connector is
not verified yet" on the first one), and the report names them.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from hybridpd import cache, gitops, proc
from hybridpd.errors import HybridpdError
from hybridpd.progress import Log, quiet
from hybridpd.proof import pytestrun, testenv
from hybridpd.series import releasetree
from hybridpd.series.apply import patch_commits
from hybridpd.series.model import Pin, Series

BUILDS = ("stock", "patched")

#: Patches without which no remote prefill of a hybrid model runs on a pin; where a
#: pin carries them, the ``stock`` build is the release plus these (first in the order).
BASELINE_PATCHES = ("scheduler-mamba-external-kv",)


class BenchError(HybridpdError):
    """A bench could not run (its message is one line)."""


@dataclass
class BenchEnv:
    pin: Pin
    root: Path
    venv: Path
    trees: dict[str, Path]
    builders_dir: Path
    #: Patches the ``stock`` build carries (see :data:`BASELINE_PATCHES`).
    baseline: tuple[str, ...] = ()
    #: The patch tests' package layers on the path (lmcache's class), once asked for.
    layers: tuple[Path, ...] = ()

    def python(self) -> Path:
        return testenv.venv_python(self.venv)

    def env(self, build: str) -> dict[str, str]:
        overlay = pytestrun.cpu_metadata_overlay(self.trees[build], self.root / f"{build}.vllm-meta")
        return pytestrun.pytest_env(self.venv, self.trees[build], self.root / "hf", overlay=overlay,
                                    layers=self.layers)

    def with_layers(self, log: Log = quiet) -> None:
        """Put the patch tests' layers (lmcache, for LMCacheMPConnector) on the path."""
        try:
            self.layers = tuple(testenv.ensure_layers(self.venv, self.pin, log))
        except testenv.TestEnvError as exc:
            raise BenchError(f"test environment layers for {self.pin.version}: {exc}") from exc


@contextlib.contextmanager
def prepared(series: Series, pin: Pin, log: Log) -> Iterator[BenchEnv]:
    """The bench environment of ``pin``, held (one bench per pin at a time)."""
    root = cache.cache_dir() / "bench" / pin.version
    root.mkdir(parents=True, exist_ok=True)
    with cache.lock(root, log):
        trees = {}
        for build in BUILDS:
            trees[build] = root / build
            releasetree.prepare(series, pin, trees[build], patched=build == "patched", log=log)
        try:
            venv = testenv.ensure_test_env(pin, trees["stock"], cache.cache_dir(), None, log)
        except testenv.TestEnvError as exc:
            raise BenchError(f"test environment for {pin.version}: {exc}") from exc
        builders = series.dir.parent / "tests" / "patches"
        if not (builders / "builders.py").is_file():
            raise BenchError(f"{builders}/builders.py not found: run from a hybridpd checkout")
        commits = patch_commits(trees["patched"], pin)
        baseline = tuple(i for i, _ in commits if i in BASELINE_PATCHES)
        if not baseline:
            yield BenchEnv(pin, root, venv, trees, builders)
            return
        if [i for i, _ in commits[: len(baseline)]] != list(baseline):
            raise BenchError(f"{', '.join(baseline)} must come first in {pin.version}'s series")
        path = root / "baseline"
        if path.exists():  # left by a killed run
            shutil.rmtree(path)
            gitops.prune_worktrees(trees["patched"])
        with gitops.worktree(trees["patched"], commits[len(baseline) - 1][1].sha, path):
            yield BenchEnv(pin, root, venv, {**trees, "stock": path}, builders, baseline)


def run_script(
    env: BenchEnv,
    build: str,
    script: Path,
    spec: dict[str, Any],
    status: Log = quiet,
) -> dict[str, Any]:
    """Run ``script SPEC.json`` under ``build``'s tree; it writes its result to
    ``spec["out"]``. Its stderr lines (JSON progress) go to ``status``; its output is
    kept in ``<root>/<build>-<script>.log``. Stopped with its process group when
    interrupted."""
    name = script.stem
    spec_path = env.root / f"{build}-{name}.spec.json"
    out_path = env.root / f"{build}-{name}.result.json"
    log_path = env.root / f"{build}-{name}.log"
    out_path.unlink(missing_ok=True)
    log_path.unlink(missing_ok=True)
    spec_path.write_text(json.dumps({**spec, "out": str(out_path)}))
    child = proc.start([env.python(), script, spec_path], log_path, cwd=env.root, env=env.env(build))
    try:
        seen = 0
        while (code := proc.wait(child, 1.0)) is None:
            seen = _follow(log_path, seen, status)
        _follow(log_path, seen, status)
    except BaseException:
        proc.stop(child)
        raise
    if code != 0 or not out_path.is_file():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise BenchError(f"{name} on {env.pin.version} {build} failed (exit {code}): {tail[0]}; log {log_path}")
    return json.loads(out_path.read_text())


def _follow(log_path: Path, seen: int, status: Log) -> int:
    """Pass the progress lines written since byte ``seen`` to ``status``."""
    try:
        with log_path.open("rb") as fh:
            fh.seek(seen)
            data = fh.read()
    except FileNotFoundError:
        return seen
    end = data.rfind(b"\n") + 1
    for line in data[:end].splitlines():
        if line.startswith(b"{"):
            with contextlib.suppress(ValueError):
                status(json.loads(line))
    return seen + end

