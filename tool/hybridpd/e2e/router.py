"""vLLM's own prefill/decode router (``vllm-router``) as the e2e's front.

``vllm-router`` is the vLLM project's Rust router, a wheel on the package index. In PD
mode (``--vllm-pd-disaggregation``) it does what :mod:`.proxy` does for NIXL: the
request goes to the prefill instance with ``kv_transfer_params = {"do_remote_decode":
true, ...}``, ``max_tokens: 1`` and ``stream: false``; the ``kv_transfer_params`` the
prefill instance answers go with the original request to the decode instance, whose
answer (streamed or not) is passed through. The decode instance's connector set does
not matter to it: a MultiConnector's NIXL child takes the same parameters.

The router is installed into the e2e venvs hybridpd builds (:data:`REQUIREMENT`; its
dependencies are vLLM's own, unpinned, so pip changes nothing else there), started after
both instances answer, and stopped and reaped like every other process of the run
(:class:`.servers.Processes`). Its flags (:func:`command`) keep a run's measurements
honest: no retries (a request that failed is never sent again behind the client's
back), no circuit breaker (a failure is reported, not routed around), its metrics on a
port of its own, and the start-up wait bounded by the run's ``--ready-timeout``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from hybridpd import proc
from hybridpd.e2e.servers import E2EError
from hybridpd.progress import Log

#: The router the e2e runs: the version is part of what a report records.
VERSION = "0.1.17"
REQUIREMENT = f"vllm-router=={VERSION}"
#: Its console script in a venv's bin/.
SCRIPT = "vllm-router"
#: The router's own health endpoint: 200 once it serves (it starts serving only when
#: every worker answered its health check).
HEALTH = "/health"

FRONTS = ("router", "proxy")


def binary(python: Path) -> Path:
    """The ``vllm-router`` script beside ``python`` (a venv's bin/)."""
    return Path(python).parent / SCRIPT


def installed_version(python: Path) -> str | None:
    """The vllm-router version installed in the venv of ``python``, or None."""
    bin_dir = Path(python).parent
    for dist in bin_dir.parent.glob("lib/python*/site-packages/vllm_router-*.dist-info"):
        m = re.match(r"vllm_router-(.+)\.dist-info$", dist.name)
        if m and binary(python).exists():
            return m.group(1)
    return None


def install(python: Path, log: Log) -> None:
    """Install :data:`REQUIREMENT` into the venv of ``python`` unless it is there."""
    if installed_version(python) == VERSION:
        return
    log(f"installing {REQUIREMENT} into {Path(python).parent.parent}")
    done = proc.run([python, "-m", "pip", "install", "-q", REQUIREMENT])
    if not done.ok or installed_version(python) != VERSION:
        raise E2EError(f"pip could not install {REQUIREMENT} into {Path(python).parent.parent}: "
                       f"{done.tail()}")


def require(python: Path) -> None:
    """E2EError unless the venv of ``python`` (one the user gave) has the router."""
    found = installed_version(python)
    if found != VERSION:
        have = f"has vllm-router {found}" if found else "has no vllm-router"
        raise E2EError(f"{Path(python).parent.parent} {have}: pip install {REQUIREMENT} "
                       "there, or give --front proxy")


#: The decode policies of vllm-router 0.1.17 (``--decode-policy``). In PD mode none of
#: them reads the decode instances' KV events: ``--kv-event-source`` is refused there
#: ("only supported in regular mode"), ``--pd-kv-events`` feeds a kv_aware *prefill*
#: policy only, and a kv_aware decode policy scores load (pending plus active decode
#: requests, with optional session affinity), not cached blocks.
DECODE_POLICIES = ("random", "round_robin", "cache_aware", "kv_aware", "power_of_two",
                   "consistent_hash", "sticky_least_loaded")


def command(python: Path, port: int, metrics_port: int, prefill: str,
            decode: str | Sequence[str], ready_timeout: float,
            decode_policy: str | None = None) -> list[str]:
    """The router's command line in PD mode for one prefill instance and one decode
    instance, or several (``decode`` a sequence) picked by ``decode_policy`` (None: the
    router's default)."""
    decodes = [decode] if isinstance(decode, str) else list(decode)
    return [
        str(binary(python)),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--vllm-pd-disaggregation",
        "--prefill", prefill,
        *[arg for url in decodes for arg in ("--decode", url)],
        *(["--decode-policy", decode_policy] if decode_policy is not None else []),
        "--kv-connector", "nixl",
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(metrics_port),
        "--worker-startup-timeout-secs", str(int(ready_timeout)),
        "--worker-startup-check-interval", "1",
        "--request-timeout-secs", "3600",
        "--disable-retries",
        "--disable-circuit-breaker",
    ]
