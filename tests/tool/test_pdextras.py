"""NIXL for a PD venv: the backend of the venv's torch, at the release's pin, proven to
import; each step's failure is one line, never a half-read version."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from hybridpd.envs import pdextras
from hybridpd.envs.build import BuildError


def _python(tmp_path: Path, cuda: str = "", pip_rc: int = 0, version: str = "1.5.0",
            version_rc: int = 0, import_rc: int = 0) -> Path:
    """A stand-in interpreter: ``-m pip ...`` logs its arguments and exits ``pip_rc``;
    ``-c`` answers torch's CUDA major, the backend's version, or the nixl import."""
    log = tmp_path / "calls"
    py = tmp_path / "python"
    py.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "-m" ]; then echo "$*" >> {log}; exit {pip_rc}; fi\n'
        'case "$2" in\n'
        f"  *torch*) echo '{cuda}' ;;\n"
        f"  *metadata*) printf '%s' '{version}'; exit {version_rc} ;;\n"
        f"  *nixl._api*) echo 'ImportError: no backend' >&2; exit {import_rc} ;;\n"
        "esac\n"
    )
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    return py


def _release(tmp_path: Path, files: dict[str, str]) -> Path:
    checkout = tmp_path / "vllm"
    (checkout / "requirements").mkdir(parents=True)
    for name, text in files.items():
        (checkout / "requirements" / name).write_text(text)
    return checkout


V032 = {
    "kv_connectors.txt": "lmcache >= 0.3.9\ncupy-cuda13x != 14.1.0\nnixl == 1.5.0\n",
    "kv_connectors_cu12.txt": "cupy-cuda12x != 14.1.0\nnixl == 1.4.1\n",
}
V0202 = {"kv_connectors.txt": (
    "lmcache\nnixl[cu13] >= 0.7.1, <= 0.10.1 # PD\nnixl-cu12 >= 0.7.1, <= 0.10.1\n"
    "nixl-cu13 >= 0.7.1, <= 0.10.1\n"
)}


def test_a_cpu_torch_gets_the_cu12_backend_at_the_release_pin(tmp_path: Path) -> None:
    py = _python(tmp_path, cuda="", version="1.4.1")
    assert pdextras.install_nixl(py, _release(tmp_path, V032)) == "1.4.1"
    assert (tmp_path / "calls").read_text().splitlines() == [
        "-m pip install -q nixl-cu12==1.4.1",
        "-m pip install -q --no-deps nixl==1.4.1",
    ]


def test_a_cuda_13_torch_gets_the_cu13_backend(tmp_path: Path) -> None:
    py = _python(tmp_path, cuda="13", version="1.5.0")
    pdextras.install_nixl(py, _release(tmp_path, V032))
    assert (tmp_path / "calls").read_text().splitlines()[0] == "-m pip install -q nixl-cu13==1.5.0"


def test_a_release_that_pins_the_backend_by_name(tmp_path: Path) -> None:
    assert pdextras.requirement(_release(tmp_path, V0202), "nixl-cu12") == "nixl-cu12<=0.10.1,>=0.7.1"
    assert pdextras.requirement(tmp_path / "no-checkout", "nixl-cu12") == "nixl-cu12"


def test_an_unreadable_backend_version_stops_before_installing_nixl_of_no_version(
    tmp_path: Path,
) -> None:
    py = _python(tmp_path, version="", version_rc=1)
    with pytest.raises(BuildError, match="nixl-cu12 is not installed in .* after pip installed it"):
        pdextras.install_nixl(py, _release(tmp_path, V032))
    assert (tmp_path / "calls").read_text().splitlines() == ["-m pip install -q nixl-cu12==1.4.1"]


def test_a_pip_failure_is_one_line(tmp_path: Path) -> None:
    py = _python(tmp_path, pip_rc=1)
    with pytest.raises(BuildError, match="pip could not install nixl-cu12==1.4.1 into"):
        pdextras.install_nixl(py, _release(tmp_path, V032))


def test_nixl_that_does_not_import_is_an_error(tmp_path: Path) -> None:
    py = _python(tmp_path, version="1.4.1", import_rc=1)
    with pytest.raises(BuildError, match=r"nixl._api does not import: ImportError: no backend"):
        pdextras.install_nixl(py, _release(tmp_path, V032))
