"""Which build of vLLM's compiled ops a venv loads on this host, and whether it loads.

vLLM's CPU wheels ship three builds of the same ops for x86 and pick one at start-up
(``CpuPlatform.import_kernels`` in ``vllm/platforms/cpu.py``, 0.20 to 0.33)::

    AVX-512 and AVX-512 BF16  -> vllm._C
    AVX-512 without BF16      -> vllm._C_AVX512
    otherwise (AVX2)          -> vllm._C_AVX2

Importing ``vllm._C`` directly on an AVX2-only host runs AVX-512 instructions and the
process dies with SIGILL, so a proof of the compiled ops must load the module vLLM
itself would load. The choice is made here from the capability flags torch reports in
the venv (the same ``torch.cpu._is_avx512_supported()`` checks vLLM calls), or, for a
caller that cannot spend a torch import (``hybridpd doctor``), from the kernel's
``/proc/cpuinfo`` flags (:func:`host_flags`); the import runs in a child process of its
own, so a crash is reported as a signal instead of taking the proof down with it.

The ``_C_AVX2``/``_C_AVX512`` libraries define no Python module init function: importing
them raises ImportError("dynamic module does not define module export function") *after*
the library (and its ``torch.ops`` registrations) loaded. vLLM ignores that message; so
does :func:`probe`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from hybridpd import proc

X86_MACHINES = frozenset({"x86_64", "amd64", "i386", "i686"})
# vLLM's own string for the harmless ImportError of the suffixed libraries.
IGNORED_IMPORT_ERROR = "dynamic module does not define module export function"

_FLAGS_SCRIPT = r"""
import json, platform, torch
print("HYBRIDPD-CPU " + json.dumps({
    "machine": platform.machine().lower(),
    "avx512": bool(torch.cpu._is_avx512_supported()),
    "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
}))
"""

_IMPORT_SCRIPT = r"""
import importlib, sys
try:
    importlib.import_module(sys.argv[1])
except ImportError as exc:
    if sys.argv[2] not in str(exc):
        raise
print("HYBRIDPD-KERNELS ok")
"""


@dataclass(frozen=True)
class CpuFlags:
    machine: str
    avx512: bool
    avx512_bf16: bool

    def to_json(self) -> dict:
        return {"machine": self.machine, "avx512": self.avx512, "avx512_bf16": self.avx512_bf16}


@dataclass(frozen=True)
class KernelProbe:
    """The compiled-ops module vLLM loads in a venv and whether it loaded."""

    module: str
    status: str  # "ok", or one line saying why not
    cpu: CpuFlags | None  # None for a CUDA build (one `_C` for every CPU)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_json(self) -> dict:
        return {
            "module": self.module,
            "status": self.status,
            "cpu": self.cpu.to_json() if self.cpu else None,
        }


def select_module(variant: str, cpu: CpuFlags | None) -> str:
    """The module vLLM's platform imports for ``variant`` on a CPU with ``cpu``'s flags."""
    if variant != "cpu" or cpu is None or cpu.machine not in X86_MACHINES:
        return "vllm._C"
    if cpu.avx512:
        return "vllm._C" if cpu.avx512_bf16 else "vllm._C_AVX512"
    return "vllm._C_AVX2"


def cpu_flags(py: Path, env: Mapping[str, str], cwd: Path) -> CpuFlags:
    """What torch in the venv of ``py`` reports of this CPU (the checks vLLM calls)."""
    done, data = proc.script(py, _FLAGS_SCRIPT, "HYBRIDPD-CPU", env=env, cwd=cwd)
    if data is None:
        raise RuntimeError(f"torch cannot report the CPU's capabilities: {done.tail()}")
    return CpuFlags(data["machine"], data["avx512"], data["avx512_bf16"])


def host_flags(cpuinfo: str, machine: str) -> CpuFlags | None:
    """The same flags from the kernel's ``/proc/cpuinfo`` text (``avx512f``,
    ``avx512_bf16``), for callers that cannot spend a torch import; None without flags."""
    line = next((l for l in cpuinfo.splitlines() if l.startswith("flags")), None)
    if line is None:
        return None
    flags = set(line.split(":", 1)[1].split())
    return CpuFlags(machine.lower(), "avx512f" in flags, "avx512_bf16" in flags)


def has_avx2(cpuinfo: str) -> bool:
    """Whether ``/proc/cpuinfo`` text lists AVX2 (vLLM's CPU kernels need at least it)."""
    line = next((l for l in cpuinfo.splitlines() if l.startswith("flags")), "")
    return "avx2" in line.split(":", 1)[-1].split()


def probe(
    py: Path,
    variant: str,
    env: Mapping[str, str],
    cwd: Path,
    cpu: CpuFlags | None = None,
    timeout: float | None = None,
) -> KernelProbe:
    """Load the compiled ops of the venv of ``py`` the way vLLM does, in a child process.

    ``cpu``: the host's flags when the caller has them (else torch in the venv is asked,
    which costs a torch import). ``timeout``: seconds the import may take."""
    if cpu is None and variant == "cpu":
        try:
            cpu = cpu_flags(py, env, cwd)
        except RuntimeError as exc:
            return KernelProbe("vllm._C", str(exc), None)
    module = select_module(variant, cpu)
    done = proc.run([py, "-c", _IMPORT_SCRIPT, module, IGNORED_IMPORT_ERROR], env=env, cwd=cwd,
                    timeout=timeout)
    if done.timed_out:
        return KernelProbe(module, f"no answer within {timeout:g} s", cpu)
    ok = done.ok and "HYBRIDPD-KERNELS ok" in done.stdout
    return KernelProbe(module, "ok" if ok else done.tail(), cpu)
