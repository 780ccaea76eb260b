"""Patch tests of the LMCache series (``patches/lmcache``).

Each test names the patch it proves with ``@pytest.mark.patch("<id>")`` (a JUnit
property, as in ``tests/patches``); a test naming none holds the patched tree to a
behaviour stock has and the series keeps.

``hybridpd --series patches/lmcache test`` runs them on the stock lmcache tree, on the
tree without each patch and on the patched tree: the tree under test is first on
``PYTHONPATH``, so every Python module of ``lmcache`` comes from it. A source tree has
no compiled modules (``lmcache_native`` and its siblings, built by lmcache's setup.py
at the top of the package); this finder loads them from the stock lmcache wheel of the
test environment's ``lmcache`` layer (:data:`hybridpd.proof.testenv.LAYERS`). The tests use
no CUDA op. It is installed before anything imports ``lmcache``: the package's
``__init__`` resolves its device ops through ``lmcache_native``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

import pytest


def _package_dirs() -> list[Path]:
    return [
        Path(entry or ".") / "lmcache"
        for entry in sys.path
        if (Path(entry or ".") / "lmcache" / "__init__.py").is_file()
    ]


class _CompiledFromLayer(importlib.abc.MetaPathFinder):
    """Finds ``lmcache.<name>`` extension modules in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def find_spec(self, name, path, target=None):
        package, _, module = name.partition(".")
        if package != "lmcache" or not module or "." in module:
            return None
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            candidate = self.directory / f"{module}{suffix}"
            if candidate.is_file():
                return importlib.util.spec_from_file_location(name, candidate)
        return None


_dirs = _package_dirs()
if not _dirs or not (_dirs[0].parent / "setup.py").is_file():
    # An installed lmcache first on the path would test the stock wheel on every tree.
    pytest.exit(f"lmcache is not imported from a source tree ({_dirs[:1]})", returncode=4)
_compiled = next((d for d in _dirs[1:] if any(d.glob("lmcache_native*.so"))), None)
if _compiled is None:
    pytest.exit("no stock lmcache build with lmcache_native on sys.path", returncode=4)
sys.meta_path.insert(0, _CompiledFromLayer(_compiled))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "patch(id): the hybridpd patch whose behaviour the test proves"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    only = os.environ.get("HYBRIDPD_PATCH_TESTS_OF")
    if only:  # a tree without that patch: only its own tests decide there
        kept = [i for i in items if only in {m.args[0] for m in i.iter_markers("patch")}]
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
    for item in items:
        for marker in item.iter_markers("patch"):
            item.user_properties.append(("patch", marker.args[0]))


@pytest.fixture
def server():
    """A fresh in-process ``lmcache server`` (see deployment.py)."""
    from lmcache_patches import deployment

    with deployment.lmcache_server() as srv:
        yield srv
