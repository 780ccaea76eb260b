"""hfsnap: config-only hub cache snapshots (offline, fast).

The resolution test uses the real ``huggingface_hub``: from this interpreter when it has
it, otherwise from ``$HYBRIDPD_TEST_PYTHON`` (e.g. a test env built by hybridpd.proof.testenv);
it is skipped when neither has the library.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridpd.proof import hfsnap
from hybridpd.proof.upstream import MODELS


def test_every_model_the_gate_needs_has_data() -> None:
    assert set(MODELS) <= set(hfsnap.available_models())


@pytest.mark.parametrize("model", hfsnap.available_models())
def test_configs_are_plausible(model: str) -> None:
    cfg = json.loads(hfsnap.model_files(model)["config.json"])
    assert cfg["architectures"] and cfg["model_type"]
    text = cfg.get("text_config", cfg)
    assert cfg.get("vocab_size") or text.get("vocab_size")


def test_layout_and_revision(tmp_path: Path) -> None:
    hfsnap.write_snapshots(tmp_path, ["facebook/opt-125m"])
    repo = tmp_path / "hub" / "models--facebook--opt-125m"
    rev = (repo / "refs" / "main").read_text()
    assert len(rev) == 40 and int(rev, 16) >= 0
    snap = repo / "snapshots" / rev
    assert snap == hfsnap.snapshot_path(tmp_path, "facebook/opt-125m")
    assert json.loads((snap / "config.json").read_text())["hidden_size"] == 768
    # Idempotent: the same data gives the same single snapshot.
    hfsnap.write_snapshots(tmp_path, ["facebook/opt-125m"])
    assert [p.name for p in (repo / "snapshots").iterdir()] == [rev]


def test_revision_follows_content() -> None:
    a = hfsnap.snapshot_revision({"config.json": b"{}"})
    assert a == hfsnap.snapshot_revision({"config.json": b"{}"})
    assert a != hfsnap.snapshot_revision({"config.json": b"{ }"})
    assert a != hfsnap.snapshot_revision({"config.json": b"{}", "x.json": b""})


def test_unknown_model_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(KeyError):
        hfsnap.write_snapshots(tmp_path, ["facebook/opt-125m", "nobody/nothing"])
    assert not (tmp_path / "hub").exists()
    with pytest.raises(ValueError):
        hfsnap.model_dir_name("no-org")


def _python_with_hub() -> str | None:
    try:
        import huggingface_hub  # noqa: F401
        return sys.executable
    except ImportError:
        return os.environ.get("HYBRIDPD_TEST_PYTHON")


RESOLVE = """
import json, sys
from huggingface_hub import hf_hub_download, try_to_load_from_cache
out = {}
for m in sys.argv[1:]:
    p = hf_hub_download(m, "config.json")  # HF_HUB_OFFLINE=1: cache only
    out[m] = [json.load(open(p))["model_type"], try_to_load_from_cache(m, "config.json") == p]
try:
    from transformers import AutoConfig
    out["auto"] = AutoConfig.from_pretrained("Qwen/Qwen3-0.6B").num_hidden_layers
except ImportError:
    out["auto"] = 28
print(json.dumps(out))
"""


def test_huggingface_hub_resolves_offline(tmp_path: Path) -> None:
    python = _python_with_hub()
    if not python:
        pytest.skip("no interpreter with huggingface_hub (set HYBRIDPD_TEST_PYTHON)")
    hfsnap.write_snapshots(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([python, "-c", RESOLVE, *MODELS], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["facebook/opt-125m"] == ["opt", True]
    assert out["Qwen/Qwen3-Next-80B-A3B-Instruct"] == ["qwen3_next", True]
    assert out["auto"] == 28


QWEN35 = {"moe": "Qwen/Qwen3.5-35B-A3B", "dense": "Qwen/Qwen3.5-27B"}


def _text_config(model: str) -> dict:
    return json.loads(hfsnap.model_files(model)["config.json"])["text_config"]


@pytest.mark.parametrize("model", sorted(QWEN35.values()))
def test_qwen35_snapshots_are_hybrid_and_marked_reconstructed(model: str) -> None:
    text = _text_config(model)
    kinds = text["layer_types"]
    assert len(kinds) == text["num_hidden_layers"]
    assert kinds == (["linear_attention"] * 3 + ["full_attention"]) * (len(kinds) // 4)
    assert text["mamba_ssm_dtype"] == "float32"
    note = (hfsnap.DATA_DIR / "QWEN35-RECONSTRUCTED.md").read_text()
    assert hfsnap.model_dir_name(model) in note


def test_the_bench_model_is_the_moe_snapshot() -> None:
    """hybridpd bench's default shape and the shipped 35B-A3B config agree on every
    field the bench reads (one reading of the published model, not two)."""
    from hybridpd.bench.deployment import QWEN35_35B_A3B

    text = _text_config(QWEN35["moe"])
    shared = {k: v for k, v in QWEN35_35B_A3B.items() if k not in ("torch_dtype",)}
    assert {k: text.get(k) for k in shared} == shared
    assert text["dtype"] == QWEN35_35B_A3B["torch_dtype"]


def test_the_tiny_e2e_model_is_the_dense_snapshot_shrunk() -> None:
    """The tiny model keeps the real layer pattern and the per-layer structure that
    decides its KV cache groups; only counts and widths shrink."""
    from hybridpd.e2e.tinymodel import SPEC

    real = _text_config(QWEN35["dense"])
    period = real["layer_types"][:4]
    assert SPEC["layer_types"] == period
    assert SPEC["full_attention_interval"] == real["full_attention_interval"]
    assert SPEC["num_hidden_layers"] == len(period)
    for key in ("linear_conv_kernel_dim", "hidden_act", "tie_word_embeddings"):
        assert SPEC[key] == real[key], key
    assert SPEC["partial_rotary_factor"] == real["rope_parameters"]["partial_rotary_factor"]
    for key in ("hidden_size", "num_attention_heads", "head_dim", "linear_num_key_heads",
                "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"):
        assert 0 < SPEC[key] <= real[key], key
    # Gated-DeltaNet: value heads a multiple of key heads, as in the real model.
    assert SPEC["linear_num_value_heads"] % SPEC["linear_num_key_heads"] == 0
