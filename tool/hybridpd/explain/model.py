"""The model ``explain`` answers for: a config directory, or a hub id resolved offline
from the user's Hugging Face cache; a multimodal checkpoint without a tokenizer is
answered for its language model."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from hybridpd.errors import HybridpdError

#: Files whose presence means vLLM can build the checkpoint's tokenizer (and so its
#: multimodal processor).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class ModelError(HybridpdError):
    """The model cannot be found or read."""


def hub_cache() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path(
        os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    return Path(home) / "hub"


def resolve(model: str, cache: Path | None = None) -> Path:
    """The directory holding ``model``'s ``config.json``: ``model`` itself, or the
    snapshot ``refs/main`` names in the hub cache (never downloaded)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{model}: no config.json in that directory")
        return path.resolve()
    if model.count("/") != 1 or path.exists():
        raise ModelError(f"{model}: neither a directory nor a hub id (org/name)")
    repo = (cache or hub_cache()) / f"models--{model.replace('/', '--')}"
    ref = repo / "refs" / "main"
    if not ref.is_file():
        raise ModelError(f"{model}: not in the Hugging Face cache at {repo.parent} "
                         "(explain never downloads; pass the config's directory)")
    snap = repo / "snapshots" / ref.read_text().strip()
    if not (snap / "config.json").is_file():
        raise ModelError(f"{model}: the cached snapshot {snap} has no config.json")
    return snap


def language_model(config_dir: Path, work: Path) -> tuple[Path, str | None]:
    """``config_dir``, or, for a multimodal checkpoint vLLM cannot build a processor
    for (no tokenizer files), a directory with its language model's config (the
    ``text_config``, architecture ``...ForCausalLM``), and why.

    The KV cache belongs to the language model: the vision encoder holds none, so the
    groups, the connectors' checks and the scheduler are those of the full checkpoint
    (measured: the same groups for Qwen3.5-35B-A3B both ways on 0.32.0).
    """
    try:
        config = json.loads((config_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{config_dir / 'config.json'}: {exc}") from None
    archs = config.get("architectures") or []
    text = config.get("text_config")
    if (not archs or not archs[0].endswith("ForConditionalGeneration") or not text
            or any((config_dir / f).is_file() for f in TOKENIZER_FILES)):
        return config_dir, None
    arch = archs[0].replace("ForConditionalGeneration", "ForCausalLM")
    derived = {**text, "architectures": [arch]}
    body = json.dumps(derived, indent=2, sort_keys=True) + "\n"
    out = work / f"lm-{hashlib.sha256(body.encode()).hexdigest()[:12]}"
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "config.json").is_file() or (out / "config.json").read_text() != body:
        (out / "config.json").write_text(body)
    return out, (f"answered for its language model ({arch}, its text_config): vLLM "
                 f"builds {archs[0]}'s multimodal processor only with a tokenizer, and "
                 "the directory has none; the vision encoder holds no KV cache")
