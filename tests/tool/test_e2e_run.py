"""``e2e.run.run``'s orchestration with the servers and scenarios stood in: which pairs
run, in which order, what the report records, and what a failed pair leaves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from builders import standard_project

from hybridpd.series.model import Series
from hybridpd import proc
from hybridpd.e2e import reap
from hybridpd.e2e import run as run_mod
from hybridpd.e2e import correctness, smoke
from hybridpd.e2e import pair as pair_mod
from hybridpd.e2e import router as router_mod
from hybridpd.e2e.envs import Env
from hybridpd.e2e.servers import E2EError
from hybridpd.errors import UsageError

pytestmark = pytest.mark.usefixtures("isolated")


@pytest.fixture
def stood_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> _Calls:
    """Environments, probes, the tiny model, the pair and the smoke scenario, recorded."""
    calls = _Calls()

    def prepare(series, version, build, device, log, torch=None):
        calls.append(("prepare", build))
        venv = tmp_path / f"venv-{build}"
        return Env(build, venv / "bin" / "python", venv, None, "0" * 40, True, {})

    def probe(env, process_env, device):
        return {"nixl": "ok", "qwen3_5": "ok", "vllm": "1.0",
                "kernels": {"module": "vllm._C_AVX2", "status": "ok"}}

    def tiny_model(env, arch, seed, cache, process_env, variant="default", mtp=False):
        calls.append(("tiny", arch, variant, *(("mtp",) if mtp else ())))
        path = tmp_path / "tiny"
        path.mkdir(exist_ok=True)
        (path / "hybridpd-tiny.json").write_text(json.dumps(
            {"architectures": ["Qwen3_5ForCausalLM"], "parameters": 10, "vocab_size": 300}))
        return path

    def start_pair(procs, env, model, connector, role, opts, progress):
        calls.append(("pair", env.build, connector, model, role))
        if calls.fail == (env.build, connector):
            raise E2EError("decode exited with code 1")
        return pair_mod.Pair("p", "d", "x", ready_s={"decode": 1.0}, commands={"decode": ["vllm"]})

    def run_smoke(pair, procs, vocab, opts, log):
        calls.append(("smoke", vocab, opts.prompt_tokens))
        return {"requests": [{"label": "r1", "prompt_tokens": opts.prompt_tokens}],
                "decode_prefix_cache_hits": 128, "decode_prefix_cache_queries": 256,
                "outputs_match_baseline": True, "checks": {"decode_local_hit": True}}

    monkeypatch.setattr(run_mod, "preflight", lambda *a, **k: None)
    # The router goes into the venvs hybridpd prepares; a venv the user gave must have it.
    monkeypatch.setattr(router_mod, "install",
                        lambda python, log: calls.routers.append(("install", python)))
    monkeypatch.setattr(router_mod, "require",
                        lambda python: calls.routers.append(("require", python)))
    monkeypatch.setattr(run_mod, "prepare", prepare)
    monkeypatch.setattr(run_mod, "probe", probe)
    monkeypatch.setattr(run_mod, "tiny_model", tiny_model)
    monkeypatch.setattr(pair_mod, "start_pair", start_pair)
    monkeypatch.setattr(smoke, "run_smoke", run_smoke)
    return calls


class _Calls(list):
    fail: tuple[str, str] | None = None  # the (build, connector) whose pair does not start

    def __init__(self) -> None:
        super().__init__()
        self.routers: list[tuple[str, Path]] = []  # router_mod.install/require calls


def _options(tmp_path: Path, series: Series, **kw) -> run_mod.E2EOptions:
    return run_mod.E2EOptions(pin=series.pin("1.0"), tiny=True, out_dir=tmp_path / "out", **kw)


def test_each_build_serves_each_connector_and_the_report_records_it(
    tmp_path: Path, stood_in: _Calls
) -> None:
    _, series = standard_project(tmp_path)
    options = _options(tmp_path, series, connectors=("nixl", "nixl+decodebench"), compare="stock",
                       prompt_tokens=300, shared_tokens=200, expect_patched_hit=True)
    result = run_mod.run(series, options, ["hybridpd", "e2e", "--pin", "1.0"], print)

    assert stood_in == [
        ("prepare", "patched"), ("prepare", "stock"),
        ("tiny", "qwen3_5", "default"),
        *[step for b in ("patched", "stock") for c in ("nixl", "nixl+decodebench")
          for step in (("pair", b, c, str(tmp_path / "tiny"), "kv_both"), ("smoke", 300, 300))],
    ]
    # Every run is checked: here stock keeps the hit on a set upstream does not handle.
    assert result.failures == [
        "stock / nixl+decodebench: stock already keeps the decode-side hit, "
        "so the gate proves nothing"
    ]
    data = json.loads(result.paths["json"].read_text())
    assert data["command"] == ["hybridpd", "e2e", "--pin", "1.0"]
    assert data["options"]["prompt_tokens"] == 300
    assert data["options"]["version"] == "1.0"  # the report's contract: the pin by version
    assert [(r["build"], r["connector"]) for r in data["runs"]] == [
        ("patched", "nixl"), ("patched", "nixl+decodebench"),
        ("stock", "nixl"), ("stock", "nixl+decodebench"),
    ]
    run = data["runs"][0]
    # In the order report.json always had: who, the scenario's result, timings, logs.
    assert list(run) == [
        "build", "connector", "requests", "decode_prefix_cache_hits",
        "decode_prefix_cache_queries", "outputs_match_baseline", "checks",
        "ready_s", "scenario_s", "total_s", "logs", "server_commands",
    ]
    assert run["decode_prefix_cache_hits"] == 128 and run["ready_s"] == {"decode": 1.0}
    assert run["logs"] == str(tmp_path / "out" / "patched-nixl")
    assert data["capabilities"]["patched"]["kernels"]["module"] == "vllm._C_AVX2"


def test_a_pair_that_fails_is_in_the_report_with_the_runs_before_it(
    tmp_path: Path, stood_in: _Calls
) -> None:
    _, series = standard_project(tmp_path)
    stood_in.fail = ("stock", "nixl")
    with pytest.raises(E2EError, match=r"^stock / nixl: decode exited with code 1$"):
        run_mod.run(series, _options(tmp_path, series, compare="stock"), ["hybridpd"], print)
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [(r["build"], r.get("error")) for r in data["runs"]] == [
        ("patched", None), ("stock", "decode exited with code 1"),
    ]
    assert data["runs"][1]["requests"] == [] and data["runs"][1]["logs"].endswith("stock-nixl")


def test_the_options_are_checked_before_anything_runs(
    tmp_path: Path, stood_in: _Calls
) -> None:
    _, series = standard_project(tmp_path)
    with pytest.raises(run_mod.E2EUsageError, match="--gpus takes two GPU ids"):
        run_mod.run(series, _options(tmp_path, series, gpus="0,1,2"), [], print)
    with pytest.raises(run_mod.E2EUsageError, match="exactly one of --model and --tiny"):
        run_mod.run(series, run_mod.E2EOptions(pin=series.pin("1.0")), [], print)
    assert stood_in == [] and not (tmp_path / "out").exists()


def test_a_run_into_the_out_of_a_killed_run_ends_its_servers_first(
    tmp_path: Path, stood_in: _Calls
) -> None:
    _, series = standard_project(tmp_path)
    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                            start_new_session=True)
    try:
        ident = proc.identity(left.pid)
        reap.write(tmp_path / "out" / "patched-nixl" / reap.RECORD,
                   [reap.Entry("decode", left.pid, ident.pgid, ident.start_time)])
        said = []
        run_mod.run(series, _options(tmp_path, series), ["hybridpd"], said.append)
        assert left.wait(timeout=10) == -15  # SIGTERM, before the new pair started
        assert said[0].startswith("left by an earlier run: ")
        assert said[0].endswith("patched-nixl: decode ended process group "
                                f"{left.pid} (1 process(es))")
        assert stood_in.index(("pair", "patched", "nixl", str(tmp_path / "tiny"), "kv_both"))
    finally:
        left.kill()


class _Recorder:
    """Processes for the real ``_start_pair_once``: records each command, starts none."""

    procs: dict = {}

    def __init__(self, log_dir: Path) -> None:
        self.log_dir, self.started = log_dir, {}

    def start(self, name, cmd, env=None, cwd=None, shm=(), root=None):
        self.started[name] = cmd

    def wait_ready(self, urls, timeout, progress):
        return {n: 1.0 for n in urls}


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def _record_server_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list:
    """Pairs start on a :class:`_Recorder` each (returned, filled as pairs start); the
    correctness scenario answers at once, all checks passed."""
    recorders: list = []

    def start_pair(procs, env, model, connector, role, opts, progress):
        recorders.append(_Recorder(tmp_path))
        return pair_mod._start_pair_once(recorders[-1], env, model, connector, role, opts,
                                         progress)

    monkeypatch.setattr(pair_mod, "start_pair", start_pair)
    monkeypatch.setattr(correctness, "run_correctness", lambda *a, **k: {
        "requests": [], "outputs_match_baseline": True, "checks": {}})
    return recorders


@pytest.mark.parametrize(("scenario", "given", "max_model_len", "blocks"), [
    # The correctness scenario's pool, 16 blocks of 128 tokens: 3 Mamba groups take 2
    # blocks each, the null block 1, leaving 9 for attention.
    ("correctness", {}, "1152", "16"),
    ("correctness", {"max_model_len": 1024}, "1024", "16"),  # CI's, which fits
    ("correctness", {"decode_num_blocks": 20}, "1664", "20"),
    ("smoke", {}, "4096", None),  # a pool sized from memory
])
def test_the_servers_get_a_max_model_len_the_decode_pool_holds(
    tmp_path: Path, stood_in: _Calls, monkeypatch: pytest.MonkeyPatch,
    scenario, given, max_model_len, blocks,
) -> None:
    _, series = standard_project(tmp_path)
    recorders = _record_server_starts(tmp_path, monkeypatch)
    result = run_mod.run(series, _options(tmp_path, series, scenario=scenario, **given), [], print)
    [started] = [r.started for r in recorders]
    assert [_flag(started[s], "--max-model-len") for s in ("prefill", "decode")] == [
        max_model_len] * 2
    assert _flag(started["decode"], "--num-gpu-blocks-override") == blocks
    assert _flag(started["prefill"], "--num-gpu-blocks-override") is None
    assert result.report.server_options["max_model_len"] == int(max_model_len)


def test_speculative_config_goes_to_both_servers_and_sizes_the_decode_pool(
    tmp_path: Path, stood_in: _Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, series = standard_project(tmp_path)
    recorders = _record_server_starts(tmp_path, monkeypatch)
    monkeypatch.setattr(run_mod, "_acceptance", lambda pair, log: {
        "decode": {"draft_tokens": 100, "accepted_tokens": 95, "acceptance_rate": 0.95},
        "prefill": None})
    spec = '{"method": "mtp", "num_speculative_tokens": 3}'
    result = run_mod.run(series, _options(tmp_path, series, scenario="correctness",
                                          max_model_len=1024, speculative_config=spec),
                         [], print)
    [started] = [r.started for r in recorders]
    assert [_flag(started[s], "--speculative-config") for s in ("prefill", "decode")] == [
        '{"method":"mtp","num_speculative_tokens":3}'] * 2
    # The tiny model with its MTP module, 5 layers (3 linear, 2 full): 2 Mamba groups,
    # each holding 3 pages more per request, in blocks of 256 tokens. The smallest pool
    # that holds 1024 tokens with them (15) admits one concurrent request at a time and
    # never preempts; this one admits two (pair.concurrent_pool_blocks).
    assert ("tiny", "qwen3_5", "state-sensitive-mtp", "mtp") in stood_in
    assert _flag(started["decode"], "--num-gpu-blocks-override") == "23"
    assert _flag(started["decode"], "--max-model-len") == "1024"
    # A tiny model whose drafts are accepted nearly always no longer tests rejection.
    assert result.failures == [
        "patched / nixl: the decode instance accepted 0.95 of the MTP module's drafts, "
        "outside 0.2..0.8 (the tiny model's MTP weights no longer draft as designed)"]
    assert "decode accepted 95 of 100 drafted tokens" in result.paths["md"].read_text()


@pytest.mark.parametrize(("given", "n", "max_model_len", "blocks"), [
    # The blocks of 256 tokens vLLM serves the tiny model with (fp32 state). Two
    # concurrent requests: 1 null + (2 prefix blocks + 2 cached states) +
    # 2 x (1 attention block + 2 Mamba groups x (1 + N) pages).
    ({"max_model_len": 1024}, 1, "1024", "15"),
    ({"max_model_len": 1024}, 3, "1024", "23"),
    # A --max-model-len that needs more: the smallest pool that holds it (1 + 2 x 5 + 16).
    ({"max_model_len": 4096}, 3, "4096", "27"),
    # Left out: what the two-request pool holds, 12 attention blocks of 256 tokens.
    ({}, 3, "3072", "23"),
    ({"decode_num_blocks": 24}, 3, "3328", "24"),  # a pool given is the pool
])
def test_the_speculative_decode_pool_admits_two_concurrent_requests(
    tmp_path: Path, stood_in: _Calls, monkeypatch: pytest.MonkeyPatch,
    given, n, max_model_len, blocks,
) -> None:
    _, series = standard_project(tmp_path)
    recorders = _record_server_starts(tmp_path, monkeypatch)
    monkeypatch.setattr(run_mod, "_acceptance", lambda pair, log: {
        "decode": {"draft_tokens": 100, "accepted_tokens": 50, "acceptance_rate": 0.5},
        "prefill": None})
    spec = f'{{"method": "mtp", "num_speculative_tokens": {n}}}'
    run_mod.run(series, _options(tmp_path, series, scenario="correctness",
                                 speculative_config=spec, **given), [], print)
    [started] = [r.started for r in recorders]
    assert _flag(started["decode"], "--num-gpu-blocks-override") == blocks
    assert [_flag(started[s], "--max-model-len") for s in ("prefill", "decode")] == [
        max_model_len] * 2


def test_a_speculative_config_the_tiny_model_cannot_serve_is_one_line(
    tmp_path: Path, stood_in: _Calls
) -> None:
    _, series = standard_project(tmp_path)
    for spec, message in (
        ('{"method": "ngram", "num_speculative_tokens": 2}', "drafts with its MTP module"),
        ('{"method": "mtp"}', "num_speculative_tokens must be a positive integer"),
        ("[1]", "a JSON object"),
    ):
        with pytest.raises(UsageError, match=message):
            run_mod.run(series, _options(tmp_path, series, speculative_config=spec), [], print)
    assert stood_in == []


def test_the_pool_arithmetic() -> None:
    qwen35 = ["linear_attention"] * 30 + ["full_attention"] * 10  # 40 layers, 1 in 4
    assert pair_mod.kv_cache_groups(qwen35) == pair_mod.kv_cache_groups(
        pair_mod.QWEN35_LAYER_TYPES) == (3, 1)
    assert pair_mod.kv_cache_groups(["linear_attention", "full_attention"]) == (1, 1)
    assert pair_mod.pool_max_model_len(16, 128, qwen35) == 1152
    # vLLM's 256-token blocks (a CPU with AVX-512 BF16) hold more, never less.
    assert pair_mod.pool_max_model_len(16, 256, qwen35) == 2304
    assert pair_mod.pool_max_model_len(7, 128, qwen35) == 0
    # MTP N=3 on the tiny model (its MTP layer is a 5th, full-attention one): 2 Mamba
    # groups of 2 + 3 pages a request.
    with_mtp = list(pair_mod.QWEN35_LAYER_TYPES) + ["full_attention"]
    assert pair_mod.kv_cache_groups(with_mtp) == (2, 1)
    assert pair_mod.pool_max_model_len(22, 128, with_mtp, speculative_tokens=3) == 1408
    # The smallest pool for a length: the null block, 2 + 3 pages in each of the 2
    # Mamba groups, 8 attention blocks for 1024 tokens (the lookahead takes none beyond
    # max_model_len); a block less holds a request of 896 tokens.
    assert pair_mod.pool_blocks(1024, 128, with_mtp, speculative_tokens=3) == 19
    assert pair_mod.pool_max_model_len(19, 128, with_mtp, speculative_tokens=3) == 1024
    assert pair_mod.pool_max_model_len(18, 128, with_mtp, speculative_tokens=3) == 896
    assert pair_mod.pool_blocks(1152, 128, qwen35) == 16
    # Two concurrent prompts of 737 tokens sharing a 512-token prefix (the correctness
    # scenario's): the null block, 4 prefix blocks and a cached state per Mamba group,
    # then per request 2 attention blocks and 1 + N pages per Mamba group. Measured
    # on vLLM 0.32.0: preemption from 27 blocks for N = 3 (26: none), 19 for N = 1.
    assert pair_mod.concurrent_pool_blocks(512, 737, 128, with_mtp, 3) == 27
    assert pair_mod.concurrent_pool_blocks(512, 737, 128, with_mtp, 1) == 19
    # The lookahead past a block boundary takes a block more per request.
    assert pair_mod.concurrent_pool_blocks(512, 766, 128, with_mtp, 3) == 29
    assert pair_mod.concurrent_pool_blocks(512, 737, 128, with_mtp, 3, requests=3) == 37
    # No whole prefix block: nothing is shared.
    assert pair_mod.concurrent_pool_blocks(100, 200, 128, with_mtp, 1) == 1 + 2 * (2 + 4)
    for layers, n in ((qwen35, 0), (with_mtp, 1), (with_mtp, 3), (qwen35, 2)):
        for length in (1, 127, 128, 129, 1000, 1024, 1025, 4096):
            for bs in (128, 256):
                blocks = pair_mod.pool_blocks(length, bs, layers, speculative_tokens=n)
                assert pair_mod.pool_max_model_len(blocks, bs, layers, n) >= length
                assert pair_mod.pool_max_model_len(blocks - 1, bs, layers, n) < length


def test_the_tiny_models_without_mtp_keep_their_cache_ids() -> None:
    from hybridpd.e2e.tinymodel import spec_id

    # The ids (model directories) runs without --speculative-config always had.
    assert spec_id(0) == "b402d1eaaded"
    assert spec_id(0, variant="state-sensitive") == "2a24c591f354"
    with_mtp = spec_id(0, variant="state-sensitive-mtp", mtp=True)
    assert with_mtp not in (spec_id(0, variant="state-sensitive-mtp"), spec_id(0))


def test_the_router_goes_into_prepared_venvs_and_a_given_venv_must_have_it(
    tmp_path: Path, stood_in: _Calls
) -> None:
    _, series = standard_project(tmp_path)
    given = tmp_path / "given"
    (given / "bin").mkdir(parents=True)
    (given / "bin" / "python").write_text("")
    result = run_mod.run(series, _options(tmp_path, series, compare="stock",
                                          stock_venv=given), [], print)
    assert stood_in.routers == [
        ("install", tmp_path / "venv-patched" / "bin" / "python"),
        ("require", given / "bin" / "python"),
    ]
    assert result.report.server_options["front"] == f"vllm-router {router_mod.VERSION}"
    md = result.paths["md"].read_text()
    assert f"through `vllm-router {router_mod.VERSION}`" in md

    stood_in.routers.clear()
    result = run_mod.run(series, _options(tmp_path, series, front="proxy"), [], print)
    assert stood_in.routers == []  # the proxy runs under any Python
    assert result.report.server_options["front"] == "hybridpd proxy"
    assert "through hybridpd's proxy" in result.paths["md"].read_text()
    with pytest.raises(run_mod.E2EUsageError, match="^--front nginx: choose router or proxy$"):
        run_mod.run(series, _options(tmp_path, series, front="nginx"), [], print)


@pytest.mark.parametrize("front", ["router", "proxy"])
def test_the_router_starts_once_both_instances_answer(
    tmp_path: Path, stood_in: _Calls, monkeypatch: pytest.MonkeyPatch, front: str
) -> None:
    """vllm-router checks its workers once at its start: it starts after P and D answer
    and is waited for on its own; the proxy starts beside them."""
    _, series = standard_project(tmp_path)
    order = []

    class Recorder(_Recorder):
        def start(self, name, cmd, env=None, cwd=None, shm=(), root=None):
            order.append(("start", name))
            super().start(name, cmd, env, cwd, shm)

        def wait_ready(self, urls, timeout, progress):
            order.append(("wait", *urls))
            return super().wait_ready(urls, timeout, progress)

    recorders = []

    def start_pair(procs, env, model, connector, role, opts, progress):
        recorders.append(Recorder(tmp_path))
        return pair_mod._start_pair_once(recorders[-1], env, model, connector, role, opts,
                                         progress)

    monkeypatch.setattr(pair_mod, "start_pair", start_pair)
    monkeypatch.setattr(correctness, "run_correctness", lambda pair, *a, **k: {
        "requests": [], "outputs_match_baseline": True, "checks": {},
        "front_seen": [pair.front, pair.front_kind]})
    run_mod.run(series, _options(tmp_path, series, scenario="correctness", front=front), [],
                print)
    [started] = [r.started for r in recorders]
    if front == "router":
        assert order == [("start", "prefill"), ("start", "decode"),
                         ("wait", "prefill", "decode"), ("start", "router"), ("wait", "router")]
        cmd = started["router"]
        assert cmd[0] == str(tmp_path / "venv-patched" / "bin" / "vllm-router")
        prefill_port, decode_port = (_flag(started[s], "--port") for s in ("prefill", "decode"))
        assert _flag(cmd, "--prefill") == f"http://127.0.0.1:{prefill_port}"
        assert _flag(cmd, "--decode") == f"http://127.0.0.1:{decode_port}"
    else:
        assert order == [("start", "prefill"), ("start", "decode"), ("start", "proxy"),
                         ("wait", "prefill", "decode", "proxy")]
        assert "router" not in started


def test_the_dry_run_prints_a_single_gpu_pair_p_and_d_sharing_its_memory(
    tmp_path: Path, stood_in: _Calls
) -> None:
    """One GPU id: P and D both on it, each with half of --gpu-memory-utilization; a
    dry run prints their command lines and starts, builds and writes nothing."""
    _, series = standard_project(tmp_path)
    options = _options(tmp_path, series, device="cuda", gpus="0", compare="stock",
                       scenario="correctness", patched_venv=Path("/v/patched"),
                       stock_venv=Path("/v/stock"))
    lines = run_mod.dry_run(series, options, print)

    assert [l for l in lines if l.startswith("#")] == ["# patched / nixl", "# stock / nixl"]
    servers = [l for l in lines if not l.startswith("#")]
    assert len(servers) == 4
    model = tmp_path / "cache" / "e2e" / "models" / "tiny-qwen3_5-2a24c591f354"  # state-sensitive
    for line, python, port, side_port in zip(
        servers, ["/v/patched"] * 2 + ["/v/stock"] * 2, [8100, 8200] * 2, [5600, 5601] * 2
    ):
        assert line.startswith(
            f"CUDA_VISIBLE_DEVICES=0 VLLM_NIXL_SIDE_CHANNEL_PORT={side_port} "
            "VLLM_KV_CACHE_LAYOUT=HND VLLM_SSM_CONV_STATE_LAYOUT=DS HF_HUB_OFFLINE=1 "
            f"{python}/bin/python -m vllm.entrypoints.openai.api_server --model {model} "
        )
        assert f" --port {port} " in line
        assert line.endswith(" --async-scheduling --gpu-memory-utilization 0.425") or \
            " --gpu-memory-utilization 0.425 --num-gpu-blocks-override 16" in line
        assert "'{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_both\"}'" in line
    # The correctness scenario shrinks the decode pool only.
    assert ["--num-gpu-blocks-override" in l for l in servers] == [False, True] * 2
    assert stood_in == [] and not (tmp_path / "out").exists()
    # Two GPUs keep their own GPU and the whole share each.
    two = run_mod.dry_run(series, _options(tmp_path, series, device="cuda", gpus="0,1",
                                           patched_venv=Path("/v/patched")), print)
    assert [l.split()[0] for l in two[1:]] == ["CUDA_VISIBLE_DEVICES=0", "CUDA_VISIBLE_DEVICES=1"]
    assert all(" --gpu-memory-utilization 0.85" in l for l in two[1:])


def test_the_served_block_size_follows_vllms_page_rule_for_the_tiny_model() -> None:
    from hybridpd.e2e.tinymodel import SPEC
    # fp32 Gated-DeltaNet state (the CPU instances'): 3 072 + 65 536 bytes without
    # speculative decoding, 6 144 + 65 536 with 3 tokens, over a 64 KiB page of 128.
    assert [pair_mod.served_block_size(SPEC, 128, n) for n in (0, 1, 3)] == [256] * 3
    # bf16 state (vLLM's choice on a CPU without AVX-512 BF16) fits 128.
    assert [pair_mod.served_block_size(SPEC, 128, n, 2) for n in (0, 3)] == [128] * 2
    assert pair_mod.served_block_size(SPEC, 512, 3) == 512  # never lowered


def test_cpu_instances_keep_the_mamba_state_in_fp32_on_every_host(tmp_path: Path) -> None:
    env = Env("patched", tmp_path / "venv" / "bin" / "python", tmp_path / "venv", None, None,
              False, {})
    cmd = pair_mod.server_command(env, "m", 8000, {}, pair_mod.ServerOptions(), True)
    assert cmd[cmd.index("--mamba-ssm-cache-dtype") + 1] == "float32"
    cuda = pair_mod.server_command(env, "m", 8000, {}, pair_mod.ServerOptions(device="cuda"),
                                   True)
    assert "--mamba-ssm-cache-dtype" not in cuda


def test_the_correctness_scenario_stops_where_d_serves_another_block_size(monkeypatch) -> None:
    from hybridpd.e2e import metrics

    def served(size: int):
        return lambda url, timeout=10.0: metrics.parse(
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{size}",engine="0"}} 1.0\n')

    monkeypatch.setattr(metrics, "scrape", served(256))
    correctness.check_served_block_size("http://d", 256)
    monkeypatch.setattr(metrics, "scrape", served(128))
    with pytest.raises(E2EError, match="serves blocks of 128 tokens; the scenario was derived "
                                       "for 256"):
        correctness.check_served_block_size("http://d", 256)


def test_the_served_block_size_is_derived_only_where_the_model_and_host_tell_it(
    tmp_path: Path,
) -> None:
    _, series = standard_project(tmp_path)
    assert run_mod._served_block_size(_options(tmp_path, series), 3) == 256
    # A GPU picks its own kernel alignment and state dtype; a model whose config has no
    # Gated-DeltaNet sizes gives nothing to derive: neither is sized by it nor checked.
    assert run_mod._served_block_size(_options(tmp_path, series, device="cuda"), 3) is None
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"text_config": {"head_dim": 64}}))
    local = run_mod.E2EOptions(pin=series.pin("1.0"), model=str(model),
                               out_dir=tmp_path / "out")
    assert run_mod._served_block_size(local, 3) is None
