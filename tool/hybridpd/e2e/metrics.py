"""Read a vLLM instance's ``/metrics`` with a real Prometheus text parser.

vLLM exports one sample per label set (``model_name``, ``engine``); an e2e run wants
one number per metric and instance, so a :class:`Snapshot` sums a sample name over
its label sets. Counters are exposed as ``<name>_total``; :meth:`Snapshot.value`
accepts the family name (``vllm:prefix_cache_hits``) and finds the ``_total``
sample, so callers write the names vLLM's docs and tests use.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field

#: The decode-side metrics an e2e request is measured by.
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
EXTERNAL_PREFIX_CACHE_HITS = "vllm:external_prefix_cache_hits"
EXTERNAL_PREFIX_CACHE_QUERIES = "vllm:external_prefix_cache_queries"
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"
NIXL_TRANSFERS = "vllm:nixl_bytes_transferred_count"
NIXL_DESCRIPTORS = "vllm:nixl_num_descriptors_sum"
PROMPT_TOKENS = "vllm:prompt_tokens"
NUM_PREEMPTIONS = "vllm:num_preemptions"
#: Speculative decoding: tokens drafted and accepted (by the target's verification).
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
#: An info gauge whose labels are the engine's resolved CacheConfig (block_size, ...).
CACHE_CONFIG_INFO = "vllm:cache_config_info"

OF_INTEREST = (
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    EXTERNAL_PREFIX_CACHE_HITS,
    EXTERNAL_PREFIX_CACHE_QUERIES,
    NIXL_BYTES,
    NIXL_TRANSFERS,
    NIXL_DESCRIPTORS,
    PROMPT_TOKENS,
    NUM_PREEMPTIONS,
)


@dataclass(frozen=True)
class Snapshot:
    """Sample name -> value summed over label sets; an ``*_info`` gauge's labels (its
    first label set) in ``info``."""

    samples: dict[str, float] = field(default_factory=dict)
    info: dict[str, dict[str, str]] = field(default_factory=dict)

    def value(self, name: str, default: float = 0.0) -> float:
        for candidate in (name, f"{name}_total"):
            if candidate in self.samples:
                return self.samples[candidate]
        return default

    def has(self, name: str) -> bool:
        return name in self.samples or f"{name}_total" in self.samples

    def delta(self, before: "Snapshot", name: str) -> float:
        return self.value(name) - before.value(name)

    def subset(self, names=OF_INTEREST) -> dict[str, float]:
        return {n: self.value(n) for n in names if self.has(n)}


def acceptance(snapshot: Snapshot, before: Snapshot | None = None) -> dict | None:
    """Drafted and accepted tokens (since ``before``) and their ratio, vLLM's own
    acceptance rate; None where the instance drafts nothing (no speculative decoding)."""
    if not snapshot.has(SPEC_DRAFT_TOKENS):
        return None
    base = before or Snapshot()
    drafted = int(snapshot.delta(base, SPEC_DRAFT_TOKENS))
    accepted = int(snapshot.delta(base, SPEC_ACCEPTED_TOKENS))
    return {"draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None}


def parse(text: str) -> Snapshot:
    """Parse Prometheus text exposition format (raises ValueError on bad input)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, float] = {}
    info: dict[str, dict[str, str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + float(sample.value)
            if sample.name.endswith("_info"):
                info.setdefault(sample.name, dict(sample.labels))
    return Snapshot(samples, info)


def info_label(snapshot: Snapshot, name: str, label: str) -> str | None:
    """Label ``label`` of info gauge ``name`` (None where either is missing)."""
    return snapshot.info.get(name, {}).get(label)


def scrape(base_url: str, timeout: float = 10.0) -> Snapshot:
    """GET ``<base_url>/metrics`` and parse it."""
    with urllib.request.urlopen(f"{base_url.rstrip('/')}/metrics", timeout=timeout) as resp:
        return parse(resp.read().decode("utf-8", errors="replace"))
