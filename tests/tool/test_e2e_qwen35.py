"""The import hook that lets vLLM's Qwen3.5 module import in the e2e's CPU venvs.

A real venv (no pip, a second or so) holding a stand-in ``transformers`` package whose
``image_processing_qwen2_vl`` imports torchvision at module level, as transformers' does,
and whose PIL twin does not. Every check runs in a fresh interpreter of that venv, so
the ``.pth`` line runs as it does in vLLM's API server and engine core.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

from hybridpd.e2e import qwen35

IMPORT = "from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize"


@pytest.fixture
def env(tmp_path: Path) -> Path:
    """A venv whose transformers stand-in needs torchvision for the aliased module."""
    root = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    py = root / "bin" / "python"
    site = qwen35.site_packages(py)
    pkg = site / "transformers" / "models" / "qwen2_vl"
    pkg.mkdir(parents=True)
    for d in (site / "transformers", site / "transformers" / "models", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "image_processing_qwen2_vl.py").write_text(
        "import torchvision\n\ndef smart_resize(h, w):\n    return ('torchvision', h, w)\n")
    (pkg / "image_processing_pil_qwen2_vl.py").write_text(
        "def smart_resize(h, w):\n    return ('pil', h, w)\n")
    return py


def _run(py: Path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(py), "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=60)


def test_without_the_hook_the_module_needs_torchvision(env: Path) -> None:
    done = _run(env, IMPORT)
    assert done.returncode != 0
    assert "No module named 'torchvision'" in done.stderr


def test_the_hook_answers_with_the_pil_twin_and_loads_no_torchvision(env: Path) -> None:
    pth = qwen35.install(env)
    assert pth.read_text() == f"import {qwen35.MODULE}\n"
    done = _run(env, f"""
        import sys
        assert "transformers" not in sys.modules  # nothing imported at start-up
        {IMPORT}
        print(smart_resize(2, 3), "torchvision" in sys.modules)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["('pil',", "2,", "3)", "False"]


def test_a_spawned_process_of_the_venv_has_the_hook(env: Path, tmp_path: Path) -> None:
    # vLLM's engine core is a new interpreter of the same venv (multiprocessing spawn).
    qwen35.install(env)
    script = tmp_path / "spawn.py"
    script.write_text(textwrap.dedent(f"""
        import multiprocessing as mp

        def child(q):
            {IMPORT}
            q.put(smart_resize(1, 1)[0])

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(q,))
            p.start()
            print(q.get(timeout=30))
            p.join()
    """))
    done = subprocess.run([str(env), str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "pil"


def test_with_torchvision_installed_the_hook_stays_out(env: Path) -> None:
    qwen35.install(env)
    site = qwen35.site_packages(env)
    (site / "torchvision").mkdir()
    (site / "torchvision" / "__init__.py").write_text("")
    done = _run(env, f"{IMPORT}\nprint(smart_resize(1, 1)[0])")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "torchvision"


def test_installing_twice_registers_one_hook(env: Path) -> None:
    qwen35.install(env)
    qwen35.install(env)
    done = _run(env, f"""
        import sys, {qwen35.MODULE} as m
        print(sum(isinstance(f, m._Alias) for f in sys.meta_path))
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"


def test_a_venv_the_user_passes_gets_no_hook(tmp_path: Path) -> None:
    from hybridpd.e2e import envs

    root = tmp_path / "mine"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    envs.given(root, "patched")
    assert not (qwen35.site_packages(root / "bin" / "python") / qwen35.PTH).exists()
    assert sys.prefix != str(root)
