"""Requests to a running pair: streamed greedy completions (:func:`complete`), the
proxy's prefill step on its own, dev-mode POSTs, settled ``/metrics`` scrapes, and the
warm-up that makes the first P->D transfer (the NIXL handshake) before anything is
measured.

Each scenario sends its requests through these; none of them starts or stops a server.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from hybridpd.e2e import metrics, proxy
from hybridpd.e2e.pair import Pair
from hybridpd.e2e.servers import E2EError, Processes, ProcessFailed
from hybridpd.progress import Log


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    ttft_ms: float
    latency_ms: float
    prompt_tokens: int
    # With ``logprobs=k``: per generated token its text, logprob and the top k.
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)


def _completion_body(prompt: list[int], max_tokens: int, extra: dict | None) -> dict:
    return {
        "model": "e2e",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        **(extra or {}),
    }


def complete(
    base_url: str,
    prompt: list[int],
    max_tokens: int,
    procs: Processes | None = None,
    timeout: float = 600.0,
    extra: dict | None = None,
    headers: dict | None = None,
) -> Completion:
    """A greedy streamed completion; TTFT is the first chunk carrying a token."""
    req = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(_completion_body(prompt, max_tokens, extra)).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    t0 = time.monotonic()
    ttft = None
    tokens: list[int] = []
    text = []
    usage = {}
    pieces: list[str] = []
    token_lps: list[float] = []
    top_lps: list[dict[str, float]] = []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    if ids and ttft is None:
                        ttft = time.monotonic() - t0
                    tokens.extend(ids)
                    text.append(choice.get("text") or "")
                    lp = choice.get("logprobs") or {}
                    pieces.extend(lp.get("tokens") or [])
                    token_lps.extend(lp.get("token_logprobs") or [])
                    top_lps.extend(lp.get("top_logprobs") or [])
    except (urllib.error.URLError, OSError, ValueError) as exc:
        if procs is not None:
            procs.check_soon()  # a dead server is the better explanation
        detail = exc.read().decode(errors="replace")[:300] if isinstance(exc, urllib.error.HTTPError) else ""
        raise E2EError(f"request to {base_url} failed: {exc} {detail}".strip()) from None
    latency = time.monotonic() - t0
    if len(tokens) != max_tokens:
        if procs is not None:
            procs.check_soon()
        raise E2EError(f"{base_url} returned {len(tokens)} tokens, expected {max_tokens}")
    return Completion(
        tokens,
        "".join(text),
        round((ttft or latency) * 1e3, 1),
        round(latency * 1e3, 1),
        int(usage.get("prompt_tokens") or len(prompt)),
        pieces,
        token_lps,
        [dict(t or {}) for t in top_lps],
    )


def prefill_for_remote_decode(
    prefill_url: str,
    prompt: list[int],
    request_id: str,
    procs: Processes | None = None,
    timeout: float = 600.0,
) -> dict:
    """The proxy's first step (:func:`proxy.prefill`) on its own: the prefill instance
    computes ``prompt``'s KV and keeps it for the decode instance to pull; returns the
    ``kv_transfer_params`` the decode request carries (the proxy's second step)."""
    upstream = proxy.Upstream(prefill_url, "prefill", timeout)
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    try:
        answer = proxy.prefill(upstream, "/v1/completions", _completion_body(prompt, 1, None),
                               headers)
    except proxy.UpstreamError as exc:
        if procs is not None:
            procs.check_soon()
        raise E2EError(f"prefill request to {prefill_url} failed: {exc}") from None
    params = answer.get("kv_transfer_params")
    if not params:
        raise E2EError(f"{prefill_url} answered a remote-decode prefill without kv_transfer_params")
    return params


def post(url: str, timeout: float = 60.0) -> None:
    req = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
    except (urllib.error.URLError, OSError) as exc:
        raise E2EError(f"POST {url} failed: {exc}") from None


def settled_scrape(base_url: str, previous: metrics.Snapshot | None = None,
                   wait: float = 1.0, tries: int = 10) -> metrics.Snapshot:
    """Scrape until two scrapes ``wait`` apart agree on the metrics of interest.

    vLLM publishes connector stats (NIXL bytes) on its logging cadence, not at the
    end of the request, so one scrape right after a response can miss them.
    """
    last = _scrape(base_url)
    for _ in range(tries):
        time.sleep(wait)
        now = _scrape(base_url)
        if now.subset() == last.subset():
            return now
        last = now
    return last


#: Seconds a /metrics read may take. An instance's first answer can take long: a CI run's
#: first scrape of an idle decode instance (LMCacheMP + NIXL) timed out after 10 s while
#: the prefill instance computed the references on the same two cores.
SCRAPE_TIMEOUT = 60.0


def _scrape(base_url: str) -> metrics.Snapshot:
    try:
        return metrics.scrape(base_url, timeout=SCRAPE_TIMEOUT)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise E2EError(f"cannot read {base_url}/metrics: {exc}") from None


#: Attempts of the handshake warm-up (see :func:`warm_up`).
WARM_UP_ATTEMPTS = 3


def warm_up(pair: Pair, procs: Processes, vocab_size: int, length: int, log: Log,
            attempts: int = WARM_UP_ATTEMPTS) -> int:
    """Make the first P->D transfer, and with it the NIXL handshake, before anything
    is measured; the attempts it took.

    vLLM gives the handshake's metadata request a fixed 5 s receive timeout
    (``_nixl_handshake``). On a loaded 2-core machine P's side-channel thread can miss
    it: the request is then aborted (0 tokens) and the next request handshakes again.
    Only this unrelated warm-up request (``length`` tokens, under one block, so
    nothing it caches is shared) is sent again; a request that is measured never is.
    A server that died is not retried (``complete`` reports it).
    """
    warm = [2 + (t * 7919) % (vocab_size - 2) for t in range(length)]
    for attempt in range(1, attempts + 1):
        try:
            complete(pair.front, warm, 2, procs)
            return attempt
        except ProcessFailed:
            raise
        except E2EError as exc:
            if attempt == attempts:
                raise E2EError(f"the warm-up request failed {attempts} times: {exc}") from None
            log(f"  warm-up request failed ({exc}); sending it again ({attempt + 1}/{attempts})")
            time.sleep(2)
    raise AssertionError("unreachable")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
