"""``hybridpd explain`` on the real pins (0.32.0, 0.33.0): the Qwen3.5-35B-A3B config
the tool ships, with the connector sets the issue names, answered by vLLM in the pins'
test environments. The verdicts below are vLLM's own behaviour, read back: a change
in vLLM's code that changes one fails here.

Needs each pin's test environment (``hybridpd test --pin V`` builds it; CI runs this
file after that step, with ``HYBRIDPD_EXPLAIN_REAL=1``); skipped otherwise, with the
command that runs it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hybridpd.explain import connectors, render, runner
from hybridpd.series import load

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(ROOT / "tool" / "hybridpd" / "data" / "hf" / "Qwen--Qwen3.5-35B-A3B")

pytestmark = pytest.mark.skipif(
    os.environ.get("HYBRIDPD_EXPLAIN_REAL") != "1",
    reason="needs the pins' test environments: HYBRIDPD_EXPLAIN_REAL=1 pytest "
           "tests/tool/test_explain_real.py (after hybridpd test --pin 0.32.0 and 0.33.0)")

#: (connector set, extra options) -> what vLLM answers, the same stock and with the series.
CASES = {
    "nixl": ("nixl", {}),
    "nixl+offloading": ("nixl+offloading", {}),
    "lmcache-v1": ("lmcache-v1", {}),
    "nixl, no HMA": ("nixl", {"disable_hybrid_kv_cache_manager": True}),
}


@pytest.fixture(scope="module", params=["0.32.0", "0.33.0"])
def answers(request) -> dict[str, runner.Explained]:
    series = load(ROOT / "patches" / "series.toml")
    opts = [runner.ExplainOptions(model=MODEL,
                                  kv_transfer_config=connectors.kv_transfer_config(c, None),
                                  timeout=600.0, **extra)
            for c, extra in CASES.values()]
    return dict(zip(CASES, runner.explain_cases(series, request.param, opts)))


def _both(result: runner.Explained, key: str) -> str:
    stock, patched = (render.verdict(result.answers[s], key) for s in runner.SIDES)
    assert stock == patched, f"{key}: stock {stock!r}, with the series {patched!r}"
    return stock


def test_nixl_keeps_the_hybrid_manager_and_groups_mamba_with_attention(answers) -> None:
    result = answers["nixl"]
    assert "language model" in result.note  # the shipped config has no tokenizer
    assert "hybrid KV cache manager kept, mamba_cache_mode align" in _both(result, "start")
    groups = result.answers["stock"]["steps"]["groups"]
    assert [g["type"] for g in groups["groups"]] == ["MambaSpec"] * 3 + ["FullAttentionSpec"]
    assert all(g["layers"] == 10 for g in groups["groups"])  # 40 layers, 1 in 4 attention
    # vLLM raised the block size until an attention page holds a Mamba state.
    assert groups["block_size"] > 128
    assert groups["mamba_page_size_padded"] == groups["groups"][-1]["page_size_bytes"]
    # The CPU platform turns async scheduling off (a GPU engine builds AsyncScheduler).
    assert _both(result, "scheduler") == (
        "Scheduler built, scheduler-side connector NixlPullConnector")


def test_nixl_beside_offloading_builds(answers) -> None:
    assert _both(answers["nixl+offloading"], "scheduler") == (
        "Scheduler built, scheduler-side connector "
        "MultiConnector[NixlPullConnector, OffloadingConnector]")


@pytest.mark.parametrize("case", ["lmcache-v1", "nixl, no HMA"])
def test_without_the_hybrid_manager_vllm_refuses_the_hybrid_groups(answers, case) -> None:
    """LMCacheConnectorV1 turns the hybrid KV cache manager off, as the flag does; vLLM
    then cannot put Mamba and attention layers in one group (operators' report:
    "failed to convert the KV cache specs to one unified type")."""
    result = answers[case]
    assert "hybrid KV cache manager turned off" in _both(result, "start")
    assert _both(result, "groups").startswith(
        "refused: ValueError: Failed to promote local KV cache specs to one unified type.")
    assert _both(result, "scheduler") == "not reached"
