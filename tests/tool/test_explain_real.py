"""``hybridpd explain`` on the real pins (0.32.0, 0.33.0): the Qwen3.5-35B-A3B config
the tool ships, with the connector sets the issue names, answered by vLLM in the pins'
test environments. The verdicts below are vLLM's own behaviour, read back: a change
in vLLM's code that changes one fails here.

Needs each pin's test environment (``hybridpd test --pin V`` builds it; CI runs this
file after that step, with ``HYBRIDPD_EXPLAIN_REAL=1``); skipped otherwise, with the
command that runs it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hybridpd.explain import render, runner
from hybridpd import connectors
from hybridpd.series.model import load

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(ROOT / "tool" / "hybridpd" / "data" / "hf" / "Qwen--Qwen3.5-35B-A3B")

pytestmark = pytest.mark.skipif(
    os.environ.get("HYBRIDPD_EXPLAIN_REAL") != "1",
    reason="needs the pins' test environments: HYBRIDPD_EXPLAIN_REAL=1 pytest "
           "tests/tool/test_explain_real.py (after hybridpd test --pin 0.32.0 and 0.33.0)")

#: (connector set, extra options) -> what vLLM answers. LMCache MP beside NIXL in both
#: orders (lmcache's own class, its server stood in), one with prefill steps of at
#: least two blocks (the LMCache series' null-slot risk).
CASES = {
    "nixl": ("nixl", {}),
    "nixl+offloading": ("nixl+offloading", {}),
    "nixl+lmcache": ("nixl+lmcache", {"max_num_batched_tokens": 4096}),
    "lmcache+nixl": ("lmcache+nixl", {}),
    "lmcache-v1": ("lmcache-v1", {}),
    "nixl, no HMA": ("nixl", {"disable_hybrid_kv_cache_manager": True}),
    "nixl, TP 2": ("nixl", {"tensor_parallel_size": 2}),
    "nixl, MTP 3": ("nixl", {"speculative_config": {"method": "mtp",
                                                    "num_speculative_tokens": 3}}),
    # Multi-module MTP: a checkpoint with three MTP modules (:func:`_three_mtp_modules`).
    "nixl, 3 MTP modules": ("nixl", {"model": "three-mtp-modules",
                                     "speculative_config": {"method": "mtp",
                                                            "num_speculative_tokens": 3}}),
}
#: Qwen3-Next's config (Gated DeltaNet and full attention, like Qwen3.5) with three MTP
#: modules (``num_nextn_predict_layers``) and 4 layers (the layout's unit).
THREE_MTP_MODULES = ROOT / "tool" / "hybridpd" / "data" / "hf" / "Qwen--Qwen3-Next-80B-A3B-Instruct"


def _three_mtp_modules(root: Path) -> str:
    config = json.loads((THREE_MTP_MODULES / "config.json").read_text())
    config.update(num_nextn_predict_layers=3, num_hidden_layers=4)
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


@pytest.fixture(scope="module", params=["0.32.0", "0.33.0"])
def answers(request, tmp_path_factory) -> dict[str, runner.Explained]:
    series = load(ROOT / "patches" / "series.toml")
    models = {"three-mtp-modules": _three_mtp_modules(tmp_path_factory.mktemp("mtp3"))}
    opts = [runner.ExplainOptions(model=models.get(extra.get("model"), MODEL),
                                  kv_transfer_config=connectors.kv_transfer_config(c, None),
                                  timeout=600.0,
                                  **{k: v for k, v in extra.items() if k != "model"})
            for c, extra in CASES.values()]
    return dict(zip(CASES, runner.explain_cases(series, series.pin(request.param), opts)))


def _both(result: runner.Explained, key: str) -> str:
    stock, patched = (render.verdict(result.answers[s], key) for s in runner.SIDES)
    assert stock == patched, f"{key}: stock {stock!r}, with the series {patched!r}"
    return stock


def _schedulers(result: runner.Explained) -> list[str]:
    """Each side's scheduler line: they differ in what the KV events say
    (``kv-events-stored-per-block-run``)."""
    return [render.verdict(result.answers[s], "scheduler") for s in runner.SIDES]


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
    assert all(line.startswith(
        "Scheduler built, scheduler-side connector NixlPullConnector; KV events")
        for line in _schedulers(result))


def test_tensor_parallel_answers_for_one_rank(answers) -> None:
    # Each rank holds half of the linear-attention heads and one of the two KV heads:
    # every page halves, the same memory holds twice the blocks, and the groups and
    # their block size are the same.
    result = answers["nixl, TP 2"]
    assert "tensor parallel 2 (one rank's KV cache below)" in _both(result, "start")
    one, two = (answers[c].answers["stock"]["steps"]["groups"] for c in ("nixl", "nixl, TP 2"))
    assert [g["type"] for g in two["groups"]] == [g["type"] for g in one["groups"]]
    assert two["block_size"] == one["block_size"]
    assert two["mamba_page_size_padded"] * 2 == one["mamba_page_size_padded"]
    assert abs(two["num_blocks"] - 2 * one["num_blocks"]) <= 1
    for side in runner.SIDES:
        assert render.verdict(result.answers[side], "decode_hit") == render.verdict(
            answers["nixl"].answers[side], "decode_hit"), side


def test_nixl_beside_offloading_builds(answers) -> None:
    assert all(line.startswith(
        "Scheduler built, scheduler-side connector "
        "MultiConnector[NixlPullConnector, OffloadingConnector]; KV events")
        for line in _schedulers(answers["nixl+offloading"]))


def test_a_router_is_told_the_realigned_block_size_the_kv_events_carry(answers) -> None:
    # Every group's BlockStored carries the block size vLLM raised until an
    # attention page holds a Mamba state: a router's --kv-event-block-size.
    result = answers["nixl"]
    groups = result.answers["stock"]["steps"]["groups"]
    scheduler = result.answers["stock"]["steps"]["scheduler"]
    size = groups["block_size"]
    assert [g["block_size"] for g in scheduler["kv_events"]] == [size] * 4
    assert [g.get("mamba_cache_mode") for g in scheduler["kv_events"]] == ["align"] * 3 + [None]
    head = (f"KV events carry block_size {size}: a router needs --kv-event-block-size "
            f"{size}; the Mamba groups (3, align mode) announce only the blocks that hold a "
            "state, ")
    stock, patched = _schedulers(result)
    assert head + "with token_ids over every block of the range (vllm#44451)" in stock
    assert head + "one BlockStored per run of cached blocks" in patched


def test_stock_and_the_series_publish_a_skipping_groups_blocks_differently(answers) -> None:
    """What each tree's own BlockPool published for a group that caches only the
    last of three blocks (a Mamba group in align mode): stock pairs that block's hash
    with the tokens of all three and no parent (vllm#44451); with the series
    (kv-events-stored-per-block-run) the event holds that block's tokens alone and
    its parent is the block before it."""
    said = {side: answers["nixl"].answers[side]["steps"]["scheduler"]["block_stored"]
            for side in runner.SIDES}
    assert said == {
        "stock": {"layout": "--x", "per_run": False, "events": [
            {"hashes": [2], "token_blocks": [0, 1, 2], "parent": None}]},
        "patched": {"layout": "--x", "per_run": True, "events": [
            {"hashes": [2], "token_blocks": [2], "parent": 1}]}}


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


def _followers(result: runner.Explained) -> dict[str, dict[str, dict]]:
    """Question 3's answers: {side: {follower kind: answer}}. An environment without
    lmcache's class answers the LMCache MP sets "unknown here" (skipped, with why), as
    the patch tests of those sets skip there."""
    for side in runner.SIDES:
        scheduler = result.answers[side]["steps"]["scheduler"]
        if "unknown" in scheduler and "lmcache's class" in scheduler["unknown"]:
            pytest.skip(scheduler["unknown"])
    return {side: {r["kind"]: r for r in result.answers[side]["steps"]["decode_hit"]["requests"]}
            for side in runner.SIDES}


@pytest.mark.parametrize("case", ["nixl", "nixl+offloading", "nixl+lmcache", "lmcache+nixl"])
def test_no_follower_resumes_without_its_mamba_state(answers, case) -> None:
    """The invariant, on both trees: every follower's Mamba state exists where it
    resumes (a NIXL load ending where the prefiller's state belongs, or computing
    from 0); a plain request sent to the decode instance gets no stateless hit."""
    followers = _followers(answers[case])
    for side in runner.SIDES:
        states = {k: f["mamba_state"] for k, f in followers[side].items()}
        assert states.pop("remote_prefill_prefix_plus_one") in ("loaded", "not needed")
        assert states == {"remote_prefill": "loaded", "plain": "not needed"}, side
        assert followers[side]["remote_prefill"]["served_by"] == "NixlPullConnector"
        assert followers[side]["plain"]["local_hit_tokens"] == 0


@pytest.mark.parametrize("case", ["nixl+offloading", "nixl+lmcache", "lmcache+nixl"])
def test_a_remote_prefill_beside_a_non_capable_connector_keeps_its_hit_only_with_the_series(
        answers, case) -> None:
    """What tests/patches/decode_hit/test_connector_sets.py confirms: stock vLLM takes
    the divergent hit only when every connector declares it can, which neither the
    OffloadingConnector nor lmcache's LMCacheMPConnector does, so NIXL pulls the whole
    prompt again; the series keeps the local hit, NIXL bringing the Mamba state."""
    result = answers[case]
    followers = _followers(result)
    cached = result.answers["stock"]["steps"]["decode_hit"]["cached_prefix_tokens"]
    stock, patched = (followers[s]["remote_prefill"] for s in runner.SIDES)
    assert stock["local_hit_tokens"] == 0 and stock["external_tokens"] == stock["resume_point"]
    assert patched["local_hit_tokens"] == cached
    assert patched["resume_point"] == patched["prompt_tokens"] - 1  # where NIXL's state is
    assert render.verdict(result.answers["stock"], "decode_hit") != render.verdict(
        result.answers["patched"], "decode_hit")


def test_nixl_alone_keeps_the_hit_on_stock_and_the_series_also_past_upstreams_gate(
        answers) -> None:
    """NIXL alone is inside upstream's capability gate (stock keeps the remote prefill's
    hit); a prompt one token past the cached prefix is past it (test_mamba_state.py:
    stock recomputes from 0, the series pulls only the last block with the state)."""
    followers = _followers(answers["nixl"])
    cached = answers["nixl"].answers["stock"]["steps"]["decode_hit"]["cached_prefix_tokens"]
    block = answers["nixl"].answers["stock"]["steps"]["decode_hit"]["block_size"]
    for side in runner.SIDES:
        assert followers[side]["remote_prefill"]["local_hit_tokens"] == cached
        # The donor left the prefix's attention blocks and no Mamba state inside the
        # prefix, in any Mamba group (read from vLLM's block pool): the local hit of
        # a follower is divergent, its state comes only from a load.
        donor = answers["nixl"].answers[side]["steps"]["decode_hit"]["donor_prefix_mamba"]
        assert [g["blocks"] for g in donor] == [[], [], []], (side, donor)
    stock, patched = (followers[s]["remote_prefill_prefix_plus_one"] for s in runner.SIDES)
    assert (stock["resume_point"], stock["mamba_state"]) == (0, "not needed")
    assert (patched["local_hit_tokens"], patched["external_tokens"]) == (cached - block, block)
    assert patched["mamba_state"] == "loaded"


@pytest.mark.parametrize("case", ["lmcache-v1", "nixl, no HMA"])
def test_a_refused_set_measures_no_decode_side_hit(answers, case) -> None:
    assert _both(answers[case], "decode_hit") == "not reached"


def test_the_risks_come_from_the_records_with_their_fix_state(answers) -> None:
    """LMCache MP with prefill steps of two blocks or more stores null Mamba slots
    unless the LMCache series' fix is applied; a synchronous load (Offloading) on a
    full pool crashes unless the series' admission fix is; both from the records."""
    _followers(answers["nixl+lmcache"])  # skipped without lmcache's class
    lm = {r["id"]: r for r in answers["nixl+lmcache"].risks}
    assert lm["null-recurrent-slot-stored"]["fixed"]["stock"] is None
    assert lm["null-recurrent-slot-stored"]["fixed"]["patched"].startswith(
        "fixed by null-recurrent-slot-not-stored")
    assert lm["hybrid-wrong-outputs-reported"]["fixed"] == {"stock": None, "patched": None}
    # The other order runs vLLM's default step (2048 tokens < 2 blocks of 1152).
    assert "null-recurrent-slot-stored" not in {r["id"] for r in answers["lmcache+nixl"].risks}
    offload = {r["id"]: r for r in answers["nixl+offloading"].risks}
    assert offload["sync-load-admission-crash"]["fixed"] == {
        "stock": None, "patched": "fixed by mamba-align-admission-counts-sync-load"}
    assert "speculative-decoding-prefix-cache-gdn" not in offload


def test_mtp_builds_the_scheduler_with_vllms_settings_and_drops_a_block_of_the_hit(
        answers) -> None:
    """--speculative-config: vLLM's MTP on the shipped config (one module, reused 3
    times): 3 lookahead slots, a prefill lookahead of 1 (NIXL backs off 1 token, as for
    Mamba alone), and a hit that drops its last matched block, which the decode-side
    hit measured on that scheduler shows: one block less than without MTP."""
    result = answers["nixl, MTP 3"]
    assert all(line.endswith(
        "speculative decoding mtp, 3 tokens (one draft module, reused): 3 lookahead slot(s) "
        "per request, prefill lookahead 1, NIXL backs off 1 prompt token(s), a hit drops "
        "its last matched block") for line in _schedulers(result))
    mtp, plain = _followers(result), _followers(answers["nixl"])
    block = result.answers["stock"]["steps"]["decode_hit"]["block_size"]
    for side in runner.SIDES:
        assert (mtp[side]["remote_prefill"]["local_hit_tokens"]
                == plain[side]["remote_prefill"]["local_hit_tokens"] - block), side


def test_the_prompt_lengths_that_hang_stock_with_multi_module_mtp_are_served_patched(
        answers) -> None:
    """--speculative-config with three MTP modules: vLLM's prefill lookahead of 3 and
    NIXL's back-off of 2; a remote prefill one token past a block boundary resumes
    inside its last full block and, on stock, never gets a chunk (the align rule and
    the lookahead together); with the series it is served. Two tokens past the
    boundary it resumes on the boundary: served on both. The shipped Qwen3.5 config
    (one module, reused): its one probe is served on both."""
    result = answers["nixl, 3 MTP modules"]
    assert all("(one draft module per token): 3 lookahead slot(s) per request, prefill "
               "lookahead 3, NIXL backs off 2 prompt token(s)" in line
               for line in _schedulers(result))
    probes = {side: result.answers[side]["steps"]["hangs"] for side in runner.SIDES}
    block = probes["stock"]["block_size"]
    served = {side: {p["prompt_tokens"]: p["served"] for p in probes[side]["lookahead_chunk"]}
              for side in runner.SIDES}
    assert served == {"stock": {2 * block + 1: False, 2 * block + 2: True},
                      "patched": {2 * block + 1: True, 2 * block + 2: True}}
    one = answers["nixl, MTP 3"]
    for side in runner.SIDES:
        (probe,) = one.answers[side]["steps"]["hangs"]["lookahead_chunk"]
        assert probe["served"], (side, probe)
