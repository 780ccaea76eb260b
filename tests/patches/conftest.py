"""Patch tests run against a vLLM source tree selected with PYTHONPATH.

Each test names the one patch it proves with ``@pytest.mark.patch("<id>")``
(a test naming two is a usage error: a failure is charged to one patch); the
id is recorded as a junit property so ``hybridpd test`` can build the
red/green table per patch.

A test that covers a code path only some releases have says so with
``@pytest.mark.vllm_versions("<0.23")`` (a PEP 440 specifier set); on other
releases it is skipped with that reason.
"""

import os

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import vllm


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "patch(id): the hybridpd patch whose behaviour the test proves"
    )
    config.addinivalue_line(
        "markers", "vllm_versions(spec): vLLM releases whose code path the test covers"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    version = Version(vllm.__version__)
    only = os.environ.get("HYBRIDPD_PATCH_TESTS_OF")
    if only:  # a tree without that patch: only its own tests decide there
        kept = [i for i in items if only in {m.args[0] for m in i.iter_markers("patch")}]
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
    for item in items:
        # One patch per test: the red/green table charges a failure to it.
        named = {marker.args[0] for marker in item.iter_markers("patch")}
        if len(named) > 1:
            raise pytest.UsageError(
                f"{item.nodeid} names {len(named)} patches ({', '.join(sorted(named))}): "
                "a test proves one patch on a release"
            )
        for patch in named:
            item.user_properties.append(("patch", patch))
        for marker in item.iter_markers("vllm_versions"):
            spec = SpecifierSet(marker.args[0])
            if not spec.contains(version, prereleases=True):
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"covers vLLM {spec}, this is vLLM {version}"
                    )
                )
