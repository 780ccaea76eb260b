"""The Prometheus logger survives an inconsistent prefill report.

Patch: metrics-clamp-prompt-tokens-by-source.
"""

import pytest
from prometheus_client import REGISTRY

from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.stats import IterationStats, PromptTokenStats

from ..builders import vllm_config

PATCH = "metrics-clamp-prompt-tokens-by-source"


def _prompt_tokens_by_source(model_name: str, source: str) -> float:
    value = REGISTRY.get_sample_value(
        "vllm:prompt_tokens_by_source_total",
        {"source": source, "engine": "0", "model_name": model_name},
    )
    assert value is not None
    return value


@pytest.mark.patch(PATCH)
def test_more_cached_than_prompt_tokens_does_not_stop_the_logger():
    config = vllm_config(kv_role=None)
    logger = PrometheusStatLogger(config)
    model_name = config.model_config.served_model_name

    # The frontend sums per-request prefill reports that crossed a process
    # boundary. Under concurrent external hits they were seen to hold more
    # cached than prompt tokens (vllm-project/vllm#38261): "local_compute"
    # comes out negative.
    stats = IterationStats()
    stats.prompt_token_stats = PromptTokenStats(
        computed=-16,
        local_cache_hit=16,
        external_kv_transfer=64,
        cached_tokens=80,
        total=64,
    )

    logger.record(scheduler_stats=None, iteration_stats=stats)

    assert _prompt_tokens_by_source(model_name, "local_compute") == 0
    assert _prompt_tokens_by_source(model_name, "local_cache_hit") == 16
    assert _prompt_tokens_by_source(model_name, "external_kv_transfer") == 64
