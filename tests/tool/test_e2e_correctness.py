"""The correctness scenario's requests, checks and table (no servers)."""

from __future__ import annotations

import pytest

from hybridpd.e2e import report as report_mod
from hybridpd.e2e import client, correctness
from hybridpd.e2e import pair as pair_mod
from hybridpd.e2e.servers import E2EError, ProcessFailed
from hybridpd.e2e.run import _failures

from builders import stub_pin

OPTS = correctness.CorrectnessOptions(block_size=128, prefix_blocks=4, max_tokens=16, concurrent=3)


def test_cases_cover_each_fallback_on_an_exact_block_aligned_prefix() -> None:
    cases = correctness.correctness_cases(1000, OPTS)
    prefix = 4 * 128
    a, b, c, d, *concurrent = cases
    assert [x["via"] for x in cases] == ["pd", "pd", "pd", "decode", "pd", "pd", "pd"]
    assert b["prompt"][:prefix] == a["prompt"][:prefix]
    assert b["prompt"][prefix] != a["prompt"][prefix] or b["prompt"] != a["prompt"]
    assert len(c["prompt"]) == prefix + 1 and c["prompt"][:prefix] == a["prompt"][:prefix]
    assert d["prompt"][:prefix] == a["prompt"][:prefix]
    assert all(x["group"] == 1 and x["prompt"][:prefix] == a["prompt"][:prefix] for x in concurrent)
    assert min(t for x in cases for t in x["prompt"]) >= 2  # no special tokens
    assert correctness.correctness_cases(1000, OPTS) == cases  # seeded


def test_concurrent_prompt_span_is_the_concurrent_requests_prefix_and_longest_prompt() -> None:
    concurrent = [c for c in correctness.correctness_cases(1000, OPTS) if c["group"] == 1]
    prefix, longest = correctness.concurrent_prompt_span(OPTS)
    assert longest == max(len(c["prompt"]) for c in concurrent)
    shared = concurrent[0]["prompt"][:prefix]
    assert all(c["prompt"][:prefix] == shared for c in concurrent)
    assert len({c["prompt"][prefix] for c in concurrent}) > 1  # they part right after it


def _run(
    build: str, equal: bool = True, preemptions: int = 2, hit: int = 512
) -> report_mod.RunResult:
    rows = [
        {"label": label, "via": "pd", "prompt_tokens": 600, "output_token_ids": [3] * 16,
         "reference_token_ids": [3] * 16 if equal or i else [4] * 16, "equal": equal or i > 0,
         "common_prefix_tokens": 16 if equal or i else 0,
         "note": "" if equal or i else "token 0: 3 where the reference has 4 (not in its top)",
         "decode_local_hit_tokens": hit if i == 1 else 0}
        for i, label in enumerate(["A", "B", "C", "D"])
    ]
    return report_mod.RunResult.from_json({"build": build, "connector": "nixl", "requests": rows,
            "decode_preemptions": preemptions,
            "checks": {"outputs_equal_reference": equal,
                       "decode_local_hit": hit > 0, "preemption_forced": preemptions > 0}})


def test_every_differing_output_fails_the_run() -> None:
    failures = _failures(_run("patched", equal=False), "correctness", False, stub_pin("0.32.0"))
    assert failures == [
        "patched / nixl: A differs from the single-instance reference: "
        "token 0: 3 where the reference has 4 (not in its top)"
    ]


def test_a_run_without_preemption_proves_nothing_about_it() -> None:
    failures = _failures(_run("patched", preemptions=0), "correctness", False, stub_pin("0.32.0"))
    assert failures == ["patched / nixl: no preemption on the decode instance (its pool admitted too few "
                        "requests at once, or held them all)"]


def test_the_gate_flag_also_asks_for_the_decode_hit() -> None:
    assert _failures(_run("patched"), "correctness", True, stub_pin("0.32.0")) == []
    assert _failures(_run("patched", hit=0), "correctness", True, stub_pin("0.32.0")) == [
        "patched / nixl: the decode instance took no local prefix hit for request B"
    ]
    assert _failures(_run("stock", hit=0), "correctness", True, stub_pin("0.32.0")) == []


def test_table_lists_every_request_and_the_preemptions() -> None:
    report = {"scenario": "correctness", "runs": [_run("patched", equal=False).to_json()]}
    lines = report_mod.table(report_mod.E2EReport.from_json(report))
    assert "| patched | nixl | A | 0 |  |  | NO | 0/16 |  |" in lines
    assert "| patched | nixl | B | 512 |  |  | yes | 16/16 |  |" in lines
    assert lines[-1] == "| patched | nixl | preemptions on D | 2 | | | | | |"


def test_table_splits_external_hits_per_child_where_measured() -> None:
    run = _run("patched").to_json()
    run["connector"] = "lmcache+nixl"
    run["requests"][0] |= {"decode_external_hit_tokens": 575, "kv_bytes_transferred": 599040,
                           "decode_external_hit_tokens_nixl": 575,
                           "decode_external_hit_tokens_lmcache": 0}
    run["requests"][1] |= {"decode_external_hit_tokens": 256, "kv_bytes_transferred": 0}
    lines = report_mod.table(report_mod.E2EReport.from_json(
        {"scenario": "correctness", "runs": [run]}))
    assert "| patched | lmcache+nixl | A | 0 | 575 (NIXL 575, LMCache 0) | 599040 | yes | 16/16 |  |" in lines
    assert "| patched | lmcache+nixl | B | 512 | 256 | 0 | yes | 16/16 |  |" in lines


def test_table_gives_each_requests_time_and_drafts() -> None:
    run = _run("patched").to_json()
    run["requests"][1] |= {"latency_ms": 1234.0, "decode_draft_tokens": 30,
                           "decode_accepted_tokens": 12}
    run["speculative"] = {"decode": {"draft_tokens": 300, "accepted_tokens": 120,
                                     "acceptance_rate": 0.4}, "prefill": None}
    report = report_mod.E2EReport.from_json({"scenario": "correctness", "runs": [run]})
    assert "| patched | nixl | B | 512 |  |  | yes | 16/16 | 1.23 (drafts 12/30) |" in (
        report_mod.table(report))
    md = report_mod.markdown(report)
    assert ("- patched / nixl: speculative decoding decode accepted 120 of 300 drafted tokens "
            "(acceptance rate 0.4)") in md
    assert "- patched / nixl: 1 requests, 1.23 s per request on average (max 1.23 s)" in md


def test_lmcache_loads_are_read_from_the_servers_log(tmp_path) -> None:
    from hybridpd.e2e import lmcache as lm

    log = tmp_path / "lmcache.log"
    log.write_text("LMCache INFO: Stored 512 tokens in 0.003 seconds\n"
                   "LMCache INFO: Retrieved 256 tokens in 0.002 seconds (x.py:1)\n")
    loads = lm.RetrievedTokens(log)  # loads before it was made are not counted
    with log.open("a") as f:
        f.write("LMCache INFO: Retrieved 256 tokens in 0.002 seconds\n"
                "LMCache INFO: Retrieved 512 tokens in 0.004 seconds\nLMCache INFO: Retr")
    assert loads.take() == 768
    assert loads.take() == 0
    with log.open("a") as f:
        f.write("ieved 256 tokens in 0.1 seconds\n")
    assert loads.take() == 256
    assert lm.RetrievedTokens(tmp_path / "none.log").take() == 0


def _c(ids, lps, tops=None) -> client.Completion:
    return client.Completion(ids, "", 0.0, 0.0, 1, [f"t{i}" for i in ids], lps,
                         tops or [{f"t{i}": lp} for i, lp in zip(ids, lps)])


def test_equal_outputs_within_tolerance_are_equal() -> None:
    assert correctness.compare_with_reference(
        _c([5, 6], [-1.0, -2.0]), _c([5, 6], [-1.05, -2.02])) == (True, "")


def test_a_different_choice_is_accepted_only_as_a_near_tie_in_the_reference() -> None:
    ref = _c([5, 6], [-1.0, -2.0], [{"t5": -1.0}, {"t6": -2.0, "t7": -2.05}])
    ok, note = correctness.compare_with_reference(_c([5, 7], [-1.0, -2.04]), ref)
    assert ok and note == "tie at token 1 (0.050 nats apart)"
    far = _c([5, 6], [-1.0, -2.0], [{"t5": -1.0}, {"t6": -2.0, "t7": -3.5}])
    ok, note = correctness.compare_with_reference(_c([5, 7], [-1.0, -2.0]), far)
    assert not ok and note == "token 1: 7 where the reference has 6 (1.500 nats below)"
    ok, note = correctness.compare_with_reference(_c([9, 9], [-0.1, -0.1]), ref)
    assert not ok and note == "token 0: 9 where the reference has 5 (not in its top)"


def test_drifting_logprobs_of_the_same_tokens_fail() -> None:
    ok, note = correctness.compare_with_reference(_c([5, 6], [-1.0, -2.5]), _c([5, 6], [-1.0, -2.0]))
    assert not ok and note == "token 1: logprob -2.500 vs reference -2.000"


def _scored(prompt_len: int, rows: list[dict[int, float]]) -> list[dict[int, float]]:
    return [{}] * prompt_len + rows


def test_teacher_forced_accepts_a_recomputed_path_that_left_the_reference_at_a_tie() -> None:
    # The output took token 7 where the free-running reference took 6 (a near-tie), then
    # went on greedily from its own tokens: every token is the model's choice given them.
    out = _c([5, 7, 8], [-1.0, -2.0, -0.5])
    scored = _scored(3, [{5: -1.02, 9: -3.0}, {6: -1.95, 7: -2.05}, {8: -0.52, 2: -1.5}])
    ok, note = correctness.compare_teacher_forced(out, 3, scored)
    assert ok and note == "every token agrees with the teacher-forced reference (within 0.100 nats)"


def test_teacher_forced_fails_a_token_the_model_would_not_choose() -> None:
    # What a resume without the Mamba state gives: from token 2 on the request follows a
    # distribution that is not the model's, although its first tokens agree.
    out = _c([5, 6, 4], [-1.0, -2.0, -0.3])
    scored = _scored(3, [{5: -1.0}, {6: -2.0}, {8: -0.4, 4: -2.9}])
    ok, note = correctness.compare_teacher_forced(out, 3, scored)
    assert not ok and note == "token 2: 4 is 2.500 nats below the teacher-forced reference's choice"


def test_teacher_forced_fails_the_same_token_with_another_distribution() -> None:
    out = _c([5, 6], [-1.0, -0.2])
    scored = _scored(2, [{5: -1.0}, {6: -0.9}])
    ok, note = correctness.compare_teacher_forced(out, 2, scored)
    assert not ok and note == "token 1: logprob -0.200 vs teacher-forced -0.900"


def _flaky(monkeypatch, failures: list[Exception]) -> list[list[int]]:
    sent: list[list[int]] = []

    def complete(url, prompt, max_tokens, procs=None, **_k):
        sent.append(prompt)
        if failures:
            raise failures.pop(0)
        return _c([5, 6], [-1.0, -1.0])

    monkeypatch.setattr(client, "complete", complete)
    monkeypatch.setattr(client.time, "sleep", lambda _s: None)
    return sent


PAIR = pair_mod.Pair("http://p", "http://d", "http://proxy")


def test_the_warm_up_is_sent_again_after_a_failed_handshake(monkeypatch) -> None:
    aborted = E2EError("http://proxy returned 0 tokens, expected 2")
    sent = _flaky(monkeypatch, [aborted, aborted])
    lines: list[str] = []
    assert client.warm_up(PAIR, None, 1000, 64, lines.append) == 3
    assert len(sent) == 3 and all(p == sent[0] and len(p) == 64 for p in sent)
    assert lines == [
        "  warm-up request failed (http://proxy returned 0 tokens, expected 2); "
        "sending it again (2/3)",
        "  warm-up request failed (http://proxy returned 0 tokens, expected 2); "
        "sending it again (3/3)",
    ]


def test_the_warm_up_gives_up_after_its_attempts_and_never_retries_a_dead_server(
    monkeypatch,
) -> None:
    aborted = E2EError("http://proxy returned 0 tokens, expected 2")
    _flaky(monkeypatch, [aborted, aborted, aborted])
    with pytest.raises(E2EError, match="the warm-up request failed 3 times"):
        client.warm_up(PAIR, None, 1000, 64, lambda _m: None)
    sent = _flaky(monkeypatch, [ProcessFailed("decode", "exited with 1", None)])
    with pytest.raises(ProcessFailed):
        client.warm_up(PAIR, None, 1000, 64, lambda _m: None)
    assert len(sent) == 1



def test_segments_the_lmcache_server_left_fail_the_run_and_show_in_the_table() -> None:
    run = _run("patched").to_json()
    run["connector"] = "lmcache+nixl"
    run["checks"]["lmcache_removed_exited_segments"] = False
    run |= {"decode_shm_segments_while_serving": 1,
            "decode_shm_segments_left_by_lmcache": ["lmcache_kv_7_0"]}
    result = report_mod.RunResult.from_json(run)
    assert _failures(result, "correctness", False, stub_pin("0.32.0")) == [
        "patched / lmcache+nixl: the lmcache server left the stopped decode instance's "
        "shared-memory segments behind (or it registered none): ['lmcache_kv_7_0']"
    ]
    lines = report_mod.table(report_mod.E2EReport.from_json(
        {"scenario": "correctness", "runs": [run]}))
    assert lines[-1] == ("| patched | lmcache+nixl | D's LMCache segments while serving "
                         "/ left once vLLM and its lmcache server stopped | | 1 / 1 | | | | |")
    run["checks"]["lmcache_removed_exited_segments"] = True
    run["decode_shm_segments_left_by_lmcache"] = []
    assert _failures(report_mod.RunResult.from_json(run), "correctness", False, stub_pin("0.32.0")) == []


def test_fail_fast_stops_at_the_first_differing_output(monkeypatch, tmp_path) -> None:
    # The mutant gate's run: request C differs, so the run ends there. No concurrent
    # request (64 tokens) and no teacher-forced scoring is sent; C's line is the failure.
    from types import SimpleNamespace

    sent: list[tuple[str, int]] = []

    def complete(url, prompt, max_tokens, procs, extra=None, headers=None):
        sent.append((url, max_tokens))
        # The decode side of C (its prompt: the prefix + 1 token) answers wrongly.
        wrong = url != "P" and len(prompt) == OPTS.prefix_blocks * OPTS.block_size + 1
        ids = [7] * max_tokens if wrong else [5] * max_tokens
        return client.Completion(ids, "", 1.0, 2.0, len(prompt), [""] * max_tokens,
                                 [-0.1] * max_tokens, [{}] * max_tokens)

    class Snap:
        def delta(self, before, name):
            return 0.0

        def has(self, name):  # no speculative decoding
            return False

    monkeypatch.setattr(correctness, "complete", complete)
    monkeypatch.setattr(correctness, "post", lambda url: None)
    monkeypatch.setattr(correctness, "settled_scrape", lambda url, wait=1.0: Snap())
    monkeypatch.setattr(correctness, "warm_up", lambda *a, **k: 1)
    monkeypatch.setattr(correctness, "score", lambda *a, **k: pytest.fail("scored"))
    pair = pair_mod.Pair(prefill="P", decode="D", front="X")
    procs = SimpleNamespace(log_dir=tmp_path)
    opts = correctness.CorrectnessOptions(block_size=128, prefix_blocks=4, max_tokens=16,
                                          concurrent=3, fail_fast=True)
    result = correctness.run_correctness(pair, procs, 1000, opts, lambda line: None)
    assert [r["label"] for r in result["requests"]] == [
        "A warm-up", "B shares A's block-aligned prefix", "C A's prefix + 1 token"]
    assert result["stopped_early"] == "C A's prefix + 1 token"
    assert result["checks"]["outputs_equal_reference"] is False
    assert all(n == 16 for _, n in sent)  # no concurrent request was sent
    run = report_mod.RunResult.from_json({
        "build": "patched", "connector": "nixl", **result})
    lines = _failures(run, "correctness", True, stub_pin("0.32.0"))
    assert lines[0] == (f"patched / nixl: C A's prefix + 1 token differs from the "
                        f"single-instance reference: {result['requests'][2]['note']}")
