"""Shared fixtures. Tests of the series tooling use ``isolated`` (via ``pytestmark``)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Give the processes the tests start the signal dispositions of a terminal.

    An ignored signal stays ignored across exec: under ``nohup`` (SIGHUP) or as a
    background job of a shell without job control (SIGINT), every hybridpd the tests
    start would ignore the very signals the interruption tests send it, and those
    tests would fail although hybridpd is right to honour an ignored signal.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)


@pytest.fixture
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Point caches, pip and git at nothing outside ``tmp_path``.

    pip's index is an empty ``file://`` directory unless a test sets its own, so a
    test can never reach a real index. Git runs without any global identity, which
    also proves hybridpd does not need one.
    """
    empty_index = tmp_path / "empty-index"
    empty_index.mkdir()
    monkeypatch.setenv("HYBRIDPD_CACHE", str(tmp_path / "cache"))
    for name in list(os.environ):
        if name.startswith("PIP_") or name in ("HYBRIDPD_SERIES", "GIT_DIR", "GIT_WORK_TREE"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", empty_index.as_uri())
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
