"""hybridpd.e2e.proxy against fake prefill and decode servers (no vLLM)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hybridpd.e2e import proxy

PARAMS_FROM_P = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_block_ids": [[1, 2]]}


class Fake(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        blob = json.dumps({"role": self.server.role, "path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(blob)))
        self.end_headers()
        self.wfile.write(blob)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((self.path, dict(self.headers), body))
        if self.server.fail:
            self.send_response(500)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"boom")
            return
        if self.server.role == "prefill":
            blob = json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS_FROM_P}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(blob)))
            self.end_headers()
            self.wfile.write(blob)
            return
        if body.get("stream"):  # chunked SSE, like vLLM
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(3):
                data = f"data: {json.dumps({'choices': [{'token_ids': [i], 'text': str(i)}]})}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            done = b"data: [DONE]\n\n"
            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
            return
        blob = json.dumps({"choices": [{"text": "decoded"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(blob)))
        self.end_headers()
        self.wfile.write(blob)


def _fake(role: str, fail: bool = False) -> ThreadingHTTPServer:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    srv.role, srv.seen, srv.fail = role, [], fail
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture
def setup(request):
    fail = getattr(request, "param", None)
    p, d = _fake("prefill", fail == "prefill"), _fake("decode", fail == "decode")
    px = proxy.serve(0, f"http://127.0.0.1:{p.server_port}", f"http://127.0.0.1:{d.server_port}")
    threading.Thread(target=px.serve_forever, daemon=True).start()
    yield p, d, f"http://127.0.0.1:{px.server_port}"
    for s in (px, p, d):
        s.shutdown()
        s.server_close()


def _post(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )


def test_prefill_then_decode_with_returned_params(setup) -> None:
    p, d, url = setup
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 16, "min_tokens": 4,
            "stream_options": {"include_usage": True}}
    with urllib.request.urlopen(_post(url + "/v1/completions", body)) as resp:
        assert json.loads(resp.read()) == {"choices": [{"text": "decoded"}]}
    (_, p_headers, p_body), = p.seen
    (_, d_headers, d_body), = d.seen
    assert p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert "min_tokens" not in p_body and "stream_options" not in p_body
    assert d_body == {**body, "kv_transfer_params": PARAMS_FROM_P}
    assert p_headers["X-Request-Id"] == d_headers["X-Request-Id"]


def test_stream_passes_through(setup) -> None:
    _, _, url = setup
    with urllib.request.urlopen(_post(url + "/v1/completions", {"prompt": "a", "stream": True})) as resp:
        events = [l for l in resp.read().decode().splitlines() if l.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    assert [json.loads(e[5:])["choices"][0]["token_ids"] for e in events[:-1]] == [[0], [1], [2]]


@pytest.mark.parametrize("setup", ["prefill", "decode"], indirect=True)
def test_upstream_failure_is_a_502_naming_it(setup, request) -> None:
    role = request.node.callspec.params["setup"]
    _, _, url = setup
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(_post(url + "/v1/completions", {"prompt": "a"}))
    assert info.value.code == 502
    assert json.loads(info.value.read())["upstream"] == role


def test_get_goes_to_decode_and_healthcheck_is_local(setup) -> None:
    _, _, url = setup
    with urllib.request.urlopen(url + "/v1/models") as resp:
        assert json.loads(resp.read()) == {"role": "decode", "path": "/v1/models"}
    with urllib.request.urlopen(url + "/healthcheck") as resp:
        assert json.loads(resp.read()) == {"status": "ok"}


def test_prefill_request_rules() -> None:
    req = proxy.prefill_request({"max_completion_tokens": 9, "stream": True, "min_completion_tokens": 2})
    assert req["max_completion_tokens"] == 1 and req["max_tokens"] == 1
    assert "min_completion_tokens" not in req and req["stream"] is False


def test_the_harness_runs_the_proxys_two_steps_apart(setup) -> None:
    """The correctness scenario's concurrent requests: every prefill, then every decode
    (so that they reach the decode instance together), with the proxy's own rules."""
    from hybridpd.e2e import client

    p, d, _ = setup
    p_url, d_url = (f"http://127.0.0.1:{s.server_port}" for s in (p, d))
    params = client.prefill_for_remote_decode(p_url, [1, 2, 3], "rid-1")
    assert params == PARAMS_FROM_P
    out = client.complete(d_url, [1, 2, 3], 3, extra={"kv_transfer_params": params},
                          headers={"X-Request-Id": "rid-1"})
    assert out.token_ids == [0, 1, 2]
    (_, p_headers, p_body), = p.seen
    (_, d_headers, d_body), = d.seen
    assert p_body == proxy.prefill_request({**d_body, "kv_transfer_params": None})
    assert p_body["kv_transfer_params"]["do_remote_decode"] is True and p_body["max_tokens"] == 1
    assert d_body["kv_transfer_params"] == PARAMS_FROM_P and d_body["stream"] is True
    assert p_headers["X-Request-Id"] == d_headers["X-Request-Id"] == "rid-1"


@pytest.mark.parametrize("setup", ["prefill"], indirect=True)
def test_a_failed_remote_decode_prefill_is_one_error(setup) -> None:
    from hybridpd.e2e import client
    from hybridpd.e2e.servers import E2EError

    p, _, _ = setup
    with pytest.raises(E2EError, match="prefill request to .* failed"):
        client.prefill_for_remote_decode(f"http://127.0.0.1:{p.server_port}", [1], "rid")
