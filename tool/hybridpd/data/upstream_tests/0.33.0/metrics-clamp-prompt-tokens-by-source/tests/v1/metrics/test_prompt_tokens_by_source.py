# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vllm:prompt_tokens_by_source never goes down.

Under concurrent external KV hits a prefill report can hold more cached than
prompt tokens, so the locally computed count comes out negative; a
Prometheus counter raises on a negative increment, which stopped the logger.
"""

import prometheus_client
import pytest

from vllm.config import ModelConfig, VllmConfig
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.prometheus import unregister_vllm_metrics
from vllm.v1.metrics.stats import IterationStats, PromptTokenStats

pytestmark = pytest.mark.cpu_test

TEST_MODEL = "facebook/opt-125m"


def _prompt_tokens_by_source(model_name: str, source: str) -> float | None:
    return prometheus_client.REGISTRY.get_sample_value(
        "vllm:prompt_tokens_by_source_total",
        {"source": source, "engine": "0", "model_name": model_name},
    )


def test_more_cached_than_prompt_tokens_is_not_counted_negative():
    config = VllmConfig(model_config=ModelConfig(model=TEST_MODEL))
    model_name = config.model_config.served_model_name
    stats = IterationStats()
    stats.prompt_token_stats = PromptTokenStats(
        computed=-16,
        local_cache_hit=16,
        external_kv_transfer=64,
        cached_tokens=80,
        total=64,
    )
    try:
        logger = PrometheusStatLogger(config)

        logger.record(scheduler_stats=None, iteration_stats=stats)

        assert _prompt_tokens_by_source(model_name, "local_compute") == 0
        assert _prompt_tokens_by_source(model_name, "local_cache_hit") == 16
        assert _prompt_tokens_by_source(model_name, "external_kv_transfer") == 64
    finally:
        unregister_vllm_metrics()
