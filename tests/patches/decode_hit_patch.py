"""Which patch a decode-side hit case proves on the vLLM under test: one per test.

Up to v0.27 the series' role-gated mechanism (coordinator-consumer-skips-mamba-hit)
is what keeps a decode instance's local hit and the Mamba-state invariant. From v0.28
upstream does the same for connectors that declare
``supports_divergent_local_hybrid_hits`` (vllm#50344: NIXL alone), so that patch is
upstream there and the cases inside upstream's contract still prove it (they must pass
on stock). A case past that contract is red on stock: with NIXL alone (a hit of
prompt length - 1, which NIXL would load nothing for) it proves
divergent-hybrid-hit-resume-point; with DecodeBench configured beside NIXL or a
MultiConnector child other than NIXL serving, divergent-hybrid-hit-per-request,
which carries the rest.

Decided by release, not by probing vLLM's classes: the patched tree of an older pin may
carry the API, and a test must name the same patch on stock and patched.
"""

import pytest
import vllm
from packaging.version import Version

CONSUMER = "coordinator-consumer-skips-mamba-hit"
RESUME_POINT = "divergent-hybrid-hit-resume-point"
PER_REQUEST = "divergent-hybrid-hit-per-request"
#: The first release with upstream's per-request capability gate.
UPSTREAM_GATE = Version("0.28")


def proves(past_upstream: bool, nixl_alone: bool = False) -> pytest.MarkDecorator:
    """The ``patch`` mark of a case; ``past_upstream``: the case goes beyond what
    upstream's gate keeps (from v0.28 on, divergent-hybrid-hit-per-request's, or
    with ``nixl_alone`` divergent-hybrid-hit-resume-point's: v0.20.2 carries both
    in one patch, behind the consumer patch's mechanism)."""
    if past_upstream and Version(vllm.__version__) >= UPSTREAM_GATE:
        return pytest.mark.patch(RESUME_POINT if nixl_alone else PER_REQUEST)
    return pytest.mark.patch(CONSUMER)


def kinds(*params) -> list:
    """``kind`` parameters, each marked with the patch it proves: NIXL alone is inside
    upstream's contract, any other connector set past it. A ``pytest.param`` keeps its
    own marks."""
    out = []
    for p in params:
        values, marks, id_ = (p.values, p.marks, p.id) if hasattr(p, "values") else ((p,), (), None)
        out.append(pytest.param(*values, marks=[*marks, proves(values[0] != "nixl")], id=id_))
    return out
