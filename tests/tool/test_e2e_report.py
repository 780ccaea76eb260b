"""hybridpd.e2e: /metrics parsing, report writing, server configuration (no vLLM)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hybridpd.e2e import client, metrics, report, smoke
from hybridpd.e2e import pair as pair_mod
from hybridpd.e2e.tinymodel import spec_id

pytest.importorskip("prometheus_client")

# Shaped like vLLM 0.32's /metrics: counters with _total, label sets per engine,
# a histogram whose _sum is what NIXL bytes are read from.
METRICS_TEXT = """\
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="e2e"} 2800.0
vllm:prefix_cache_queries_total{engine="1",model_name="e2e"} 1400.0
# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="e2e"} 1280.0
# HELP vllm:nixl_bytes_transferred Number of bytes transferred per NIXL KV Cache transfers
# TYPE vllm:nixl_bytes_transferred histogram
vllm:nixl_bytes_transferred_bucket{engine="0",le="1048576.0",model_name="e2e"} 2.0
vllm:nixl_bytes_transferred_bucket{engine="0",le="+Inf",model_name="e2e"} 2.0
vllm:nixl_bytes_transferred_count{engine="0",model_name="e2e"} 2.0
vllm:nixl_bytes_transferred_sum{engine="0",model_name="e2e"} 1.329152e+06
"""


def test_parse_sums_label_sets_and_finds_counters_by_family_name() -> None:
    snap = metrics.parse(METRICS_TEXT)
    assert snap.value(metrics.PREFIX_CACHE_QUERIES) == 4200
    assert snap.value(metrics.PREFIX_CACHE_HITS) == 1280
    assert snap.value(metrics.NIXL_BYTES) == 1329152
    assert snap.value(metrics.NIXL_TRANSFERS) == 2
    assert not snap.has(metrics.EXTERNAL_PREFIX_CACHE_HITS)
    before = metrics.parse(METRICS_TEXT.replace("1.329152e+06", "992256.0"))
    assert snap.delta(before, metrics.NIXL_BYTES) == 336896


def test_parse_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        metrics.parse("vllm:x{engine=0 not prometheus\n")


def _run(build: str, connector: str, hits: tuple[int, int, int], ok: bool = True) -> dict:
    reqs = [
        {"label": label, "prompt_tokens": 1400, "decode_local_hit_tokens": h,
         "kv_bytes_transferred": 992256 - h * 512, "ttft_ms": 900.0 - h / 2,
         "output_token_ids": [1, 2, 3]}
        for label, h in zip(("r1 A cold", "r2 A again", "r3 B shares prefix"), hits)
    ]
    return {"build": build, "connector": connector, "requests": reqs,
            "decode_prefix_cache_hits": sum(hits), "decode_prefix_cache_queries": 4200,
            "outputs_match_baseline": ok,
            "checks": {"decode_local_hit": hits[2] > 0, "warm_equals_cold_decode": ok}}


def smoke_report() -> dict:
    return {
        "pin": "0.32.0", "device": "cpu", "model": "/m", "scenario": "smoke",
        "runs": [
            _run("patched", "nixl+decodebench", (0, 1280, 1280)),
            _run("stock", "nixl+decodebench", (0, 0, 0)),
        ],
    }


def test_report_files_and_json_contract(tmp_path: Path) -> None:
    paths = report.write(report.E2EReport.from_json(smoke_report()), tmp_path, plot_python=None)
    data = json.loads(paths["json"].read_text())
    assert {"pin", "device", "model", "scenario", "runs"} <= set(data)
    for run in data["runs"]:
        assert {"build", "connector", "requests", "decode_prefix_cache_hits",
                "decode_prefix_cache_queries", "outputs_match_baseline"} <= set(run)
        for req in run["requests"]:
            assert {"prompt_tokens", "decode_local_hit_tokens", "kv_bytes_transferred",
                    "ttft_ms", "output_token_ids"} <= set(req)
    md = paths["md"].read_text()
    # r3: OFF hit 0, ON hit 1 280; bytes 992 256 -> 336 896 (-66.0 %).
    row = next(l for l in md.splitlines() if "r3 B shares prefix" in l)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:8] == ["0", "1 280", "992 256", "336 896", "-66.0%"]
    assert "stock / nixl+decodebench: failed: decode_local_hit" in md
    assert "patched / nixl+decodebench: all checks pass" in md


def test_report_says_what_the_stock_build_carries(tmp_path: Path) -> None:
    data = smoke_report()
    md = report.markdown(report.E2EReport.from_json(data))
    assert "OFF carries" not in md
    data["environments"] = {"stock": {"build": "stock", "baseline": ["cpu-fix"]},
                            "patched": {"build": "patched", "baseline": []}}
    md = report.markdown(report.E2EReport.from_json(data))
    assert "OFF carries `cpu-fix`: stock vLLM 0.32.0 cannot serve on cpu without it." in md


def test_report_names_the_front_and_what_did_not_go_through_it() -> None:
    data = smoke_report()
    # A report from before the front was recorded went through the proxy.
    assert "through hybridpd's proxy." in report.markdown(report.E2EReport.from_json(data))
    data["server_options"] = {"front": "vllm-router 0.1.17"}
    md = report.markdown(report.E2EReport.from_json(data))
    assert "TTFT measured at the client through `vllm-router 0.1.17`." in md
    assert "concurrent ones" not in md  # the smoke has no preemption phase
    data["scenario"], data["runs"] = "correctness", []
    md = report.markdown(report.E2EReport.from_json(data))
    assert ("The sequential PD requests go through `vllm-router 0.1.17`; the concurrent "
            "ones (the preemption phase) do not:") in md


def test_bench_table_uses_the_seed_layout() -> None:
    rep = {"pin": "0.32.0", "device": "cpu", "model": "/m", "scenario": "prefix-repetition",
           "runs": []}
    work = {"prefix_len": 1024, "suffix_len": 128, "num_prefixes": 2, "num_prompts": 16,
            "concurrency": 4}
    for build, ttft, tps in (("stock", 2000.0, 10.0), ("patched", 1000.0, 20.0)):
        rep["runs"].append({"build": build, "connector": "nixl", "workload": work,
                            "bench": {"mean_ttft_ms": ttft, "output_throughput": tps},
                            "decode_prefix_cache_hits": 0, "decode_prefix_cache_queries": 1})
    header, _, row = report.table(report.E2EReport.from_json(rep))
    assert "OFF TTFT (ms) | ON TTFT (ms) | ΔTTFT | OFF Output TPS | ON Output TPS | ΔTPS" in header
    assert "| 2 000 | 1 000 | -50.0% | 10.0 | 20.0 | +100.0% |" in row


def test_plot_is_drawn_where_matplotlib_is(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import sys

    paths = report.write(
        report.E2EReport.from_json(smoke_report()), tmp_path, plot_python=Path(sys.executable)
    )
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kv_transfer_configs() -> None:
    assert pair_mod.kv_transfer_config("nixl", "D", "kv_both", "cpu") == {
        "kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    d = pair_mod.kv_transfer_config("nixl+decodebench", "D", "kv_producer/kv_consumer", "cpu")
    assert d["kv_connector"] == "MultiConnector" and d["kv_role"] == "kv_consumer"
    children = d["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector"] for c in children] == ["NixlConnector", "DecodeBenchConnector"]
    assert {c["kv_role"] for c in children} == {"kv_consumer"}
    # P always runs NIXL alone, as the producer.
    p = pair_mod.kv_transfer_config("nixl+offloading", "P", "kv_producer/kv_consumer", "cuda")
    assert p == {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}


def test_cpu_servers_outlast_a_slow_first_step(monkeypatch) -> None:
    """A CPU instance gets a longer step timeout than vLLM's 300 s, unless the operator
    set one."""
    monkeypatch.delenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", raising=False)
    cpu = pair_mod.server_env(pair_mod.ServerOptions(device="cpu"), "D", 5600)
    assert cpu["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "1800"
    gpu = pair_mod.server_env(pair_mod.ServerOptions(device="cuda"), "D", 5600)
    assert "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS" not in gpu
    monkeypatch.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "60")
    assert pair_mod.server_env(pair_mod.ServerOptions(device="cpu"), "P", 5600)[
        "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "60"


def test_cpu_binding_splits_the_cores() -> None:
    assert pair_mod.cpu_binding("P", [0, 1]) == "0"
    assert pair_mod.cpu_binding("D", [0, 1]) == "1"
    assert pair_mod.cpu_binding("D", [0, 1, 2, 3, 4]) == "2,3,4"
    assert pair_mod.cpu_binding("P", [0]) == "auto"


def test_prompts_share_exactly_the_asked_prefix() -> None:
    opts = smoke.SmokeOptions(prompt_tokens=1400, shared_tokens=1300)
    a, b = smoke.make_prompts(2900, opts)
    assert len(a) == len(b) == 1400
    assert client.common_prefix(a, b) == 1300
    assert min(a + b) >= 2 and max(a + b) < 2900
    assert smoke.make_prompts(2900, opts) == (a, b)  # seeded


def test_tiny_model_cache_key_is_stable() -> None:
    assert spec_id(0, "qwen3_5") == spec_id(0, "qwen3_5")
    assert len({spec_id(0, "qwen3_5"), spec_id(1, "qwen3_5"), spec_id(0, "qwen3_next")}) == 3


def test_state_sensitive_variant_has_its_own_key_and_the_default_keeps_its_own() -> None:
    assert spec_id(0, "qwen3_next", "default") == spec_id(0, "qwen3_next")
    # the key the committed e2e reports were produced with
    assert spec_id(0, "qwen3_next") == "ca74a9f2c3f5"
    assert spec_id(0, "qwen3_next", "state-sensitive") != spec_id(0, "qwen3_next")


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "path", sorted(REPO.glob("reports/**/report.json")), ids=lambda p: p.parent.name
)
def test_committed_reports_read_and_write_back_unchanged(path: Path) -> None:
    text = path.read_text()
    out = report.E2EReport.from_json(json.loads(text)).to_json()
    # The same file, key for key and in order (report.write's format).
    assert json.dumps(out, indent=2) + "\n" == text


def test_a_failed_run_has_the_contract_fields_and_its_error() -> None:
    failed = report.RunResult.failed("stock", "nixl", "decode died", Path("/logs/stock-nixl"))
    # As e2e.run wrote it before the type: the same keys in the same order.
    assert list(failed.to_json().items()) == [
        ("build", "stock"), ("connector", "nixl"), ("error", "decode died"),
        ("logs", "/logs/stock-nixl"), ("requests", []), ("decode_prefix_cache_hits", None),
        ("decode_prefix_cache_queries", None), ("outputs_match_baseline", None),
    ]
    assert report.RunResult.from_json(failed.to_json()) == failed


def test_a_correctness_run_keeps_its_own_keys() -> None:
    run = {"build": "patched", "connector": "nixl", "requests": [], "decode_preemptions": 2,
           "outputs_match_baseline": True, "checks": {"preemption_forced": True},
           "ready_s": {}, "logs": "/l"}
    assert list(report.RunResult.from_json(run).to_json().items()) == list(run.items())


def test_a_partial_report_still_reads() -> None:
    data = {"runs": [{"requests": [{"prompt_tokens": 10}]}]}
    read = report.E2EReport.from_json(data)
    assert (read.pin, read.scenario, read.runs[0].build, read.runs[0].connector) == (
        "?", "?", "", "")
    assert read.to_json()["runs"] == data["runs"]
