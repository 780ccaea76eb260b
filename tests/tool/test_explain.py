"""``hybridpd explain`` without vLLM: the connector sets, the model lookup, the
verdict lines, and the runner's handling of its two drivers (stand-in scripts in
their own process groups). The driver on real pins: tests/tool/test_explain_real.py."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from hybridpd import proc
from hybridpd.explain import model, render, runner
from hybridpd import connectors
from hybridpd.series.model import Series

from builders import stub_pin


def test_named_sets_are_vllms_kv_transfer_configs() -> None:
    nixl = connectors.kv_transfer_config("nixl", None)
    assert nixl == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    multi = connectors.kv_transfer_config("lmcache+nixl", None, "kv_consumer")
    assert multi["kv_connector"] == "MultiConnector" and multi["kv_role"] == "kv_consumer"
    children = multi["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector"] for c in children] == ["LMCacheMPConnector", "NixlConnector"]
    assert all(c["kv_role"] == "kv_consumer" for c in children)
    offload = connectors.kv_transfer_config("nixl+offloading", None)
    tier = offload["kv_connector_extra_config"]["connectors"][1]
    # vLLM refuses an OffloadingConnector without the CPU tier's size.
    assert tier["kv_connector_extra_config"] == {"cpu_bytes_to_use": 10 << 30}
    assert connectors.kv_transfer_config(None, None) is None


def test_vllms_own_json_is_taken_as_it_is(tmp_path: Path) -> None:
    cfg = {"kv_connector": "PdConnector", "kv_role": "kv_both", "x": [1]}
    assert connectors.kv_transfer_config(None, json.dumps(cfg)) == cfg
    (tmp_path / "kv.json").write_text(json.dumps(cfg))
    assert connectors.kv_transfer_config(None, f"@{tmp_path / 'kv.json'}") == cfg


@pytest.mark.parametrize(("connector", "text", "message"), [
    ("nixl", "{}", "not both"),
    ("pd", None, "not a known set"),
    (None, "{nope", "not JSON"),
    (None, "[1]", "a JSON object with kv_connector"),
    (None, "@/nonexistent/kv.json", "No such file"),
])
def test_bad_connector_input_is_one_line(connector, text, message) -> None:
    with pytest.raises(connectors.ConnectorError, match=message) as err:
        connectors.kv_transfer_config(connector, text)
    assert "\n" not in str(err.value)


def test_a_model_is_a_config_directory_or_a_cached_hub_id(tmp_path: Path) -> None:
    local = tmp_path / "m"
    local.mkdir()
    with pytest.raises(model.ModelError, match="no config.json"):
        model.resolve(str(local))
    (local / "config.json").write_text("{}")
    assert model.resolve(str(local)) == local.resolve()
    hub = tmp_path / "hub"
    snap = hub / "models--Org--Name" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    with pytest.raises(model.ModelError, match="not in the Hugging Face cache"):
        model.resolve("Org/Name", hub)
    (hub / "models--Org--Name" / "refs").mkdir()
    (hub / "models--Org--Name" / "refs" / "main").write_text("abc\n")
    assert model.resolve("Org/Name", hub) == snap
    with pytest.raises(model.ModelError, match="neither a directory nor a hub id"):
        model.resolve("a/b/c", hub)


def test_a_multimodal_config_without_a_tokenizer_is_answered_text_only(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2] / "tool" / "hybridpd" / "data" / "hf"
    note = model.text_only(root / "Qwen--Qwen3.5-35B-A3B")
    assert note and "Qwen3_5MoeForConditionalGeneration's language model" in note
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3_5ForConditionalGeneration"]}))
    (tmp_path / "tokenizer.json").write_text("{}")
    assert model.text_only(tmp_path) is None  # vLLM can build its processor
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForCausalLM"]}))
    assert model.text_only(tmp_path) is None


START = {"architecture": "Qwen3_5MoeForConditionalGeneration",
         "hybrid_kv_cache_manager": True, "mamba_cache_mode": "align",
         "enable_prefix_caching": True, "max_num_batched_tokens": 2048, "block_size": 128}
GROUPS = {"kv_cache_bytes": 16 << 30, "block_size": 1152, "mamba_page_size_padded": 2359296, "num_blocks": 728,
          "groups": [*[{"layers": 10, "type": "MambaSpec", "mamba_cache_mode": "align"}] * 3,
                     {"layers": 10, "type": "FullAttentionSpec"}]}
REFUSED = {"error": "ValueError: Failed to promote local KV cache specs to one unified type.",
           "raised_at": "vllm/v1/core/kv_cache_utils.py:1760"}


def _result(stock: dict, patched: dict) -> runner.Explained:
    return runner.Explained(stub_pin("0.32.0"), "Org/Name", {"kv_connector": "NixlConnector"}, None,
                            {"stock": stock, "patched": patched}, 12.34)


def test_verdicts_name_each_question_once_when_both_trees_agree() -> None:
    answer = {"steps": {"start": START, "groups": GROUPS,
                        "scheduler": {"class": "Scheduler", "connector": "NixlPullConnector"}}}
    lines = render.lines(_result(answer, answer))
    assert lines[0] == ('explain: vLLM 0.32.0, model Org/Name, kv_transfer_config '
                        '{"kv_connector": "NixlConnector"}')
    assert lines[1] == render.CAVEAT
    assert lines[2].startswith("1. config accepted: yes "
                               "(Qwen3_5MoeForConditionalGeneration); hybrid KV cache "
                               "manager kept")
    assert lines[3] == ("2. KV cache groups: block size 1152 tokens; 3 x MambaSpec (align) "
                        "of 10 layers, 1 x FullAttentionSpec of 10 layers; Mamba pages "
                        "padded to 2359296 bytes; 728 blocks in 16 GiB (stock and with the "
                        "series)")
    assert lines[4] == ("3. scheduler and connector: Scheduler built, scheduler-side "
                        "connector NixlPullConnector (stock and with the series)")
    assert lines[-1] == "took 12.3 s"


def test_a_refusal_is_vllms_text_and_frame_and_later_steps_are_not_reached() -> None:
    stock = {"steps": {"start": {**START, "hybrid_kv_cache_manager": False},
                       "groups": REFUSED}}
    patched = {"steps": {"start": START, "groups": GROUPS,
                         "scheduler": {"class": "AsyncScheduler", "connector": None}}}
    lines = render.lines(_result(stock, patched))
    at = lines.index("2. KV cache groups:")
    assert lines[at + 1] == ("   stock: refused: ValueError: Failed to promote local KV cache "
                             "specs to one unified type. "
                             "(vllm/v1/core/kv_cache_utils.py:1760)")
    assert lines[at + 2].startswith("   with the series: block size 1152 tokens")
    assert "3. scheduler and connector:" in lines
    assert "   stock: not reached" in lines
    assert "   with the series: AsyncScheduler built, no KV connector" in lines


def test_an_unanswered_side_is_said_once() -> None:
    answer = {"steps": {"start": START, "groups": GROUPS,
                        "scheduler": {"connector": "NixlPullConnector"}}}
    lines = render.lines(_result({"failed": "no answer within 300 s; log x"}, answer))
    assert "  stock: unknown here: no answer within 300 s; log x" in lines
    assert lines[3].endswith("(with the series)")
    none = render.lines(_result({"failed": "a"}, {"failed": "b"}))
    assert [l for l in none if l[0].isdigit()] == []


#: Put before every stand-in driver: ``step(...)`` prints a step as the real driver does.
STEPS = '''
import json
def step(**said):
    print("HYBRIDPD-EXPLAIN-STEP " + json.dumps({"case": 0, **said}), flush=True)
'''


@pytest.fixture
def side_by_side(tmp_path: Path, monkeypatch):
    """The runner's two drivers as stand-in scripts (``stock`` and ``patched`` trees
    are plain directories); returns a function running them with a script body."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    trees = {}
    for side in runner.SIDES:
        trees[side] = tmp_path / side
        (trees[side] / "vllm.egg-info").mkdir(parents=True)  # an sdist tree's metadata
        (trees[side] / "vllm.egg-info" / "PKG-INFO").write_text(
            "Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n")

    def run(body: str, timeout: float = 30.0):
        script = tmp_path / "driver.py"
        script.write_text(STEPS + textwrap.dedent(body))
        monkeypatch.setattr(runner, "DRIVER", script)
        answers, logs = runner._run_side_by_side(
            venv, trees, tmp_path / "site", [], tmp_path, {"cases": [{"model": "m"}]}, timeout)
        return {side: answers[side][0] for side in answers}, logs

    return run


def test_the_two_drivers_answer_side_by_side(side_by_side) -> None:
    answers, logs = side_by_side('''
        import json, os, sys
        tree = os.path.basename(os.getcwd())
        print("vLLM's own log line")
        request = json.loads(sys.argv[1])["cases"][0]
        print("HYBRIDPD-EXPLAIN " + json.dumps([{"tree": tree, "request": request}]))
    ''')
    assert answers["stock"] == {"tree": "stock", "request": {"model": "m"}}
    assert answers["patched"]["tree"] == "patched"
    assert "vLLM's own log line" in Path(logs["stock"]).read_text()


def test_a_driver_that_hangs_is_stopped_with_its_group(side_by_side, tmp_path: Path) -> None:
    answers, logs = side_by_side('''
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open(os.path.join(os.path.dirname(os.getcwd()), os.path.basename(os.getcwd()) + ".pids"),
             "w").write(f"{os.getpid()} {child.pid}")
        time.sleep(60)
    ''', timeout=10.0)  # room for two interpreters to start on 2 busy cores
    for side in runner.SIDES:
        assert answers[side]["failed"].startswith("no answer within 10 s; log ")
        for pid in map(int, (tmp_path / f"{side}.pids").read_text().split()):
            assert proc.identity(pid) is None, f"{side}: {pid} left running"


def test_a_driver_that_dies_says_why(side_by_side) -> None:
    answers, _ = side_by_side('''
        import sys
        print("Traceback (most recent call last):")
        print("ImportError: cannot import name 'EngineArgs'")
        sys.exit(3)
    ''')
    assert answers["stock"]["failed"].startswith(
        "the driver exited with 3 without an answer: ImportError: cannot import name")


def test_a_driver_that_dies_in_a_step_keeps_the_steps_before_it(side_by_side) -> None:
    answers, logs = side_by_side('''
        import os
        step(running="start")
        step(done="start", answer={"block_size": 128})
        step(running="groups")
        print("HYBRIDPD-EXPLAIN-STEP {\\"case\\": 0, \\"do", flush=True)  # cut short
        os._exit(137)
    ''')
    assert answers["stock"] == {"steps": {
        "start": {"block_size": 128}, "groups": {"exited": 137, "log": logs["stock"]}}}
    assert render.verdict(answers["stock"], "groups") == (
        f"the driver died here (exit 137; log {logs['stock']})")


def test_a_refusal_vllm_would_not_make_on_a_gpu_is_unknown_here() -> None:
    step = {"error": "AttributeError: 'Worker' object has no attribute 'x'",
            "raised_at": "vllm/v1/executor/abstract.py:170",
            "unknown": "explain's stand-in for the engine's worker lacks what vLLM asked"}
    assert render.verdict({"steps": {"groups": step}}, "groups") == (
        "unknown here: explain's stand-in for the engine's worker lacks what vLLM asked; "
        "vLLM raised AttributeError: 'Worker' object has no attribute 'x' "
        "(vllm/v1/executor/abstract.py:170)")


def _raise_in(path: str, exc: BaseException) -> BaseException:
    """``exc`` raised by code whose file is ``path`` (a frame the driver classifies)."""
    code = compile("def f(exc):\n    raise exc\n", path, "exec")
    scope: dict = {}
    exec(code, scope)
    try:
        scope["f"](exc)
    except BaseException as raised:  # noqa: BLE001
        return raised
    raise AssertionError("not raised")


def test_the_driver_tells_vllms_refusals_from_what_it_cannot_answer() -> None:
    from hybridpd.explain import driver

    refusal = driver._error(_raise_in("/t/vllm/v1/core/kv_cache_utils.py", ValueError(
        "Failed to promote local KV cache specs to one unified type.")))
    assert refusal == {"error": "ValueError: Failed to promote local KV cache specs to one "
                                "unified type.",
                       "raised_at": "vllm/v1/core/kv_cache_utils.py:2"}
    cpu = driver._error(_raise_in("/t/vllm/platforms/cpu.py", RuntimeError("no AMX")))
    assert cpu["unknown"].startswith("raised by vLLM's CPU platform")
    stand_in = driver._error(_raise_in(driver.__file__, AttributeError("get_x")))
    assert stand_in["unknown"].startswith("explain's stand-in for the engine's worker")
    try:
        try:
            raise ModuleNotFoundError("No module named 'torchvision'", name="torchvision")
        except ModuleNotFoundError as cause:
            raise ValueError("Model architectures failed to be inspected") from cause
    except ValueError as exc:
        missing = driver._error(exc)
    assert missing["unknown"].startswith("the test environment lacks torchvision")
    inspected = driver._error(_raise_in("/t/vllm/engine/arg_utils.py", ValueError(
        "Model architectures ['Qwen3_5MoeForConditionalGeneration'] failed to be "
        "inspected. Please check the logs for more details.")))
    assert inspected["unknown"].startswith("vLLM's model inspection subprocess failed")
    assert driver._waits_for_a_server(connectors.kv_transfer_config("nixl+lmcache", None))
    assert render.verdict({"steps": {"scheduler": {"unknown": "no server"}}},
                          "scheduler") == "unknown here: no server"
    assert not driver._waits_for_a_server(connectors.kv_transfer_config("nixl", None))


def test_a_driver_stopped_at_its_limit_keeps_what_it_answered(side_by_side) -> None:
    """LMCacheMPConnector's scheduler side waits for its lmcache server: the answers
    found before it stay, and the step it waited in says so."""
    answers, logs = side_by_side('''
        import time
        step(running="start")
        step(done="start", answer={"block_size": 128})
        step(running="scheduler")
        time.sleep(60)
    ''', timeout=10.0)  # room for two interpreters to start on 2 busy cores
    assert answers["stock"] == {"steps": {
        "start": {"block_size": 128},
        "scheduler": {"timeout": 10.0, "log": logs["stock"]}}}
    assert render.verdict(answers["stock"], "scheduler") == (
        f"no answer within 10 s (stopped there; log {logs['stock']})")
    assert render.verdict(answers["stock"], "groups") == "not reached"


def test_the_cli_prints_the_json_contract_and_one_line_errors(tmp_path, monkeypatch) -> None:
    from click.testing import CliRunner
    from hybridpd.cli.main import main

    seen = []

    def fake(series, pin, cases, log):
        seen.append((pin.version, cases))
        return [runner.Explained(pin, cases[0].model, cases[0].kv_transfer_config, None,
                                 {"stock": {"failed": "x"}, "patched": {"failed": "y"}},
                                 1.0, {"stock": "s.log", "patched": "p.log"})]

    monkeypatch.setattr(runner, "explain_cases", fake)
    out = CliRunner().invoke(main, ["explain", "--pin", "0.32.0", "--model", "Org/Name",
                                    "--connector", "nixl", "--block-size", "256",
                                    "--no-prefix-caching", "--json"])
    # Neither side answered: the document is the answers, and the run failed.
    assert out.exit_code == 1, out.output
    assert out.stderr.splitlines() == [
        "Error: no complete answer from the stock release or the release with the series "
        "(stopped at --timeout or died; logs: s.log, p.log)"]
    assert json.loads(out.stdout) == {
        "version": "0.32.0", "model": "Org/Name",
        "kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
        "note": None, "answers": {"stock": {"failed": "x"}, "patched": {"failed": "y"}},
        "risks": [], "seconds": 1.0, "logs": {"stock": "s.log", "patched": "p.log"}}
    [(version, [opts])] = seen
    assert opts.engine_args() == {"enable_prefix_caching": False, "max_model_len": 8192,
                                  "block_size": 256}
    assert opts.num_speculative_tokens == 0
    spec = CliRunner().invoke(main, ["explain", "--pin", "0.32.0", "--model", "m",
                                     "--num-speculative-tokens", "3",
                                     "--lmcache-version", "0.5.6", "--json"])
    assert spec.exit_code == 1, spec.output
    # Matched against the risks only: the engine is built without a draft model.
    assert seen[-1][1][0].num_speculative_tokens == 3
    assert seen[-1][1][0].lmcache_version == "0.5.6"
    assert "speculative" not in json.dumps(seen[-1][1][0].engine_args())
    bad = CliRunner().invoke(main, ["explain", "--pin", "0.32.0", "--model", "m",
                                    "--connector", "nixl", "--kv-transfer-config", "{}"])
    assert bad.exit_code == 1
    assert bad.output.strip().splitlines() == [
        "Error: give --connector or --kv-transfer-config, not both"]


@pytest.mark.parametrize(
    "stock,patched,code",
    [
        ({"steps": {"start": START}}, {"steps": {"start": START, "groups": REFUSED}}, 0),
        ({"steps": {"start": START, "scheduler": {"timeout": 1.0, "log": "s"}}},
         {"steps": {"start": START}}, 1),
        ({"steps": {"start": {"exited": 137, "log": "s"}}},
         {"steps": {"start": START}}, 1),
        ({"steps": {"start": START}},
         {"failed": "no answer within 1 s; log p"}, 1),
    ],
    ids=["answered-and-refused", "stopped-at-timeout", "died", "no-answer"],
)
def test_explain_fails_when_a_side_did_not_answer(monkeypatch, stock, patched, code) -> None:
    """What was answered is shown; a side stopped at --timeout or dead fails the run."""
    from click.testing import CliRunner
    from hybridpd.cli.main import main

    def fake(series, pin, cases, log):
        return [runner.Explained(pin, "m", None, None, {"stock": stock, "patched": patched},
                                 1.0, {"stock": "s.log", "patched": "p.log"})]

    monkeypatch.setattr(runner, "explain_cases", fake)
    for as_json in ([], ["--json"]):
        out = CliRunner().invoke(main, ["explain", "--pin", "0.32.0", "--model", "m",
                                        "--timeout", "1", *as_json])
        assert out.exit_code == code, out.output
        assert out.stdout  # the answers, as far as they go
        if as_json:
            assert json.loads(out.stdout)["answers"]["patched"] == patched
        assert ("Error: no complete answer" in out.stderr) == bool(code)


# ---------------------------------------------------------------- question 3

def _follower(kind: str, local: int, loaded: int, state: str, **extra) -> dict:
    return {"kind": kind, "what": kind, "prompt_tokens": 3456, "local_hit_tokens": local,
            "external_tokens": loaded, "served_by": "NixlPullConnector" if loaded else None,
            "resume_point": local + loaded, "mamba_state": state, **extra}


def _decode_hit(*requests: dict) -> dict:
    return {"block_size": 1152, "cached_prefix_tokens": 2304, "requests": list(requests)}


SCHEDULER = {"class": "Scheduler", "connector": "MultiConnector",
             "children": ["NixlPullConnector", "OffloadingConnector"]}


def test_decode_hits_are_said_per_follower_side_by_side() -> None:
    plain = _follower("plain", 0, 0, "not needed")
    stock = {"steps": {"start": START, "groups": GROUPS, "scheduler": SCHEDULER,
                       "decode_hit": _decode_hit(
                           _follower("remote_prefill", 0, 3455, "loaded"), plain)}}
    patched = {"steps": {**stock["steps"], "decode_hit": _decode_hit(
        _follower("remote_prefill", 2304, 1151, "loaded"), plain)}}
    lines = render.lines(_result(stock, patched))
    at = next(i for i, l in enumerate(lines) if l.startswith("4. decode-side prefix hits"))
    assert "left 2304 prefix tokens of attention KV cached" in lines[at]
    assert lines[at + 1:at + 5] == [
        "   remote prefill:",
        "      stock: no local hit, 3455 loaded by NixlPullConnector; Mamba state at 3455 "
        "from the load",
        "      with the series: local hit 2304, 1151 loaded by NixlPullConnector; Mamba "
        "state at 3455 from the load",
        "   plain request: no local hit (computes from 0) (stock and with the series)"]


def test_a_hit_without_its_mamba_state_is_said_with_the_checkers_reason() -> None:
    missing = _follower("plain", 2304, 0, "missing",
                        problem="Mamba group 1 has no cached state at block 1")
    assert render._follower(missing) == (
        "local hit 2304; NO Mamba state at 2304 (Mamba group 1 has no cached state at "
        "block 1)")
    assert render._follower(_follower("plain", 1152, 0, "cached")) == (
        "local hit 1152; Mamba state at 1152 cached")
    assert render._follower({"unknown": "the follower was never admitted"}) == (
        "unknown here: the follower was never admitted")
    # A side that did not measure it (a refusal before) keeps the one-line form.
    stock = {"steps": {"start": START, "groups": REFUSED}}
    patched = {"steps": {"start": START, "groups": GROUPS, "scheduler": SCHEDULER,
                         "decode_hit": _decode_hit(missing)}}
    lines = render.lines(_result(stock, patched))
    at = lines.index("4. decode-side prefix hits:")
    assert lines[at + 1] == "   stock: not reached"
    assert lines[at + 2].startswith("   with the series: plain request: local hit 2304; NO")


def _hangs(*probes: tuple[int, bool]) -> dict:
    return {"block_size": 128, "prefill_lookahead_tokens": 3, "lookahead_chunk": [
        {"past_block_boundary": n + 1, "prompt_tokens": tokens, "served": served,
         **({} if served else {"waits": "WAITING, 255 of 257 prompt tokens computed"})}
        for n, (tokens, served) in enumerate(probes)]}


def test_remote_prefills_past_a_block_boundary_are_said_served_or_where_they_wait() -> None:
    """Under question 4: the probes of the prompt lengths that hang stock with
    multi-module MTP, each tree's own outcome."""
    plain = _follower("plain", 0, 0, "not needed")
    stock = {"steps": {"start": START, "groups": GROUPS, "scheduler": SCHEDULER,
                       "decode_hit": _decode_hit(plain),
                       "hangs": _hangs((257, False), (258, True))}}
    patched = {"steps": {**stock["steps"], "hangs": _hangs((257, True), (258, True))}}
    lines = render.lines(_result(stock, patched))
    at = lines.index("   remote prefills of 2 blocks + 1 token and more (the drafter's "
                     "prefill lookahead: 3):")
    assert lines[at + 1:at + 3] == [
        "      stock: 257 tokens: NEVER SERVED (WAITING, 255 of 257 prompt tokens "
        "computed); 258 tokens: served",
        "      with the series: 257 tokens: served; 258 tokens: served"]
    assert lines[at + 3].startswith("5. known correctness risks")
    # Where both trees serve them, one line; a tree that did not probe says so.
    both = {"steps": {**patched["steps"]}}
    assert "   remote prefills of 2 blocks + 1 token and more (the drafter's prefill " \
           "lookahead: 3): 257 tokens: served; 258 tokens: served (stock and with the " \
           "series)" in render.lines(_result(both, patched))
    unprobed = {"steps": {**patched["steps"], "hangs": {
        "not_applicable": "no NIXL connector: no remote prefill to probe"}}}
    assert ("      stock: does not apply: no NIXL connector: no remote prefill to probe"
            in render.lines(_result(unprobed, patched)))


def test_the_hang_probes_need_the_patch_tests(tmp_path) -> None:
    from hybridpd.explain import driver

    assert "not at hand" in driver.hang_probes(None, None, None, 16)["unknown"]
    assert "not at hand" in driver.hang_probes(str(tmp_path / "no"), None, None, 16)["unknown"]


def test_the_decode_side_question_needs_the_patch_tests_and_a_connector(tmp_path) -> None:
    from hybridpd.explain import driver

    assert "not at hand" in driver.decode_hits(None, None, None, 16)["unknown"]
    assert "not at hand" in driver.decode_hits(str(tmp_path / "no"), None, None, 16)["unknown"]
    assert "not at hand" in driver._lmcache_stand_in(None)[0]


def test_the_donors_mamba_state_is_read_from_the_block_pool_and_said() -> None:
    """What the donor left of Mamba state inside the prefix is the block pool's answer
    (per Mamba group, as the checker reads it), not a fixed phrase."""
    from types import SimpleNamespace

    from hybridpd.explain import driver

    # Mamba groups 0 and 2 (1 is attention); the checker's reading: block -> hash.
    checker = SimpleNamespace(mamba_group_ids=[0, 2],
                              _cached_states=lambda req: [{1: "h1", 2: "h2"}, {}])
    left = driver._prefix_mamba(checker, "donor", 2)
    assert left == [{"group": 0, "blocks": [1]}, {"group": 2, "blocks": []}]  # 2: its tail
    none = [{"group": g, "blocks": []} for g in range(3)]
    step = {**_decode_hit(_follower("plain", 0, 0, "not needed")), "donor_prefix_mamba": none}
    answer = {"steps": {"start": START, "groups": GROUPS, "scheduler": SCHEDULER,
                        "decode_hit": step}}
    head = next(l for l in render.lines(_result(answer, answer)) if l.startswith("4."))
    assert "on the decode instance, no Mamba state cached inside them (none in any of the " \
           "3 Mamba groups); then each follower" in head
    held = {**answer, "steps": {**answer["steps"], "decode_hit": {
        **step, "donor_prefix_mamba": [{"group": 0, "blocks": [0, 1]}, *none[1:]]}}}
    head = next(l for l in render.lines(_result(answer, held)) if l.startswith("4."))
    assert ("stock: no Mamba state cached inside them (none in any of the 3 Mamba groups); "
            "with the series: Mamba state cached inside them in group 0 at blocks 0, 1 "
            "(none in the other 2); then") in head
    unread = {**answer, "steps": {**answer["steps"], "decode_hit": {
        **step, "donor_prefix_mamba": None}}}
    head = next(l for l in render.lines(_result(unread, unread)) if l.startswith("4."))
    assert "the Mamba state inside them not measured" in head
    assert "no Mamba state" not in head


def test_from_the_load_only_where_the_driver_checked_what_the_load_brings() -> None:
    """NIXL's load is checked (it must end where the prefiller's state belongs); any
    other connector's load is not, and the verdict says so."""
    from types import SimpleNamespace

    from hybridpd.explain import driver

    checks = SimpleNamespace(NIXL_CONNECTORS=frozenset({"NixlPullConnector"}),
                             LOAD_STATE_CHECKS={"NixlPullConnector": None,
                                                "DecodeBenchConnector": None})

    def source(local: int, loaded: int, by: str | None, problem: str | None = None) -> str:
        adm = SimpleNamespace(resume_point=local + loaded, external_tokens=loaded,
                              serving_connector=by)
        return driver._state_source(checks, adm, problem)

    assert source(2304, 1151, "NixlPullConnector") == "loaded"
    assert source(0, 3455, "LMCacheMPConnector") == "unchecked"
    assert source(1152, 1152, "DecodeBenchConnector") == "unchecked"
    assert source(2304, 0, None) == "cached"
    assert source(0, 0, None) == "not needed"
    assert source(0, 3455, "NixlPullConnector", "not at the prefiller's end") == "missing"
    lm = {**_follower("remote_prefill", 0, 3455, "unchecked"), "served_by": "LMCacheMPConnector"}
    assert render._follower(lm) == ("no local hit, 3455 loaded by LMCacheMPConnector; the "
                                    "load's Mamba state at 3455 is not checked")
    assert render._follower(_follower("remote_prefill", 2304, 1151, "loaded")) == (
        "local hit 2304, 1151 loaded by NixlPullConnector; Mamba state at 3455 from the load")


def test_a_model_without_mamba_layers_is_said_to_have_none(tmp_path) -> None:
    """Without a Mamba group no request resumes from a Mamba state: the decode-side
    question does not apply, and no hit verdicts are shown as if the model were hybrid."""
    from types import SimpleNamespace

    from hybridpd.explain import driver

    class FullAttentionSpec:
        pass

    class MambaSpec:
        pass

    class GDNSpec(MambaSpec):  # a subclass is a Mamba group too
        pass

    def probe(*specs) -> SimpleNamespace:
        groups = [SimpleNamespace(kv_cache_spec=spec()) for spec in specs]
        return SimpleNamespace(kv_cache_config=SimpleNamespace(kv_cache_groups=groups),
                               connector=object())

    said = driver.decode_hits(str(tmp_path), probe(FullAttentionSpec), None, 16)
    assert said == {"not_applicable": "the model's KV cache groups hold no Mamba group: no "
                                      "request resumes from a Mamba state"}
    assert driver._mamba_group_ids(probe(GDNSpec, FullAttentionSpec).kv_cache_config) == [0]
    attention = {"groups": [{"layers": 32, "type": "FullAttentionSpec"}],
                 "block_size": 16, "num_blocks": 100}
    answer = {"steps": {"start": START, "groups": attention,
                        "scheduler": {"class": "Scheduler", "connector": "NixlPullConnector"},
                        "decode_hit": said}}
    lines = render.lines(_result(answer, answer))
    assert ("4. decode-side prefix hits: does not apply: the model's KV cache groups hold no "
            "Mamba group: no request resumes from a Mamba state (stock and with the series)"
            ) in lines
    assert not any("Mamba state at" in l or "local hit" in l for l in lines)


# ---------------------------------------------------------------- question 5

SHA = "0" * 64


def _series(tmp_path: Path) -> Series:
    """A vLLM-like series with two pins and a hosted LMCache-like one, each with risks."""
    from hybridpd.series.model import load

    vllm = tmp_path / "patches" / "series.toml"
    (vllm.parent / "lm").mkdir(parents=True)
    pin = lambda v: (f'[[pins]]\nversion = "{v}"\ntag = "v{v}"\nsdist = "p-{v}.tar.gz"\n'
                     f'sha256 = "{SHA}"\n')
    patch = lambda pid, states: (
        f'[[patches]]\nid = "{pid}"\ntitle = "t"\nwhy = "w"\ndesign = "d"\n'
        f'upstream = "u"\nremoval = "r"\n' + ("dropped = \"Not needed there. More.\"\n"
                                                if "dropped" in states.values() else "")
        + "".join(f'[patches.pins."{v}"]\nstate = "{s}"\n'
                  + ('release = "1.5"\n' if s == "upstream" else "")
                  for v, s in states.items()))
    vllm.write_text(
        'schema = 1\npackage = "vllm"\nname = "vLLM"\nupstream_git = "x"\n'
        'default_pin = "2.0"\n' + pin("1.0") + pin("2.0")
        + patch("load-fix", {"1.0": "carried", "2.0": "upstream"})
        + patch("crash-fix", {"1.0": "dropped", "2.0": "carried"})
        + '[[risks]]\nid = "spec"\nsays = "Spec decoding corrupts."\n'
          'when = { speculative_decoding = true, prefix_caching = true }\n'
          'links = ["vllm-project/vllm#53912"]\n'
        + '[[risks]]\nid = "failed-load"\nsays = "A failed load decodes garbage."\n'
          'when = { connectors = ["*"] }\nfixed_by = "load-fix"\n'
        + '[[risks]]\nid = "crash"\nsays = "A sync load crashes."\n'
          'when = { connectors = ["OffloadingConnector"] }\nfixed_by = "crash-fix"\n')
    (vllm.parent / "lm" / "series.toml").write_text(
        'schema = 1\npackage = "lmcache"\nname = "LMCache"\nupstream_git = "x"\n'
        'default_pin = "0.5"\n[test]\nhost = { series = "../series.toml", pin = "2.0" }\n'
        + pin("0.5") + pin("1.5") + patch("null-slot-fix", {"0.5": "carried", "1.5": "upstream"})
        + '[[risks]]\nid = "null-slot"\nsays = "A null slot is stored."\n'
          'when = { connectors = ["LMCacheMPConnector"], mamba_cache_mode = ["align"], '
          'max_num_batched_tokens_at_least_blocks = 2 }\n'
          'unless = "the server runs with --separate-object-groups"\n'
          'links = ["LMCache/LMCache#4247"]\nfixed_by = "null-slot-fix"\n')
    return load(vllm)


def _answers(batched: int | None = 4096, block: int | None = 1152) -> dict:
    start = {**START, **({"max_num_batched_tokens": batched} if batched else {})}
    steps = {"start": start, "groups": {**GROUPS, "block_size": block} if block
             else {"timeout": 300.0, "log": "x.log"}}
    return {side: {"steps": steps} for side in runner.SIDES}


def test_risks_apply_from_the_records_and_the_fix_state_from_the_fixing_patch(tmp_path) -> None:
    from hybridpd.explain import risks

    series = _series(tmp_path)
    assert [s.project for s in risks.hosted_series(series)] == ["vLLM", "LMCache"]
    lm = connectors.kv_transfer_config("nixl+lmcache", None)
    found = {r["id"]: r for r in risks.assess(series, series.pin("2.0"), lm, 0, _answers())}
    assert set(found) == {"failed-load", "null-slot"}  # no speculative decoding
    assert found["null-slot"]["applies"] == {"stock": True, "patched": True}
    assert found["null-slot"]["fixed"] == {
        "stock": None,
        "patched": "fixed by null-slot-fix (hybridpd's LMCache series, on LMCache 0.5)"}
    assert found["null-slot"]["links"] == [{
        "ref": "LMCache/LMCache#4247", "url": "https://github.com/LMCache/LMCache/issues/4247"}]
    assert found["failed-load"]["fixed"] == {"stock": "fixed upstream in vLLM 1.5",
                                             "patched": "fixed upstream in vLLM 1.5"}
    # Below 2 blocks per step the null slot is never stored; the block size unanswered
    # (the driver stopped at its limit), it may apply.
    assert "null-slot" not in {r["id"] for r in risks.assess(series, series.pin("2.0"), lm, 0,
                                                             _answers(batched=2048))}
    maybe = {r["id"]: r
             for r in risks.assess(series, series.pin("2.0"), lm, 0, _answers(block=None))}
    assert maybe["null-slot"]["applies"] == {"stock": None, "patched": None}
    # On the older pin the load fix is carried, the crash fix dropped (the record's why).
    offload = connectors.kv_transfer_config("nixl+offloading", None)
    old = {r["id"]: r for r in risks.assess(series, series.pin("1.0"), offload, 2, _answers())}
    assert old["failed-load"]["fixed"] == {"stock": None, "patched": "fixed by load-fix"}
    assert old["crash"]["fixed"] == {"stock": None, "patched": None}
    assert old["crash"]["fix_dropped"] == "Not needed there."
    assert old["spec"]["fixed"] == {"stock": None, "patched": None}
    assert risks.assess(series, series.pin("2.0"), None, 0, _answers()) == []


def test_the_lmcache_series_fix_state_is_that_of_the_lmcache_release_deployed(tmp_path) -> None:
    """The hosted series' fix is its patch's record on the LMCache release the
    deployment runs (the series' default pin unless given), not on any of its pins."""
    from hybridpd.explain import risks

    series = _series(tmp_path)
    lm = connectors.kv_transfer_config("nixl+lmcache", None)

    def fixed(version: str | None) -> dict:
        found = risks.assess(series, series.pin("2.0"), lm, 0, _answers(),
                             {"lmcache": version} if version else None)
        return next(r["fixed"] for r in found if r["id"] == "null-slot")

    carried = {"stock": None,
               "patched": "fixed by null-slot-fix (hybridpd's LMCache series, on LMCache 0.5)"}
    assert fixed(None) == fixed("0.5") == carried
    assert fixed("1.5") == {"stock": "fixed upstream in LMCache 1.5",
                            "patched": "fixed upstream in LMCache 1.5"}
    # A release the series does not pin has no fix of it.
    assert fixed("0.4") == {"stock": None, "patched": None}


def test_risk_lines_put_the_open_ones_first(tmp_path) -> None:
    from hybridpd.explain import risks

    series = _series(tmp_path)
    lm = connectors.kv_transfer_config("nixl+lmcache", None)
    result = _result({"steps": {"start": START}}, {"steps": {"start": START}})
    result.risks = risks.assess(series, series.pin("2.0"), lm, 1, _answers())
    lines = render.lines(result)
    at = lines.index("5. known correctness risks (the series' records):")
    assert lines[at + 1:at + 6] == [
        "   - vLLM: Spec decoding corrupts. [vllm-project/vllm#53912]",
        "     open (stock and with the series)",
        "   - LMCache: A null slot is stored. [LMCache/LMCache#4247]; unless the server runs "
        "with --separate-object-groups",
        "     stock: open; with the series: fixed by null-slot-fix (hybridpd's LMCache "
        "series, on LMCache 0.5)",
        "   fixed on stock too: failed-load (fixed upstream in vLLM 1.5)"]
    result.risks = []
    assert "5. known correctness risks (the series' records): none of them matches this " \
           "deployment" in render.lines(result)


def test_no_risk_applies_where_vllm_refuses_the_deployment(tmp_path) -> None:
    from hybridpd.explain import risks

    series = _series(tmp_path)
    nixl = connectors.kv_transfer_config("nixl", None)
    refused = {side: {"steps": {"start": START, "groups": REFUSED}} for side in runner.SIDES}
    assert risks.assess(series, series.pin("2.0"), nixl, 0, refused) == []
    result = _result(*refused.values())
    assert render.lines(result)[-2] == (
        "5. known correctness risks (the series' records): none: vLLM refuses the deployment")
    # What explain cannot answer is no refusal: the risk may still apply.
    unknown = {side: {"steps": {"start": START, "groups": {**REFUSED, "unknown": "cpu"}}}
               for side in runner.SIDES}
    assert [r["id"] for r in risks.assess(series, series.pin("2.0"), nixl, 0, unknown)] == [
        "failed-load"]
    # A decode-side step explain could not run is not vLLM refusing the deployment.
    started = {side: {"steps": {"start": START, "decode_hit": REFUSED}} for side in runner.SIDES}
    assert [r["id"] for r in risks.assess(series, series.pin("2.0"), nixl, 0, started)] == [
        "failed-load"]


def test_a_risk_that_applies_on_one_side_only_says_so(tmp_path) -> None:
    """False (does not apply) is an answer, not a fact vLLM left unanswered."""
    from hybridpd.explain import risks

    series = _series(tmp_path)
    nixl = connectors.kv_transfer_config("nixl", None)
    started = {"steps": {"start": START}}
    refused = {"steps": {"start": START, "groups": REFUSED}}
    (risk,) = risks.assess(series, series.pin("1.0"), nixl, 0,
                           {"stock": refused, "patched": started})
    assert risk["applies"] == {"stock": False, "patched": True}
    result = _result(refused, started)
    result.risks = [risk]
    text = "\n".join(render.lines(result))
    assert "may apply" not in text
    assert "     stock: does not apply; with the series: fixed by load-fix" in text


def test_a_risk_naming_an_unknown_connector_is_refused_in_one_line(tmp_path) -> None:
    """A ``when.connectors`` name no deployment configures (NIXL's scheduler-side class,
    a typo) would never match: the series does not load, so ``check`` fails."""
    from click.testing import CliRunner
    from hybridpd.cli.main import main

    _series(tmp_path)
    path = tmp_path / "patches" / "series.toml"
    path.write_text(path.read_text().replace('["OffloadingConnector"]',
                                             '["OffloadingConnector", "NixlPullConnector"]'))
    out = CliRunner().invoke(main, ["--series", str(path.parent), "check", "--no-apply"])
    assert out.exit_code == 1
    [line] = out.output.strip().splitlines()
    assert line.endswith('risks[2] (id "crash"): when.connectors: not a known connector: '
                         "NixlPullConnector (known: DecodeBenchConnector, LMCacheConnectorV1, "
                         'LMCacheMPConnector, MultiConnector, NixlConnector, '
                         'OffloadingConnector, or "*")'), line


def test_speculative_config_builds_the_engine_with_it(monkeypatch) -> None:
    from click.testing import CliRunner
    from hybridpd.cli.main import main

    seen = []

    def fake(series, pin, cases, log):
        seen.append(cases[0])
        return [runner.Explained(pin, cases[0].model, None, None,
                                 {"stock": {"steps": {"start": START}},
                                  "patched": {"steps": {"start": START}}}, 1.0, {})]

    monkeypatch.setattr(runner, "explain_cases", fake)
    config = {"method": "mtp", "num_speculative_tokens": 3}
    out = CliRunner().invoke(main, ["explain", "--pin", "0.33.0", "--model", "m",
                                    "--speculative-config", json.dumps(config), "--json"])
    assert out.exit_code == 0, out.output
    # vLLM's own option, as given: the engine is built with it; the risks see its tokens.
    assert seen[-1].engine_args()["speculative_config"] == config
    assert seen[-1].speculative_tokens() == 3
    for args, message in (
            (["--speculative-config", "{"], "--speculative-config: not JSON"),
            (["--speculative-config", "[3]"], "a JSON object"),
            (["--speculative-config", json.dumps(config), "--num-speculative-tokens", "3"],
             "not both")):
        bad = CliRunner().invoke(main, ["explain", "--pin", "0.33.0", "--model", "m", *args])
        assert bad.exit_code == 2, bad.output
        assert len([x for x in bad.output.splitlines() if message in x]) == 1, bad.output


def test_the_scheduler_line_says_which_kv_event_block_size_a_router_needs() -> None:
    groups = [{"group_idx": i, "type": "MambaSpec", "block_size": 1152,
               "mamba_cache_mode": "align"} for i in range(3)]
    groups.append({"group_idx": 3, "type": "FullAttentionSpec", "block_size": 1152})
    step = {"class": "Scheduler", "connector": None, "block_size": 1152,
            "hash_block_size": 1152, "kv_events": groups,
            # What the tree's block pool published for "--x" (stock vLLM).
            "block_stored": {"layout": "--x", "per_run": False, "events": [
                {"hashes": [2], "token_blocks": [0, 1, 2], "parent": None}]}}
    text = render.verdict({"steps": {"scheduler": step}}, "scheduler")
    assert text == (
        "Scheduler built, no KV connector; KV events carry block_size 1152: a router needs "
        "--kv-event-block-size 1152; the Mamba groups (3, align mode) announce only the "
        "blocks that hold a state, with token_ids over every block of the range "
        "(vllm#44451): a prefix counts up to its last block announced by every group, not "
        "by the full-attention group alone")
    # Groups of different block sizes are named one by one; a finer hash block size
    # (v0.33's prefix entries inside a block) is said; no Mamba group, no warning.
    mixed = {**step, "hash_block_size": 16, "kv_events": [
        {"group_idx": 0, "type": "FullAttentionSpec", "block_size": 32},
        {"group_idx": 1, "type": "SlidingWindowSpec", "block_size": 16}]}
    assert render.kv_events_line(mixed) == (
        "KV events carry a block_size per group (group 0 (FullAttentionSpec) 32, group 1 "
        "(SlidingWindowSpec) 16): a router that takes one --kv-event-block-size reads "
        "only the groups of that size")
    assert render.kv_events_line({"class": "Scheduler"}) is None


def test_the_kv_events_line_says_what_the_trees_block_pool_published() -> None:
    """The sentence on Mamba groups follows the driver's measurement of the tree's
    block pool, not the series' patch names: per run (kv-events-stored-per-block-run),
    over the whole range (stock, vllm#44451), or unknown where it was not measured."""
    groups = [{"group_idx": 0, "type": "MambaSpec", "block_size": 1152,
               "mamba_cache_mode": "align"},
              {"group_idx": 1, "type": "FullAttentionSpec", "block_size": 1152}]
    step = {"hash_block_size": 1152, "kv_events": groups}
    per_run = {"layout": "--x", "per_run": True,
               "events": [{"hashes": [2], "token_blocks": [2], "parent": 1}]}
    whole_range = {"layout": "--x", "per_run": False,
                   "events": [{"hashes": [2], "token_blocks": [0, 1, 2], "parent": None}]}
    head = ("KV events carry block_size 1152: a router needs --kv-event-block-size 1152; "
            "the Mamba groups (1, align mode) announce only the blocks that hold a state, ")
    tail = (": a prefix counts up to its last block announced by every group, not by the "
            "full-attention group alone")
    assert render.kv_events_line({**step, "block_stored": per_run}) == (
        head + "one BlockStored per run of cached blocks, each hash with its own token_ids "
        "and the run's parent the hash of the block before it" + tail)
    assert render.kv_events_line({**step, "block_stored": whole_range}) == (
        head + "with token_ids over every block of the range (vllm#44451)" + tail)
    assert render.kv_events_line(
        {**step, "block_stored": {"error": "TypeError: boom"}}) == (
        head + "their BlockStored token_ids and parents unknown here (TypeError: boom)" + tail)
    assert "unknown here (not measured)" in render.kv_events_line(step)


def test_the_scheduler_line_says_what_speculative_decoding_set() -> None:
    step = {"class": "Scheduler", "connector": "NixlPullConnector", "children": [],
            "speculative": {"method": "mtp", "num_speculative_tokens": 3, "multi_module_mtp": False,
                            "lookahead_slots": 3, "prefill_lookahead_tokens": 1,
                            "nixl_prefill_backoff": 1, "drops_last_matched_block": True}}
    text = render.verdict({"steps": {"scheduler": step}}, "scheduler")
    assert text == (
        "Scheduler built, scheduler-side connector NixlPullConnector; speculative decoding "
        "mtp, 3 tokens (one draft module, reused): 3 lookahead slot(s) per request, prefill "
        "lookahead 1, NIXL backs off 1 prompt token(s), a hit drops its last matched block")
