"""The model ``explain`` answers for: a config directory, or a hub id resolved offline
from the user's Hugging Face cache; a multimodal checkpoint without a tokenizer is
answered for its language model."""

from __future__ import annotations

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


def text_only(config_dir: Path) -> str | None:
    """Why ``explain`` answers for the language model only, or None.

    vLLM builds a multimodal checkpoint's processor (the scheduler's encoder budget
    needs it) only with a tokenizer; a config-only directory has none. The KV cache
    belongs to the language model (the vision encoder holds none), so the driver runs
    vLLM's text-only mode (``--language-model-only``) and builds the scheduler without
    the embeddings input a KV consumer otherwise accepts: the groups, the connectors'
    checks and the scheduler's KV cache handling are the checkpoint's.
    """
    try:
        config = json.loads((config_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{config_dir / 'config.json'}: {exc}") from None
    archs = config.get("architectures") or []
    if (not archs or not archs[0].endswith("ForConditionalGeneration")
            or any((config_dir / f).is_file() for f in TOKENIZER_FILES)):
        return None
    return (f"answered for {archs[0]}'s language model (--language-model-only): vLLM "
            "builds its multimodal processor only with a tokenizer, and the directory "
            "has none; the vision encoder holds no KV cache")
