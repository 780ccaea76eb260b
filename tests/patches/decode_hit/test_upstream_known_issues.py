"""vLLM bugs on hybrid models that this patch series does not fix (yet).

Each test reproduces the bug on a real Scheduler and is a strict xfail where the
release has it: it fails while the bug is there, on stock and patched builds alike,
and turns red (XPASS) the day a pin carries a fix, so the exclusion it justifies
elsewhere can be removed; on a release with the fix it is a plain regression test.
The last one that the series fixed, a synchronous load over a local hit on a full
pool, is mamba-align-admission-counts-sync-load's
(tests/patches/scheduler/test_sync_load_admission.py).
"""

import pytest

from ..mamba_state import handles_stale_async_output
from .test_mamba_state_property import _run

# Found by the property test (shrunk by Hypothesis): with async scheduling the
# engine core preempts a request while its previous batch is in flight, and the
# batch's token then drains against the reset counters.
ASYNC_PREEMPTION_WORKLOAD = {
    "kv_role": "kv_both", "num_blocks": 40, "engine": "async", "window": 32, "seed": 0,
    "requests": [
        {"prefix": 0, "prefix_blocks": 1, "suffix": 0, "remote": False,
         "load_fails": False, "max_tokens": 1, "arrival": 0},
        {"prefix": 0, "prefix_blocks": 1, "suffix": 0, "remote": False,
         "load_fails": False, "max_tokens": 1, "arrival": 0},
        {"prefix": 0, "prefix_blocks": 1, "suffix": 0, "remote": False,
         "load_fails": False, "max_tokens": 1, "arrival": 0},
        {"prefix": 0, "prefix_blocks": 1, "suffix": 0, "remote": False,
         "load_fails": False, "max_tokens": 6, "arrival": 2},
        {"prefix": 0, "prefix_blocks": 1, "suffix": 0, "remote": True,
         "load_fails": False, "max_tokens": 1, "arrival": 1},
        {"prefix": 0, "prefix_blocks": 4, "suffix": 0, "remote": True,
         "load_fails": False, "max_tokens": 2, "arrival": 3},
        {"prefix": 1, "prefix_blocks": 2, "suffix": 15, "remote": True,
         "load_fails": False, "max_tokens": 4, "arrival": 2},
        {"prefix": 0, "prefix_blocks": 1, "suffix": 15, "remote": False,
         "load_fails": False, "max_tokens": 3, "arrival": 2},
    ],
}


@pytest.mark.xfail(
    not handles_stale_async_output(),
    strict=True,
    raises=AssertionError,
    reason="vllm#48245: async scheduling + a preemption with a batch in flight "
    "underflows num_output_placeholders and the engine core dies",
)
def test_async_preemption_with_a_batch_in_flight_keeps_the_engine_alive():
    _run("nixl", ASYNC_PREEMPTION_WORKLOAD)
