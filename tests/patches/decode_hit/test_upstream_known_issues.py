"""vLLM bugs on hybrid models that this patch series does not fix (yet).

Each test reproduces the bug on a real Scheduler and is a strict xfail: it
fails while the bug is there, on stock and patched builds alike, and turns red
(XPASS) the day a pin carries a fix, so the exclusion it justifies elsewhere
can be removed. None at present: the last one, a synchronous load over a local
hit on a full pool, is fixed by mamba-align-admission-counts-sync-load
(tests/patches/scheduler/test_sync_load_admission.py).
"""
