"""Every name the tool's code uses is defined: pyflakes' undefined-name check over
``tool/`` and ``tests/`` (a moved function once kept calling a helper its new module did
not have, and only a CI e2e run found it)."""

from __future__ import annotations

from pathlib import Path

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api", reason="pyflakes is in the test extra")
from pyflakes import messages  # noqa: E402
from pyflakes.reporter import Reporter  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
UNDEFINED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


class _Collect(Reporter):
    def __init__(self) -> None:
        super().__init__(None, None)
        self.found: list[str] = []

    def flake(self, message) -> None:
        if isinstance(message, UNDEFINED):
            self.found.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text) -> None:
        self.found.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg) -> None:
        self.found.append(f"{filename}: {msg}")


def test_no_undefined_names() -> None:
    reporter = _Collect()
    files = sorted((ROOT / "tool").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    for path in files:
        pyflakes_api.checkPath(str(path), reporter)
    assert reporter.found == []
