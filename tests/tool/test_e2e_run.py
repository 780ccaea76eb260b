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
from hybridpd.e2e.envs import Env
from hybridpd.e2e.servers import E2EError

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

    def tiny_model(env, arch, seed, cache, process_env, variant="default"):
        calls.append(("tiny", arch, variant))
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
    monkeypatch.setattr(run_mod, "prepare", prepare)
    monkeypatch.setattr(run_mod, "probe", probe)
    monkeypatch.setattr(run_mod, "tiny_model", tiny_model)
    monkeypatch.setattr(pair_mod, "start_pair", start_pair)
    monkeypatch.setattr(smoke, "run_smoke", run_smoke)
    return calls


class _Calls(list):
    fail: tuple[str, str] | None = None  # the (build, connector) whose pair does not start


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

    def start(self, name, cmd, env=None, cwd=None, shm=()):
        self.started[name] = cmd

    def wait_ready(self, urls, timeout, progress):
        return {n: 1.0 for n in urls}


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


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
    recorders = []

    def start_pair(procs, env, model, connector, role, opts, progress):
        recorders.append(_Recorder(tmp_path))
        return pair_mod._start_pair_once(recorders[-1], env, model, connector, role, opts,
                                         progress)

    monkeypatch.setattr(pair_mod, "start_pair", start_pair)
    monkeypatch.setattr(correctness, "run_correctness", lambda *a, **k: {
        "requests": [], "outputs_match_baseline": True, "checks": {}})
    result = run_mod.run(series, _options(tmp_path, series, scenario=scenario, **given), [], print)
    [started] = [r.started for r in recorders]
    assert [_flag(started[s], "--max-model-len") for s in ("prefill", "decode")] == [
        max_model_len] * 2
    assert _flag(started["decode"], "--num-gpu-blocks-override") == blocks
    assert _flag(started["prefill"], "--num-gpu-blocks-override") is None
    assert result.report.server_options["max_model_len"] == int(max_model_len)


def test_the_pool_arithmetic() -> None:
    qwen35 = ["linear_attention"] * 30 + ["full_attention"] * 10  # 40 layers, 1 in 4
    assert pair_mod.kv_cache_groups(qwen35) == pair_mod.kv_cache_groups(
        pair_mod.QWEN35_LAYER_TYPES) == (3, 1)
    assert pair_mod.kv_cache_groups(["linear_attention", "full_attention"]) == (1, 1)
    assert pair_mod.pool_max_model_len(16, 128, qwen35) == 1152
    # vLLM's 256-token blocks (a CPU with AVX-512 BF16) hold more, never less.
    assert pair_mod.pool_max_model_len(16, 256, qwen35) == 2304
    assert pair_mod.pool_max_model_len(7, 128, qwen35) == 0


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
