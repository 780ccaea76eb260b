"""Patch tests run against a vLLM source tree selected with PYTHONPATH.

Each test names the patch it proves with ``@pytest.mark.patch("<id>")``; the
id is recorded as a junit property so ``hybridpd test`` can build the
red/green table per patch.
"""

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "patch(id): the hybridpd patch whose behaviour the test proves"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for marker in item.iter_markers("patch"):
            item.user_properties.append(("patch", marker.args[0]))
