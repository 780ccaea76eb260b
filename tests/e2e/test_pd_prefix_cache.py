"""The CPU CI gate and the GPU run of ``hybridpd e2e`` (see conftest.py for how to run).

The gate: with D's connector set to MultiConnector(NIXL + DecodeBenchConnector),
upstream's capability gate gives the decode instance no local prefix hit (stock: 0
tokens for a request sharing 1 300 of 1 400 prompt tokens, and NIXL moves the whole
prompt again); patched must give it the hit, with outputs equal to a cold decode
instance's. Plain NIXL must be green on both builds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_e2e(out: Path, *args: str, timeout: float = 1500) -> tuple[subprocess.CompletedProcess, dict]:
    cmd = [sys.executable, "-m", "hybridpd.cli.entry", "e2e", "--pin", "0.32.0", "--out", str(out), *args]
    for build in ("patched", "stock"):
        venv = os.environ.get(f"HYBRIDPD_E2E_{build.upper()}_VENV")
        if venv:
            cmd += [f"--{build}-venv", venv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    report = out / "report.json"
    return proc, json.loads(report.read_text()) if report.exists() else {}


def _out(tmp_path: Path, name: str) -> Path:
    base = os.environ.get("HYBRIDPD_E2E_OUT")
    return Path(base) / name if base else tmp_path / name


def _run(report: dict, build: str, connector: str) -> dict:
    return next(r for r in report["runs"] if r["build"] == build and r["connector"] == connector)


def _shared_prefix_request(run: dict) -> dict:
    return run["requests"][2]  # r3: B shares 1 300 of its 1 400 tokens with A


@pytest.mark.e2e_cpu
def test_cpu_gate_red_on_stock_green_on_patched(tmp_path: Path) -> None:
    out = _out(tmp_path, "gate")
    proc, report = run_e2e(
        out, "--device", "cpu", "--tiny", "--scenario", "smoke",
        "--connector", "nixl", "--connector", "nixl+decodebench",
        "--compare", "stock", "--expect-patched-hit",
    )
    assert report.get("runs"), f"no report: {proc.stderr[-2000:]}"
    for build in ("stock", "patched"):
        nixl = _run(report, build, "nixl")
        assert all(nixl["checks"].values()), (build, nixl["checks"])
    stock = _run(report, "stock", "nixl+decodebench")
    assert _shared_prefix_request(stock)["decode_local_hit_tokens"] == 0  # upstream's gate
    assert stock["outputs_match_baseline"]
    patched = _run(report, "patched", "nixl+decodebench")
    hit = _shared_prefix_request(patched)
    assert hit["decode_local_hit_tokens"] > 0, "patched: no decode-side hit"
    assert hit["kv_bytes_transferred"] < _shared_prefix_request(stock)["kv_bytes_transferred"]
    assert patched["outputs_match_baseline"]
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.e2e_cpu
def test_cpu_stock_shows_the_problem(tmp_path: Path) -> None:
    """Stock alone (runs before the series is ported): NIXL hits, NIXL+DecodeBench does not."""
    out = _out(tmp_path, "stock")
    proc, report = run_e2e(
        out, "--device", "cpu", "--tiny", "--scenario", "smoke", "--stock-only",
        "--connector", "nixl", "--connector", "nixl+decodebench",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    nixl = _run(report, "stock", "nixl")
    assert all(nixl["checks"].values()), nixl["checks"]
    assert _shared_prefix_request(nixl)["decode_local_hit_tokens"] > 0
    bench = _run(report, "stock", "nixl+decodebench")
    assert _shared_prefix_request(bench)["decode_local_hit_tokens"] == 0
    first, shared = bench["requests"][0], _shared_prefix_request(bench)
    assert shared["kv_bytes_transferred"] == first["kv_bytes_transferred"]
    assert bench["outputs_match_baseline"]


@pytest.mark.e2e_gpu
def test_gpu_seed_model_with_offloading(tmp_path: Path) -> None:
    out = _out(tmp_path, "gpu")
    proc, report = run_e2e(
        out, "--device", "cuda", "--model", "Qwen/Qwen3.5-35B-A3B", "--scenario", "smoke",
        "--connector", "nixl", "--connector", "nixl+offloading", "--compare", "stock",
        "--expect-patched-hit", "--max-model-len", "24576",
        timeout=3600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    patched = _run(report, "patched", "nixl+offloading")
    assert _shared_prefix_request(patched)["decode_local_hit_tokens"] > 0
