"""``hybridpd bench``: the deployment's derivation, the replay's stand-ins and report,
the lookup's alternation, the runner of bench scripts and the CLI gate.

The replay and lookup scripts drive real vLLM classes only under a pin's test
environment; CI runs a reduced replay of two pins with ``--expect-hit 0.99``
(ci/test.sh). Here the parts that need no vLLM are tested directly, and the scripts'
protocol with stand-in scripts.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from hybridpd.cli import main as cli_main
from hybridpd.cli.options import State
from hybridpd.bench import decode_replay, deployment, env, lookup, render, replay
from hybridpd.errors import UsageError
from hybridpd.series.model import load

from builders import stub_pin


def _repo_series():
    """The repository's vLLM series, which the commands resolve ``--pin`` in."""
    return load(Path(__file__).resolve().parents[2] / "patches" / "series.toml")


# -- deployment ---------------------------------------------------------------------

def test_default_plan_derives_the_block_and_pool_from_the_h20() -> None:
    plan = deployment.plan(deployment.Workload(), deployment.Hardware(),
                           deployment.load_model_config(None))
    # A GDN state (bf16 conv 49,152 B + fp32 SSM 2,097,152 B) needs 1,048 tokens of
    # attention page (2,048 B/token): vLLM raises --block-size 128 to 9 x 128.
    assert plan.block_size == 1152
    assert plan.num_mamba_groups == 3
    assert 34e9 < plan.model["params"] < 36e9  # the "35B" of the name
    assert 3e9 < plan.model["active_params"] < 4e9  # the "A3B"
    pool = 96 * 2**30 * 0.9 - plan.model["params"] * 2 - 4 * 2**30
    assert plan.num_blocks == int(pool // (10 * 1152 * 2048)) == 811
    assert any("811 blocks of 1152 tokens" in line for line in plan.derivation)


def test_pool_options_override_the_derivation() -> None:
    config = deployment.load_model_config(None)
    w, h = deployment.Workload(), deployment.Hardware()
    assert deployment.plan(w, h, config, kv_blocks=123).num_blocks == 123
    assert deployment.plan(w, h, config, kv_gib=1.0).num_blocks == 2**30 // (10 * 1152 * 2048)
    with pytest.raises(UsageError, match="holds no block"):
        deployment.plan(w, deployment.Hardware(hbm_gib=60), config)


def test_ssm_dtype_of_the_config_sizes_the_block() -> None:
    config = dict(deployment.QWEN35_35B_A3B, mamba_ssm_dtype=None)  # the model's bf16
    plan = deployment.plan(deployment.Workload(), deployment.Hardware(), config)
    assert plan.block_size == 640  # 1,097,728 B of state: 5 x 128 tokens


def test_a_block_already_larger_than_the_state_is_kept() -> None:
    plan = deployment.plan(deployment.Workload(), deployment.Hardware(),
                           deployment.load_model_config(None), block_size=2048)
    assert plan.block_size == 2048


def test_model_config_file_with_layer_types(tmp_path: Path) -> None:
    config = dict(deployment.QWEN35_35B_A3B, num_hidden_layers=8)
    config["layer_types"] = ["linear_attention"] * 6 + ["full_attention"] * 2
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"text_config": config}))
    shape = deployment.shape(deployment.load_model_config(path))
    assert (shape["full_attention_layers"], shape["linear_attention_layers"]) == (2, 6)
    plan = deployment.plan(deployment.Workload(), deployment.Hardware(),
                           deployment.load_model_config(path), kv_blocks=10)
    assert plan.num_mamba_groups == 3


# -- the replay's stand-ins -----------------------------------------------------------

WORKLOAD = {"prefix_len": 40, "suffix_len": 8, "num_prefixes": 2, "num_prompts": 10,
            "output_len": 4, "concurrency": 4, "seed": 3}


def test_prompts_share_their_prefix_and_differ_in_their_suffix() -> None:
    prompts = decode_replay.Prompts(WORKLOAD)
    assert sorted(prompts.order) == [0] * 5 + [1] * 5
    made = [prompts.prompt(i) for i in range(10)]
    for i, p in enumerate(made):
        assert len(p) == 48 and p[:40] == prompts.prefixes[prompts.order[i]]
    assert len({tuple(p[40:]) for p in made}) == 10
    assert decode_replay.Prompts(WORKLOAD).prompt(7) == made[7]  # deterministic


def test_prefill_instance_computes_a_prefix_once_and_serves_in_order() -> None:
    p = decode_replay.PrefillInstance({"prefill_ms_per_token": 1.0}, WORKLOAD)
    assert p.submit(0, 0.0) == 48  # prefix + suffix
    assert p.submit(0, 0.0) == 56  # queued behind it; suffix only
    assert p.submit(1, 100.0) == 148  # idle until sent; a new prefix
    assert p.submit(1, 0.0) == 156


class _Req:
    def __init__(self, computed: int, tokens: int) -> None:
        self.num_computed_tokens, self.num_tokens = computed, tokens


class _Out:
    def __init__(self, scheduled: dict[str, int]) -> None:
        self.num_scheduled_tokens = scheduled


def test_step_cost_counts_context_requests_and_extra_tokens() -> None:
    cost = {"step_overhead_ms": 1.0, "weights_read_ms": 10.0, "kv_read_ms_per_token": 0.01,
            "state_read_ms_per_request": 0.5, "prefill_ms_per_token": 0.1}
    requests = {"a": _Req(100, 101), "b": _Req(50, 60)}
    assert decode_replay.step_ms(cost, _Out({}), requests) == 0.0
    got = decode_replay.step_ms(cost, _Out({"a": 1, "b": 11}), requests)
    assert got == pytest.approx(1 + 10 + 150 * 0.01 + 2 * 0.5 + 10 * 0.1)


# -- the report and its renderings ---------------------------------------------------

def _result(**over) -> dict:
    base = {k: 1 for k in replay.RESULT_KEYS}
    # NIXL alone, no store, no speculative decoding (their keys are not counts).
    base.update(served_by={"NixlPullConnector": 1}, store_blocks=None,
                store_evicted_chunks=None, speculative=None)
    base.update(over)
    return base


def _report(patched_hit: int = 99, limit: int = 100) -> replay.ReplayReport:
    trace = [(1, 10.0, 3, 5), (2, 20.0, 4, 4)]
    return replay.ReplayReport(
        "0.20.2", "nixl", "v0.20.2 + scheduler-mamba-external-kv", dict(WORKLOAD), {"kv_blocks": 997, "block_size": 640},
        {"stock": _result(hit_tokens=0, limit_tokens=limit, output_tps_est=400.0, steps=10),
         "patched": _result(hit_tokens=patched_hit, limit_tokens=limit, output_tps_est=800.0,
                            steps=5)},
        {"stock": trace, "patched": trace},
    )


def test_report_json_has_the_documented_keys_and_ratios() -> None:
    doc = _report().to_json()
    for key in ("pin", "stock_build", "workload", "cost_model", "stock", "patched"):
        assert key in doc
    for key in ("hit_tokens", "limit_tokens", "pulled_tokens", "blocks_allocated",
                "peak_running", "mean_running", "preemptions", "steps", "ttft_ms_est",
                "output_tps_est"):
        assert key in doc["stock"] and key in doc["patched"]
    assert doc["ratios"]["output_tps_est"] == 2.0
    assert doc["ratios"]["steps"] == 0.5
    assert _report().hit_fraction() == 0.99


def test_corner_counts_are_in_the_json_and_the_table_stock_beside_patched(monkeypatch) -> None:
    report = _report()
    report.workload["exact_repeat_fraction"] = 0.25
    report.results["stock"].update(recomputed_below_target_tokens=52224,
                                   corner_admissions=3, corner_recomputed_tokens=52224)
    report.results["patched"].update(recomputed_below_target_tokens=0,
                                     corner_admissions=3, corner_recomputed_tokens=0)
    doc = report.to_json()
    for build, below in (("stock", 52224), ("patched", 0)):
        assert doc[build]["recomputed_below_target_tokens"] == below
        assert doc[build]["corner_recomputed_tokens"] == below
        assert doc[build]["corner_admissions"] == 3
    lines = render.replay_table(report).splitlines()
    assert "exact repeats 0.25" in lines[0]
    row = next(line for line in lines if line.startswith("recomputed below load target"))
    assert row.split()[-3:] == ["52,224", "0", "0.00x"]
    assert next(line for line in lines if "len-1 corner admissions" in line).split()[-3:] == [
        "3", "3", "1.00x"]
    # Through the CLI: the option reaches the workload, the keys reach --json.
    seen = {}

    def run(series, options, log, status):
        seen["w"] = options.workload
        return report

    monkeypatch.setattr(replay, "run", run)
    monkeypatch.setattr(State, "series", _repo_series())
    out = CliRunner().invoke(cli_main.main, ["bench", "replay", "--pin", "0.33.0", "--json",
                                        "--exact-repeat-fraction", "0.25"])
    assert out.exit_code == 0, out.output
    assert seen["w"].exact_repeat_fraction == 0.25
    assert json.loads(out.stdout)["stock"]["corner_recomputed_tokens"] == 52224
    bad = CliRunner().invoke(cli_main.main, ["bench", "replay", "--pin", "0.33.0",
                                        "--exact-repeat-fraction", "1.5"])
    assert bad.exit_code == 2


def test_exact_repeats_are_an_earlier_prompts_whole_blocks_plus_one_token() -> None:
    plain = decode_replay.Prompts(WORKLOAD, 16)
    assert plain.repeats == {}  # the seed's workload by default
    w = dict(WORKLOAD, exact_repeat_fraction=0.5)
    prompts = decode_replay.Prompts(w, 16)
    assert prompts.repeats and 0 not in prompts.repeats
    assert [prompts.prompt(i) for i in range(10) if i not in prompts.repeats] == [
        plain.prompt(i) for i in range(10) if i not in prompts.repeats]
    for index, (source, repeated) in prompts.repeats.items():
        assert source < index and source not in prompts.repeats
        assert repeated % 16 == 0 and 16 <= repeated <= 47 // 16 * 16
        made = prompts.prompt(index)
        assert len(made) == repeated + 1 and made[:-1] == plain.prompt(source)[:repeated]
        assert prompts.order[index] == prompts.order[source]


def test_table_names_exact_and_modelled_figures() -> None:
    text = render.replay_table(_report())
    assert "99.00% of the limit" in text
    assert "output tok/s (modelled)" in text and "2.00x" in text


def test_gates() -> None:
    assert render.gate_problems(_report(99), 0.99, True) == []
    assert render.gate_problems(_report(98), 0.99, False) == [
        "patched hit 98.00% of the limit, below 99%"]
    assert render.gate_problems(_report(0), None, True) == [
        "stock's hit (0 tokens) is not below patched's (0)"]
    no_limit = _report(0, limit=0)
    assert no_limit.hit_fraction() is None
    assert "the limit is 0" in render.gate_problems(no_limit, 0.5, False)[0]
    assert "no limit (0)" in render.replay_table(no_limit)


def test_png_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the bench extra (CI installs it)")
    render.replay_png(_report(), tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_expect_hit_fails_the_command_below_the_fraction(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(replay, "run", lambda series, options, log, status: _report(98))
    monkeypatch.setattr(State, "series", _repo_series())
    runner = CliRunner()
    ok = runner.invoke(cli_main.main, ["bench", "replay", "--pin", "0.20.2", "--expect-hit", "0.98"])
    assert ok.exit_code == 0, ok.output
    bad = runner.invoke(cli_main.main, ["bench", "replay", "--pin", "0.20.2", "--expect-hit", "0.99",
                                   "--json"])
    assert bad.exit_code == 1
    assert json.loads(bad.stdout)["patched"]["hit_tokens"] == 98
    assert "98.00% of the limit" in bad.stderr
    usage = runner.invoke(cli_main.main, ["bench", "replay", "--pin", "0.20.2", "--num-prompts", "0"])
    assert usage.exit_code == 2 and "--num-prompts" in usage.stderr


def test_library_usage_errors_show_the_subcommands_usage_line(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(State, "series", _repo_series())
    bad_config = tmp_path / "config.json"
    bad_config.write_text("not json")
    runner = CliRunner()
    for extra in (["--max-model-len", "10"], ["--model-config", str(bad_config)]):
        result = runner.invoke(cli_main.main, ["bench", "replay", "--pin", "0.20.2", "--json", *extra])
        assert result.exit_code == 2, result.output
        assert "Usage: main bench replay [OPTIONS]" in result.stderr
        assert json.loads(result.stdout)["ok"] is False


@pytest.mark.parametrize("text", ["[1, 2]", '{"text_config": 3}', '{"hidden_size": 8}',
                                  '{"num_hidden_layers": "40"}'])
def test_a_model_config_of_the_wrong_shape_is_one_usage_line(monkeypatch, tmp_path, text) -> None:
    monkeypatch.setattr(State, "series", _repo_series())
    config = tmp_path / "config.json"
    config.write_text(text)
    result = CliRunner().invoke(cli_main.main, ["bench", "replay", "--pin", "0.20.2",
                                           "--model-config", str(config)])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert f"--model-config {config}: not a Qwen3.5-style hybrid model config" in result.stderr


_BAD_VALUES = [0, -1, "2", 2.5, True, None]


@pytest.mark.parametrize("key", [
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "vocab_size", "full_attention_interval"])
def test_every_count_of_a_model_config_must_be_a_positive_integer(tmp_path, key) -> None:
    """A count of 0 (num_key_value_heads: 0 divided by zero in the plan) or of another
    type is one line about that key; plan() runs on whatever is accepted."""
    path = tmp_path / "config.json"
    for value in _BAD_VALUES:
        path.write_text(json.dumps({**deployment.QWEN35_35B_A3B, key: value}))
        with pytest.raises(UsageError) as caught:
            deployment.load_model_config(path)
        assert caught.value.message == (
            f"--model-config {path}: not a Qwen3.5-style hybrid model config "
            f"({key} is {json.dumps(value)}, not a positive integer)")


@pytest.mark.parametrize("change,why", [
    ({"num_experts_per_tok": 300}, "num_experts_per_tok 300 is more than num_experts 256"),
    ({"shared_expert_intermediate_size": -1},
     "shared_expert_intermediate_size is -1, not a non-negative integer"),
    ({"torch_dtype": "int8"}, 'torch_dtype is "int8", not one of bfloat16, float16, float32'),
    ({"mamba_ssm_dtype": 4}, "mamba_ssm_dtype is 4, not one of bfloat16, float16, float32"),
    ({"layer_types": "full_attention"},
     "layer_types is not a list of 40 layer type names (num_hidden_layers)"),
    ({"layer_types": ["linear_attention"] * 40}, "no full-attention layer"),
    ({"full_attention_interval": 41}, "no full-attention layer"),
])
def test_other_fields_a_plan_cannot_use_are_one_line(tmp_path, change, why) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**deployment.QWEN35_35B_A3B, **change}))
    with pytest.raises(UsageError) as caught:
        deployment.load_model_config(path)
    assert caught.value.message.endswith(f"({why})")


def test_bench_replay_with_no_kv_heads_is_one_usage_line(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(State, "series", _repo_series())
    monkeypatch.delenv("HYBRIDPD_DEBUG", raising=False)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**deployment.QWEN35_35B_A3B, "num_key_value_heads": 0}))
    result = CliRunner().invoke(cli_main.main, ["bench", "replay", "--pin", "0.20.2",
                                                "--model-config", str(config), "--json"])
    assert result.exit_code == 2, result.output
    assert json.loads(result.stdout) == {"ok": False, "error": (
        f"--model-config {config}: not a Qwen3.5-style hybrid model config "
        "(num_key_value_heads is 0, not a positive integer)")}


# -- running bench scripts -----------------------------------------------------------

class _Env(env.BenchEnv):
    """A bench environment whose "builds" run this interpreter."""

    def python(self) -> Path:
        return Path(sys.executable)

    def env(self, build: str) -> dict[str, str]:
        return {**os.environ, "BUILD": build}


def _env(tmp_path: Path) -> _Env:
    return _Env(stub_pin("0.0.0"), tmp_path, tmp_path, {"stock": tmp_path, "patched": tmp_path},
                tmp_path,
                ("scheduler-mamba-external-kv",))


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_run_script_passes_progress_and_reads_the_result(tmp_path: Path) -> None:
    script = _script(tmp_path, """
        import json, os, sys
        spec = json.load(open(sys.argv[1]))
        for i in range(3):
            print(json.dumps({"build": os.environ["BUILD"], "i": i}), file=sys.stderr, flush=True)
        print("a line that is not progress", file=sys.stderr)
        json.dump({"echo": spec["x"]}, open(spec["out"], "w"))
    """)
    seen = []
    result = env.run_script(_env(tmp_path), "patched", script, {"x": 5}, seen.append)
    assert result == {"echo": 5}
    assert [e["i"] for e in seen] == [0, 1, 2] and seen[0]["build"] == "patched"


def test_run_script_failure_names_the_log(tmp_path: Path) -> None:
    script = _script(tmp_path, "raise SystemExit('no pool')\n")
    with pytest.raises(env.BenchError, match=r"script on 0.0.0 stock failed \(exit 1\): no pool; log "):
        env.run_script(_env(tmp_path), "stock", script, {})


def _fake_lookup_env(tmp_path: Path, monkeypatch, worker: Path) -> None:
    """Make ``lookup.run`` use :class:`_Env` and ``worker`` instead of a pin's."""
    import contextlib

    fake = _env(tmp_path)
    monkeypatch.setattr(lookup, "prepared",
                        lambda series, pin, log: contextlib.nullcontext(fake))
    monkeypatch.setattr(lookup, "WORKER", worker)


def test_lookup_alternates_builds_and_reports_the_ratio_spread(tmp_path, monkeypatch) -> None:
    worker = _script(tmp_path, """
        import json, os, sys
        build = os.environ["BUILD"]
        slow = 1.02 if build == "patched" else 1.0
        print("{not json")
        print(json.dumps({"ready": True, "hits": {"decode": 7, "plain": 3}, "timed": "f"}), flush=True)
        n = 0
        for _ in sys.stdin:
            n += 1
            with open("order", "a") as fh:
                fh.write(build + "\\n")
            print(json.dumps({"sample": {"decode": 100 * slow * n, "plain": 50 * slow * n}}), flush=True)
    """)
    _fake_lookup_env(tmp_path, monkeypatch, worker)
    report = lookup.run(None, lookup.LookupOptions(stub_pin("0.0.0"), repeats=4, calls=1))
    ratio = report.ratio_patched_over_stock
    assert ratio["decode"]["median"] == pytest.approx(1.02)
    assert ratio["plain"]["min"] == pytest.approx(1.02)
    assert report.hit_tokens["patched"] == {"decode": 7, "plain": 3}
    assert "1.020 [1.020, 1.020]" in lookup.table(report)
    assert report.stock_build == "v0.0.0 + scheduler-mamba-external-kv"
    assert report.to_json()["ratio_patched_over_stock"] == ratio
    assert list(report.to_json()) == [  # the --json keys, in their order
        "pin", "connector", "stock_build", "prompt_len", "block_size", "calls_per_sample",
        "repeats", "timed", "hit_tokens", "ns_per_call", "ratio_patched_over_stock",
    ]
    order = (tmp_path / "order").read_text().split()
    assert order == ["stock", "patched", "patched", "stock"] * 2


def test_lookup_worker_that_dies_is_one_error(tmp_path, monkeypatch) -> None:
    worker = _script(tmp_path, "raise SystemExit('import failed')\n")
    _fake_lookup_env(tmp_path, monkeypatch, worker)
    with pytest.raises(env.BenchError, match=r"lookup worker \(stock\) stopped answering; log "):
        lookup.run(None, lookup.LookupOptions(stub_pin("0.0.0"), repeats=1, calls=1))


# -- connector sets with a store child, speculative decoding ------------------------

def test_every_set_operators_deploy_is_offered_and_lmcache_is_lmcache_mp() -> None:
    assert set(replay.CONNECTORS) >= {"nixl", "nixl+decodebench", "nixl+lmcache",
                                      "lmcache+nixl", "nixl+offloading", "offloading+nixl"}
    # The builders' nixl+lmcache is LMCacheConnectorV1; the replay builds LMCacheMP.
    from hybridpd.bench import replay_stores
    assert replay_stores.BUILDERS_KIND == {"nixl+lmcache": "nixl+lmcachemp",
                                           "lmcache+nixl": "lmcachemp+nixl"}
    assert replay.store_child("offloading+nixl") == "OffloadingConnector"
    assert replay.store_child("nixl+decodebench") is None


@pytest.mark.parametrize("connector", ["nixl+lmcache", "lmcache+nixl", "nixl+offloading",
                                       "offloading+nixl"])
def test_store_sets_on_0_20_2_are_one_line(monkeypatch, connector) -> None:
    monkeypatch.setattr(State, "series", _repo_series())
    monkeypatch.setattr(replay, "prepared", lambda *a, **k: pytest.fail("must not prepare"))
    result = CliRunner().invoke(cli_main.main, ["bench", "replay", "--pin", "0.20.2",
                                                "--connector", connector])
    assert result.exit_code == 2, result.output
    line = [x for x in result.stderr.splitlines() if "needs vLLM 0.32" in x]
    assert len(line) == 1 and "hybrid KV cache manager" in line[0], result.stderr


def test_store_capacity_and_speculative_options_reach_the_spec(monkeypatch) -> None:
    seen = {}

    def run(series, options, log, status):
        seen["o"] = options
        return _report()

    monkeypatch.setattr(replay, "run", run)
    monkeypatch.setattr(State, "series", _repo_series())
    runner = CliRunner()
    out = runner.invoke(cli_main.main, [
        "bench", "replay", "--pin", "0.33.0", "--connector", "lmcache+nixl",
        "--store-blocks", "100", "--num-speculative-tokens", "3"])
    assert out.exit_code == 0, out.output
    o = seen["o"]
    assert (o.connector, o.store_blocks, o.speculative.to_json()) == (
        "lmcache+nixl", 100, {"method": "mtp", "num_speculative_tokens": 3})
    plan = deployment.plan(o.workload, o.hardware, deployment.load_model_config(None))
    spec = replay.spec(o, plan, env.BenchEnv(o.pin, Path("."), Path("."), {}, Path("b")), "stock")
    assert spec["store_blocks"] == 100
    # Qwen3.5's one MTP module, reused for the 3 tokens.
    assert spec["speculative"] == {"method": "mtp", "num_speculative_tokens": 3,
                                   "mtp_modules": 1}
    out = runner.invoke(cli_main.main, [
        "bench", "replay", "--pin", "0.33.0", "--speculative-config",
        '{"method": "mtp", "num_speculative_tokens": 2}'])
    assert out.exit_code == 0, out.output
    assert seen["o"].speculative.num_speculative_tokens == 2


@pytest.mark.parametrize("args,message", [
    (["--speculative-config", "{"], "not JSON"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
     "not modelled"),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 0}'],
     "positive integer"),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}',
      "--num-speculative-tokens", "1"], "not both"),
    (["--num-speculative-tokens", "0"], "at least 1"),
])
def test_bad_speculative_options_are_one_line(monkeypatch, args, message) -> None:
    monkeypatch.setattr(replay, "run", lambda *a, **k: pytest.fail("must not run"))
    monkeypatch.setattr(State, "series", _repo_series())
    result = CliRunner().invoke(cli_main.main, ["bench", "replay", "--pin", "0.33.0", *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr


def test_mtp_cost_adds_drafting_and_verification_to_a_step() -> None:
    cost = {"step_overhead_ms": 1.0, "weights_read_ms": 10.0, "kv_read_ms_per_token": 0.01,
            "state_read_ms_per_request": 0.5, "prefill_ms_per_token": 0.1}
    requests = {"a": _Req(100, 101), "b": _Req(50, 60)}
    plain = decode_replay.step_ms(cost, _Out({"a": 1, "b": 1}), requests)
    mtp = dict(cost, draft_ms_per_step=0.75, verify_tokens_per_request=3)
    got = decode_replay.step_ms(mtp, _Out({"a": 1, "b": 1}), requests)
    assert got == pytest.approx(plain + 0.75 + 2 * 3 * 0.1)
    options = replay.ReplayOptions(stub_pin("0.33.0"))
    options.speculative = replay.Speculative("mtp", 3)
    plan = deployment.plan(options.workload, options.hardware, deployment.load_model_config(None))
    lines = replay.speculative_cost(plan, options)
    assert plan.cost["draft_ms_per_step"] == pytest.approx(3 * plan.cost["weights_read_ms"] / 40)
    assert "acceptance is not modelled" in lines[0]


def test_table_shows_tokens_per_child_the_store_and_the_hit_given_up() -> None:
    report = _report()
    for build, lm, nixl in (("stock", 32256, 56058), ("patched", 0, 42488)):
        report.results[build].update(
            served_by={"LMCacheMPConnector": lm, "NixlPullConnector": nixl},
            store_blocks=64, store_evicted_chunks=0, limited_requests=4,
            speculative={"method": "mtp", "num_speculative_tokens": 3, "mtp_modules": 1,
                         "lookahead_slots": 3, "prefill_lookahead_tokens": 1,
                         "nixl_prefill_backoff": 1, "drops_last_matched_block": True})
    report.results["patched"].update(hit_tokens=60, limit_tokens=100)
    report.cost_model["block_size"] = 10
    lines = render.replay_table(report).splitlines()
    assert any(x.startswith("loaded by the connectors") for x in lines)
    row = next(x for x in lines if "loaded by LMCacheMPConnector" in x)
    assert row.split()[-3:] == ["32,256", "0", "0.00x"]
    assert next(x for x in lines if "store capacity" in x).split()[-3:-1] == ["64", "64"]
    assert any("drops the last matched block" in x for x in lines)
    given = next(x for x in lines if x.strip().startswith("patched: hit below the limit"))
    assert "40 tokens over 4 requests, 1.00 blocks per request" in given
    assert any("drop_eagle_block" in x for x in lines)


def test_lmcache_stand_in_server_holds_its_capacity_least_recently_used_first(monkeypatch) -> None:
    import importlib.util

    from hybridpd.bench import replay_stores

    path = Path(__file__).resolve().parents[1] / "patches" / "hash_stores.py"
    module = importlib.util.spec_from_file_location("hash_stores_for_bench", path)
    hash_stores = importlib.util.module_from_spec(module)
    monkeypatch.setitem(sys.modules, module.name, hash_stores)  # its dataclasses need it
    module.loader.exec_module(hash_stores)
    server = replay_stores.capped_server(hash_stores, chunk_tokens=4, capacity=3)
    a, b = list(range(10, 22)), list(range(10, 18)) + [99, 98, 97, 96]
    server.store(a)  # 3 chunks
    assert server.lookup(a, 12) == 12 and server.lookup(a, 11) == 8
    assert server.holds(a, 8) and not server.holds(a, 6)
    server.store(b)  # shares a's first 2 chunks; its third evicts a's third
    assert server.evicted == 1
    assert server.lookup(b, 12) == 12 and server.lookup(a, 12) == 8


def test_lmcache_stand_in_server_ends_a_hit_only_at_a_stored_mamba_object(monkeypatch) -> None:
    import importlib.util

    from hybridpd.bench import replay_stores

    path = Path(__file__).resolve().parents[1] / "patches" / "hash_stores.py"
    module = importlib.util.spec_from_file_location("hash_stores_for_bench", path)
    hash_stores = importlib.util.module_from_spec(module)
    monkeypatch.setitem(sys.modules, module.name, hash_stores)
    module.loader.exec_module(hash_stores)
    for server in (replay_stores.capped_server(hash_stores, chunk_tokens=4, capacity=8),
                   hash_stores.FakeLMCacheServer(chunk_tokens=4)):
        a = list(range(10, 26))  # 4 chunks, computed in one step: a state at 16 only
        server.store(a, state_ends={16})
        assert [server.lookup(a, e) for e in (4, 8, 12, 16)] == [0, 0, 0, 16]
        assert server.holds(a, 16) and not server.holds(a, 12)
        # A later store of the first chunks from a step ending at 8 adds that state.
        server.store(a, 8, state_ends={8})
        assert server.lookup(a, 12) == 8 and server.lookup(a, 16) == 16
        # A store that starts past the first chunk leaves the earlier chunks out.
        b = list(range(50, 66))
        server.store(b, start=8)
        assert server.lookup(b, 16) == 0
