"""Config-only Hugging Face hub cache snapshots for vLLM's unit tests.

vLLM's scheduler, KV-cache and connector unit tests build real ``VllmConfig`` objects
for named models (``facebook/opt-125m``, ``Qwen/Qwen3-0.6B``...). That reads the
model's ``config.json`` (and probes a few optional files) but never its weights or,
with ``skip_tokenizer_init`` or no request text, its tokenizer. On a machine that cannot
reach the hub we therefore pre-seed ``HF_HOME`` with the published ``config.json`` of
each model and run with ``HF_HUB_OFFLINE=1``.

The configs are data files: ``hybridpd/data/hf/<org>--<name>/config.json`` (plus any
other small file a test needs next to it), written from the models' public configs.

Layout written (what ``huggingface_hub`` resolves offline)::

    <hf_home>/hub/models--<org>--<name>/
        refs/main                      -> "<rev>" (no newline)
        snapshots/<rev>/config.json    plain files (no blobs/ symlinks: they survive copies)

Invariants:

- ``<rev>`` is a 40-hex digest of the data files (names and bytes), so the same data
  always gives the same snapshot and changed data gives a new one that ``refs/main``
  points to; stale snapshots of older data are left alone and never referenced.
- Writing is idempotent and only adds to ``hf_home``; it never deletes a real cache.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

#: Where the per-model data files live.
DATA_DIR = Path(__file__).parents[1] / "data" / "hf"


def model_dir_name(model_id: str) -> str:
    """``"org/name"`` -> ``"org--name"`` (the hub's own cache naming)."""
    if model_id.count("/") != 1:
        raise ValueError(f"model id must be 'org/name', got {model_id!r}")
    return model_id.replace("/", "--")


def available_models() -> list[str]:
    """Model ids for which data files exist, sorted."""
    return sorted(
        p.name.replace("--", "/", 1) for p in DATA_DIR.iterdir() if (p / "config.json").is_file()
    )


def model_files(model_id: str) -> dict[str, bytes]:
    """The files of one model's snapshot, by name. Raises KeyError for an unknown model."""
    src = DATA_DIR / model_dir_name(model_id)
    if not (src / "config.json").is_file():
        raise KeyError(f"no config data for {model_id} under {DATA_DIR}")
    return {p.name: p.read_bytes() for p in sorted(src.iterdir()) if p.is_file()}


def snapshot_revision(files: dict[str, bytes]) -> str:
    """A deterministic 40-hex revision for a set of files."""
    h = hashlib.sha1(b"hybridpd-hfsnap-v1\0")
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return h.hexdigest()


def snapshot_path(hf_home: Path, model_id: str) -> Path:
    """The snapshot directory ``write_snapshots`` creates for ``model_id``."""
    files = model_files(model_id)
    return (Path(hf_home) / "hub" / f"models--{model_dir_name(model_id)}" / "snapshots"
            / snapshot_revision(files))


def write_snapshots(hf_home: Path, models: Iterable[str] | None = None) -> None:
    """Write config-only snapshots of ``models`` (default: all available) under ``hf_home``.

    Raises KeyError if a model has no data files, before writing anything.
    """
    hf_home = Path(hf_home)
    ids = list(available_models() if models is None else models)
    contents = {m: model_files(m) for m in ids}  # fail before writing anything
    for model_id, files in contents.items():
        repo = hf_home / "hub" / f"models--{model_dir_name(model_id)}"
        rev = snapshot_revision(files)
        snap = repo / "snapshots" / rev
        snap.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            target = snap / name
            if not target.is_file() or target.read_bytes() != data:
                target.write_bytes(data)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(rev)
