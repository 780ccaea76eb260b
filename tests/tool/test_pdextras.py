"""NIXL for a PD venv: each pip step's failure is one line, never a half-read version."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from hybridpd import pdextras
from hybridpd.build import BuildError


def _python(tmp_path: Path, pip_rc: int, version_out: str, version_rc: int) -> Path:
    """A stand-in interpreter: ``-m pip ...`` exits ``pip_rc`` and logs its arguments;
    ``-c ...`` prints ``version_out`` and exits ``version_rc``."""
    log = tmp_path / "calls"
    py = tmp_path / "python"
    py.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "-m" ]; then echo "$*" >> {log}; exit {pip_rc}; fi\n'
        f"printf '%s' '{version_out}'; exit {version_rc}\n"
    )
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    return py


def test_installs_the_backend_then_the_meta_package_without_dependencies(tmp_path: Path) -> None:
    py = _python(tmp_path, 0, "0.9.0", 0)
    assert pdextras.install_nixl(py) == "0.9.0"
    assert (tmp_path / "calls").read_text().splitlines() == [
        "-m pip install -q nixl-cu12",
        "-m pip install -q --no-deps nixl==0.9.0",
    ]


def test_an_unreadable_backend_version_stops_before_installing_nixl_of_no_version(
    tmp_path: Path,
) -> None:
    py = _python(tmp_path, 0, "", 1)
    with pytest.raises(BuildError, match="nixl-cu12 is not installed in .* after pip installed it"):
        pdextras.install_nixl(py)
    assert (tmp_path / "calls").read_text().splitlines() == ["-m pip install -q nixl-cu12"]


def test_a_pip_failure_is_one_line(tmp_path: Path) -> None:
    py = _python(tmp_path, 1, "0.9.0", 0)
    with pytest.raises(BuildError, match="pip could not install nixl-cu12 into"):
        pdextras.install_nixl(py)
