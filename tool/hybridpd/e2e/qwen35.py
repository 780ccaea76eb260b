"""vLLM's Qwen3.5 module in the e2e's CPU virtualenvs, without torchvision.

``vllm/model_executor/models/qwen3_5.py`` imports ``qwen3_vl.py``, which imports
transformers' Qwen2-VL image processor (``image_processing_qwen2_vl``), which imports
torchvision at module level. The package index serves torchvision only built against
CUDA torch, and beside a CPU torch its import fails ("operator torchvision::nms does not
exist"). Only that one module needs it: its twin ``image_processing_pil_qwen2_vl`` has
the same ``smart_resize`` and imports no torchvision (measured on the 0.32.0 and 0.33.0
trees: ``Qwen3_5ForCausalLM`` imports and serves, torchvision is never loaded). A fake
``torchvision`` package would be worse: transformers would then believe it available.

:func:`install` writes a module and a ``.pth`` file into a venv's site-packages. Python
runs the ``.pth`` line at the start of every process of that venv (the API server, the
engine core vLLM spawns, the tiny-model writer), and it registers an import hook that
answers that one module name with the twin's contents, only while torchvision is not
installed; nothing is imported at start-up. hybridpd writes it only into the venvs it
builds for ``e2e`` (never into a venv passed with ``--patched-venv``/``--stock-venv``,
nor by ``install`` or ``apply --installed``).
"""

from __future__ import annotations

from pathlib import Path

from hybridpd.e2e.servers import E2EError
from hybridpd.envs import build as build_mod

#: The module the hook answers, and the module whose contents it answers with.
ALIASED = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
TWIN = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"

MODULE = "_hybridpd_qwen35_alias"
PTH = "hybridpd-qwen35-alias.pth"

_HOOK = f'''"""Written by hybridpd for its e2e venvs (hybridpd.e2e.qwen35): answers
{ALIASED} with {TWIN} while torchvision is not installed, so that vLLM's Qwen3.5
module imports beside a CPU torch."""

import importlib
import importlib.abc
import importlib.util
import sys

ALIASED = {ALIASED!r}
TWIN = {TWIN!r}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != ALIASED or importlib.util.find_spec("torchvision") is not None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None  # a new module; its contents are the twin's

    def exec_module(self, module):
        twin = importlib.import_module(TWIN)
        module.__dict__.update(
            (k, v) for k, v in vars(twin).items() if not k.startswith("__")
        )


if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.insert(0, _Alias())
'''


def site_packages(python: Path) -> Path:
    """The venv's purelib directory, as its own interpreter reports it."""
    try:
        return Path(build_mod.venv_paths(python)["purelib"])
    except build_mod.BuildError as exc:
        raise E2EError(f"cannot find site-packages of {python}: {exc.message}") from None


def install(python: Path) -> Path:
    """Write the hook into the venv of ``python`` (idempotent); return the ``.pth`` path."""
    site = site_packages(python)
    (site / f"{MODULE}.py").write_text(_HOOK)
    pth = site / PTH
    pth.write_text(f"import {MODULE}\n")
    return pth
