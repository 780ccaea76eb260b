"""``hybridpd bench replay`` on 0.33.0's real scheduler classes (MTP also on 0.32.0's): the
connector sets with a store child (lmcache's LMCacheMPConnector, vLLM's OffloadingConnector,
each beside NIXL in both orders) and speculative decoding (MTP) on the decode instance, each
replayed stock then patched at a small scale. The figures asserted are vLLM's own counts,
read back.

Needs the pins' test environments (``hybridpd test --pin 0.33.0`` and ``--pin 0.32.0``
build them; CI runs this file in its full tier, with ``HYBRIDPD_BENCH_REAL=1``); skipped
otherwise, with the command that runs it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hybridpd.bench import deployment, replay
from hybridpd.series.model import load
from hybridpd.speculative import Speculative

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    os.environ.get("HYBRIDPD_BENCH_REAL") != "1",
    reason="needs 0.33.0's test environment: HYBRIDPD_BENCH_REAL=1 pytest "
           "tests/tool/test_bench_real.py (after hybridpd test --pin 0.33.0)")

#: 8 prompts of vllm#42524's shape (2 prefixes of 14 blocks), 4 in flight.
SMALL = deployment.Workload(num_prompts=8, output_len=8, concurrency=4)
CHILD = {"lmcache": "LMCacheMPConnector", "offloading": "OffloadingConnector"}


def _replay(connector: str, pin: str = "0.33.0", **extra) -> replay.ReplayReport:
    series = load(ROOT / "patches" / "series.toml")
    options = replay.ReplayOptions(series.pin(pin), SMALL, connector=connector,
                                   store_blocks=64, **extra)
    return replay.run(series, options)


@pytest.mark.parametrize("connector", ["nixl+lmcache", "lmcache+nixl", "nixl+offloading",
                                       "offloading+nixl"])
def test_store_sets_keep_the_decode_hit_patched_and_report_every_child(connector) -> None:
    report = _replay(connector)
    stock, patched = report.results["stock"], report.results["patched"]
    store = CHILD[connector.replace("nixl", "").strip("+")]
    for r in (stock, patched):
        assert set(r["served_by"]) == {store, "NixlPullConnector"}
        assert r["store_blocks"] == 64
    # The patched decode instance reuses every request's prefix (the limit) and NIXL
    # pulls the rest; stock's gate refuses the set (neither store declares the
    # capability), so its hit is below.
    assert patched["hit_tokens"] == patched["limit_tokens"] > 0
    assert stock["hit_tokens"] < patched["hit_tokens"]
    assert patched["served_by"]["NixlPullConnector"] > 0
    if connector == "lmcache+nixl":
        # First in the order, LMCache serves stock's requests the prefix it stored
        # when earlier ones finished: store hits.
        assert stock["served_by"]["LMCacheMPConnector"] > 0


def test_mtp_runs_vllms_settings_and_gives_up_one_block_per_request() -> None:
    report = _replay("nixl+decodebench", speculative=Speculative("mtp", 3))
    patched = report.results["patched"]
    spec = patched["speculative"]
    # Qwen3.5's one MTP module, reused 3 times: 3 lookahead slots, a prefill
    # lookahead of 1 (NIXL backs off 1 token, as for Mamba alone), and vLLM drops the
    # last matched block of every hit.
    assert (spec["mtp_modules"], spec["lookahead_slots"], spec["prefill_lookahead_tokens"],
            spec["nixl_prefill_backoff"], spec["drops_last_matched_block"]) == (1, 3, 1, 1, True)
    block = report.cost_model["block_size"]
    assert patched["limit_tokens"] - patched["hit_tokens"] == patched["limited_requests"] * block
    assert "draft_ms_per_step" in report.cost_model["per_step_and_pull"]


def test_mtp_on_0_32_sizes_the_offloading_tier_and_drops_the_last_matched_block() -> None:
    # v0.32's Offloading manager publishes only its chunk count (the tier is sized
    # from a probe's), and its coordinator flags the drafting groups (eagle_group_ids).
    report = _replay("offloading+nixl", pin="0.32.0", speculative=Speculative("mtp", 3))
    patched = report.results["patched"]
    assert patched["store_blocks"] == 64
    assert patched["speculative"]["drops_last_matched_block"] is True
    block = report.cost_model["block_size"]
    assert patched["limit_tokens"] - patched["hit_tokens"] == patched["limited_requests"] * block
