"""A small prefill/decode proxy, modeled on vLLM's nixl_integration/toy_proxy_server.py.

For each ``POST /v1/completions`` or ``/v1/chat/completions``:

1. the request goes to the prefill instance with ``kv_transfer_params =
   {"do_remote_decode": true, ...}``, ``stream: false`` and ``max_tokens: 1`` (the
   prefill computes the prompt's KV and keeps it for the decode side to pull);
2. the original request goes to the decode instance with the ``kv_transfer_params``
   the prefill answered (they carry ``do_remote_prefill: true`` and where to pull
   from); the decode instance's response, streamed or not, is passed through as is.

Both requests carry the same ``X-Request-Id``. ``GET /healthcheck`` is the
proxy's own; other ``GET`` requests (``/health``, ``/v1/models``, ``/metrics``) go to
the decode instance. A failing upstream becomes
a 502 whose JSON names it ("prefill" or "decode").

Standard library only: it runs under any Python (the e2e venv's, or the tests'), one
thread per connection, HTTP/1.1 keep-alive, chunked pass-through for streams.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

PD_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


class UpstreamError(Exception):
    def __init__(self, role: str, status: int, body: bytes):
        self.role, self.status, self.body = role, status, body
        super().__init__(f"{role} answered {status}: {body[:300]!r}")


def prefill_request(body: dict) -> dict:
    """The request sent to the prefill instance (toy_proxy_server's rules)."""
    req = dict(body)
    req["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    req["stream"] = False
    req["max_tokens"] = 1
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        req.pop(key, None)
    return req


def decode_request(body: dict, prefill_response: dict) -> dict:
    req = dict(body)
    params = prefill_response.get("kv_transfer_params")
    if params:
        req["kv_transfer_params"] = params
    return req


def prefill(upstream: "Upstream", path: str, body: dict, headers: dict) -> dict:
    """Step 1: ``body`` (the client's request) sent to the prefill instance with
    :func:`prefill_request`'s rules; returns its JSON answer (``kv_transfer_params``
    for step 2). UpstreamError if it fails."""
    conn = upstream.connect()
    try:
        conn.request("POST", path, json.dumps(prefill_request(body)).encode(), headers)
        resp = conn.getresponse()
        data = resp.read()
    except OSError as exc:
        raise UpstreamError(upstream.role, 0, str(exc).encode()) from None
    finally:
        conn.close()
    if resp.status >= 400:
        raise UpstreamError(upstream.role, resp.status, data)
    try:
        return json.loads(data)
    except ValueError:
        raise UpstreamError(upstream.role, resp.status, b"answer is not JSON: " + data[:200])


class Upstream:
    def __init__(self, url: str, role: str, timeout: float):
        parts = urlsplit(url if "//" in url else f"http://{url}")
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.role, self.timeout = role, timeout

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)


class ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr, prefill: Upstream, decode: Upstream, verbose: bool = False):
        super().__init__(addr, ProxyHandler)
        self.prefill, self.decode, self.verbose = prefill, decode, verbose
        self.stats_lock = threading.Lock()
        self.served = 0
        self.failed = 0


class ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ProxyServer

    def log_message(self, fmt, *args) -> None:
        if self.server.verbose:
            sys.stderr.write("proxy: " + (fmt % args) + "\n")

    # ------------------------------------------------------------------ helpers

    def _send_json(self, status: int, data: dict) -> None:
        blob = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(blob)))
        self.end_headers()
        self.wfile.write(blob)

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _forward_headers(self, request_id: str) -> dict:
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        if self.headers.get("Authorization"):
            headers["Authorization"] = self.headers["Authorization"]
        return headers

    def _relay(self, resp: http.client.HTTPResponse) -> None:
        """Send ``resp`` to the client, streaming it when it has no length."""
        self.send_response(resp.status)
        for key, value in resp.getheaders():
            if key.lower() not in HOP_HEADERS:
                self.send_header(key, value)
        length = resp.getheader("Content-Length")
        if length is not None:
            self.send_header("Content-Length", length)
            self.end_headers()
            self.wfile.write(resp.read())
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        while True:
            chunk = resp.read1(65536)
            if not chunk:
                break
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    # ------------------------------------------------------------------ verbs

    def do_GET(self) -> None:
        if self.path == "/healthcheck":  # the proxy itself, for readiness polls
            self._send_json(200, {"status": "ok"})
            return
        conn = self.server.decode.connect()
        try:
            conn.request("GET", self.path)
            self._relay(conn.getresponse())
        except OSError as exc:
            self._send_json(502, {"error": f"decode unreachable: {exc}", "upstream": "decode"})
        finally:
            conn.close()

    def do_POST(self) -> None:
        raw = self._read_body()
        if self.path not in PD_ENDPOINTS:
            self._send_json(404, {"error": f"the proxy serves {', '.join(PD_ENDPOINTS)}"})
            return
        try:
            body = json.loads(raw or b"{}")
        except ValueError as exc:
            self._send_json(400, {"error": f"request body is not JSON: {exc}"})
            return
        request_id = self.headers.get("X-Request-Id") or str(uuid.uuid4())
        headers = self._forward_headers(request_id)
        t0 = time.monotonic()
        try:
            prefill = self._prefill(body, headers)
        except UpstreamError as exc:
            self._fail(exc)
            return
        t1 = time.monotonic()
        conn = self.server.decode.connect()
        try:
            conn.request(
                "POST", self.path, json.dumps(decode_request(body, prefill)).encode(), headers
            )
            resp = conn.getresponse()
            if resp.status >= 400:
                self._fail(UpstreamError("decode", resp.status, resp.read()))
                return
            self._relay(resp)
        except OSError as exc:
            self._fail(UpstreamError("decode", 0, str(exc).encode()))
            return
        finally:
            conn.close()
        with self.server.stats_lock:
            self.server.served += 1
        self.log_message(
            "%s %s prefill %.0f ms, total %.0f ms",
            request_id, self.path, (t1 - t0) * 1e3, (time.monotonic() - t0) * 1e3,
        )

    def _prefill(self, body: dict, headers: dict) -> dict:
        return prefill(self.server.prefill, self.path, body, headers)

    def _fail(self, exc: UpstreamError) -> None:
        with self.server.stats_lock:
            self.server.failed += 1
        sys.stderr.write(f"proxy: {exc}\n")
        try:
            self._send_json(
                502,
                {
                    "error": str(exc),
                    "upstream": exc.role,
                    "upstream_status": exc.status,
                },
            )
        except OSError:
            pass


def serve(
    port: int,
    prefill_url: str,
    decode_url: str,
    host: str = "127.0.0.1",
    timeout: float = 3600.0,
    verbose: bool = False,
) -> ProxyServer:
    """A started-but-not-serving proxy (call ``serve_forever``; tests use a thread)."""
    return ProxyServer(
        (host, port),
        Upstream(prefill_url, "prefill", timeout),
        Upstream(decode_url, "decode", timeout),
        verbose=verbose,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="hybridpd prefill/decode proxy")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", required=True, help="http://host:port of the prefill instance")
    ap.add_argument("--decode", required=True, help="http://host:port of the decode instance")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    server = serve(args.port, args.prefill, args.decode, args.host, args.timeout, args.verbose)
    sys.stderr.write(f"proxy: listening on {args.host}:{args.port}\n")
    sys.stderr.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
