"""A divergent hit whose sliding-window group lags, served by a hash store.

The long sweep of test_mamba_state_property.py found these on the patched
v0.32.0 and v0.33.0 trees (stock takes no divergent hit for these sets): in
a small pool a sliding-window group's blocks inside the window are evicted
while full attention's stay, so the per-group hit leaves that group shorter
than the hit. NIXL writes every unhashed block it is handed (the group's
window tail); the OffloadingConnector and LMCacheMP load only the blocks past
the hit, and the request resumed with window blocks nobody wrote. The series
keeps the hit every group agrees on there (divergent-hybrid-hit-per-request:
a connector without upstream's capability gets no divergent hit when an
attention group lags). Each workload is the one the sweep shrank.

These name no patch: they hold the patched build to stock's behaviour (no
request resumes without its own KV inside the window), which stock keeps by
never taking the divergent hit.
"""

import pytest

from ..hash_stores import lmcache_mp_unavailable
from .test_mamba_state_property import MULTI_MODULE_MTP, _run


def _req(prefix, blocks, suffix=0, remote=False, max_tokens=1, arrival=0):
    return {"prefix": prefix, "prefix_blocks": blocks, "suffix": suffix,
            "remote": remote, "load_fails": False, "max_tokens": max_tokens,
            "arrival": arrival}


#: The 4-block request's window group lost block 1 to the 40-block pool; the
#: OffloadingConnector loads block 2 over a 32-token divergent hit.
OFFLOADING_WORKLOAD = {
    "kv_role": "kv_both", "num_blocks": 40, "engine": "mtp3", "window": 32,
    "seed": 0, "stored": [],
    "requests": [
        *[_req(0, 1)] * 3, _req(0, 1, arrival=1),
        _req(0, 3, suffix=1, remote=True, arrival=1), _req(0, 4, max_tokens=2),
    ],
}

#: LMCache MP loads block 1 of the second prefix over a 16-token divergent hit
#: whose window group lost block 0.
LMCACHE_WORKLOAD = {
    "kv_role": "kv_both", "num_blocks": 40, "engine": "mtp2", "window": 32,
    "seed": 0, "stored": [],
    "requests": [
        _req(0, 1), _req(1, 6), _req(0, 3), _req(1, 2, suffix=1, remote=True, arrival=3),
    ],
}


@pytest.mark.vllm_versions(">=0.32")
@pytest.mark.skipif(not MULTI_MODULE_MTP, reason="the release has no multi-module MTP")
@pytest.mark.parametrize("kind,workload", [
    pytest.param("offloading+nixl", OFFLOADING_WORKLOAD, id="offloading+nixl"),
    pytest.param("lmcachemp+nixl", LMCACHE_WORKLOAD, id="lmcachemp+nixl"),
])
def test_a_hash_store_load_over_a_lagging_window_group_resumes_on_its_own_kv(
    kind, workload
):
    if "lmcachemp" in kind and (reason := lmcache_mp_unavailable()) is not None:
        pytest.skip(reason)
    _run(kind, workload)
