"""The compiled-ops proof loads the build vLLM's CPU platform would load on this host.

The CPU capability is faked the way vLLM's own check can be: a stand-in ``torch`` whose
``torch.cpu._is_avx512_supported()`` answers what the test says. The stand-in ``vllm``
has the three builds: ``_C`` (the AVX-512/BF16 build) kills its process with SIGILL, as
it does on an AVX2-only host; ``_C_AVX2``/``_C_AVX512`` raise the harmless ImportError
the suffixed libraries raise after loading.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from hybridpd.envs import kernels
from hybridpd.envs.kernels import CpuFlags

AVX2_ONLY = CpuFlags("x86_64", avx512=False, avx512_bf16=False)
AVX512 = CpuFlags("x86_64", avx512=True, avx512_bf16=False)
AVX512_BF16 = CpuFlags("x86_64", avx512=True, avx512_bf16=True)


@pytest.mark.parametrize(
    "variant, cpu, module",
    [
        ("cpu", AVX2_ONLY, "vllm._C_AVX2"),
        ("cpu", AVX512, "vllm._C_AVX512"),
        ("cpu", AVX512_BF16, "vllm._C"),
        ("cpu", CpuFlags("aarch64", False, False), "vllm._C"),
        ("cuda", None, "vllm._C"),
        ("cuda", AVX2_ONLY, "vllm._C"),
    ],
)
def test_select_module_follows_vllms_cpu_platform(variant, cpu, module):
    assert kernels.select_module(variant, cpu) == module


def _fake_site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("from . import cpu\n")
    (site / "torch" / "cpu.py").write_text(textwrap.dedent("""
        import os
        def _is_avx512_supported():
            return os.environ["FAKE_AVX512"] == "1"
        def _is_avx512_bf16_supported():
            return os.environ["FAKE_AVX512_BF16"] == "1"
    """))
    (site / "vllm").mkdir()
    (site / "vllm" / "__init__.py").write_text("")
    # The AVX-512/BF16 build on a CPU without those instructions.
    (site / "vllm" / "_C.py").write_text(
        "import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n"
    )
    harmless = f"raise ImportError({kernels.IGNORED_IMPORT_ERROR!r} + ' (PyInit__C)')\n"
    (site / "vllm" / "_C_AVX2.py").write_text(harmless)
    (site / "vllm" / "_C_AVX512.py").write_text(harmless)
    return site


def _env(site: Path, avx512: bool, bf16: bool) -> dict:
    return {
        **os.environ,
        "PYTHONPATH": str(site),
        "FAKE_AVX512": "1" if avx512 else "0",
        "FAKE_AVX512_BF16": "1" if bf16 else "0",
    }


def test_avx2_only_host_loads_the_avx2_build(tmp_path):
    site = _fake_site(tmp_path)
    probe = kernels.probe(Path(sys.executable), "cpu", _env(site, False, False), tmp_path)
    assert probe.module == "vllm._C_AVX2"
    assert probe.ok, probe.status
    assert probe.cpu.avx512 is False


def test_avx512_bf16_host_loads_c_and_a_crash_is_reported_not_raised(tmp_path):
    # The AVX-512/BF16 host picks `_C`; here it dies with SIGILL (what a bare
    # `import vllm._C` does on an AVX2-only host): the probe names the signal.
    site = _fake_site(tmp_path)
    probe = kernels.probe(Path(sys.executable), "cpu", _env(site, True, True), tmp_path)
    assert probe.module == "vllm._C"
    assert not probe.ok
    assert probe.status == "killed by SIGILL"


def test_a_real_import_error_is_not_ignored(tmp_path):
    site = _fake_site(tmp_path)
    (site / "vllm" / "_C_AVX2.py").write_text("raise ImportError('libtorch_cpu.so: not found')\n")
    probe = kernels.probe(Path(sys.executable), "cpu", _env(site, False, False), tmp_path)
    assert not probe.ok
    assert "libtorch_cpu.so: not found" in probe.status


def test_a_venv_without_torch_is_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "empty")}
    probe = kernels.probe(Path(sys.executable), "cpu", env, tmp_path)
    assert not probe.ok
    assert probe.status.startswith("torch cannot report the CPU's capabilities")


def test_known_host_flags_skip_torch_and_a_hung_import_times_out(tmp_path):
    site = _fake_site(tmp_path)
    env = _env(site, True, True)  # torch would say AVX-512 BF16: it is not asked
    flags = kernels.host_flags("processor: 0\nflags\t: fpu avx avx2\n", "x86_64")
    assert flags == CpuFlags("x86_64", False, False)
    assert kernels.has_avx2("flags : fpu avx avx2\n") and not kernels.has_avx2("flags : avx\n")
    assert kernels.host_flags("processor: 0\n", "x86_64") is None
    probe = kernels.probe(Path(sys.executable), "cpu", env, tmp_path, cpu=flags)
    assert (probe.module, probe.ok) == ("vllm._C_AVX2", True)
    (site / "vllm" / "_C_AVX2.py").write_text("import time\ntime.sleep(30)\n")
    slow = kernels.probe(Path(sys.executable), "cpu", env, tmp_path, cpu=flags, timeout=0.5)
    assert slow.status == "no answer within 0.5 s" and not slow.ok
