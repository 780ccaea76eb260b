"""vllm-router as the e2e's front (hybridpd.e2e.router): its command line, its install
into the e2e venvs, and a stand-in ``vllm-router`` started, health-checked and reaped
like every other process of a run (no network, no Rust router)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from hybridpd import proc
from hybridpd.e2e import router
from hybridpd.e2e.servers import E2EError, Processes, free_port, group_members

pytestmark = pytest.mark.usefixtures("isolated")


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_the_command_is_pd_mode_without_retries_or_circuit_breaker() -> None:
    cmd = router.command(Path("/v/bin/python"), 8000, 8001, "http://127.0.0.1:1",
                         "http://127.0.0.1:2", 900.0)
    assert cmd[0] == "/v/bin/vllm-router"
    assert "--vllm-pd-disaggregation" in cmd
    assert (_flag(cmd, "--prefill"), _flag(cmd, "--decode")) == (
        "http://127.0.0.1:1", "http://127.0.0.1:2")
    assert _flag(cmd, "--kv-connector") == "nixl"
    assert (_flag(cmd, "--host"), _flag(cmd, "--port")) == ("127.0.0.1", "8000")
    # Its metrics on a port of the run's (its default, 29000, may be taken).
    assert _flag(cmd, "--prometheus-port") == "8001"
    assert _flag(cmd, "--worker-startup-timeout-secs") == "900"
    # A failed request is reported, never sent again or routed around.
    assert "--disable-retries" in cmd and "--disable-circuit-breaker" in cmd


def _venv(tmp_path: Path, version: str | None) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    site = venv / "lib" / "python3.12" / "site-packages"
    site.mkdir(parents=True, exist_ok=True)
    if version is not None:
        (site / f"vllm_router-{version}.dist-info").mkdir()
        (venv / "bin" / router.SCRIPT).write_text("#!/bin/sh\n")
    return venv / "bin" / "python"


def test_install_runs_pip_only_where_the_pinned_router_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    python = _venv(tmp_path, router.VERSION)
    monkeypatch.setattr(proc, "run", lambda *a, **k: pytest.fail("must not run pip"))
    router.install(python, print)  # there already

    python = _venv(tmp_path / "other", None)
    ran = []

    def pip(cmd, **kw):
        ran.append([str(c) for c in cmd])
        _venv(tmp_path / "other", router.VERSION)
        return proc.Completed(tuple(cmd), 0)

    monkeypatch.setattr(proc, "run", pip)
    router.install(python, print)
    assert ran == [[str(python), "-m", "pip", "install", "-q", router.REQUIREMENT]]


def test_a_failed_install_and_a_given_venv_without_it_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    python = _venv(tmp_path, None)
    monkeypatch.setattr(proc, "run", lambda cmd, **kw: proc.Completed(tuple(cmd), 1, "", "no index"))
    with pytest.raises(E2EError, match=rf"^pip could not install {router.REQUIREMENT} into "):
        router.install(python, print)
    with pytest.raises(E2EError) as info:
        router.require(python)
    assert str(info.value) == (f"{tmp_path / 'venv'} has no vllm-router: pip install "
                               f"{router.REQUIREMENT} there, or give --front proxy")
    old = _venv(tmp_path / "old", "0.1.9")
    with pytest.raises(E2EError, match="has vllm-router 0.1.9: pip install"):
        router.require(old)
    router.require(_venv(tmp_path / "pinned", router.VERSION))


#: A stand-in ``vllm-router``: answers /health on --port once started, logs its argv.
FAKE_ROUTER = textwrap.dedent(
    """\
    #!{python}
    import sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    argv = sys.argv[1:]
    port = int(argv[argv.index("--port") + 1])
    print("router argv:", " ".join(argv), flush=True)

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def test_a_stand_in_router_is_health_checked_logged_and_reaped(tmp_path: Path) -> None:
    import sys

    python = _venv(tmp_path, router.VERSION)
    script = router.binary(python)
    script.write_text(FAKE_ROUTER.format(python=sys.executable))
    script.chmod(0o755)
    port = free_port()
    cmd = router.command(python, port, free_port(), "http://127.0.0.1:1",
                         "http://127.0.0.1:2", 30)
    logs = tmp_path / "run"
    with Processes(logs, grace=2) as procs:
        started = procs.start("router", cmd, cwd=logs)
        ready = procs.wait_ready({"router": f"http://127.0.0.1:{port}{router.HEALTH}"}, 30)
        assert set(ready) == {"router"}
        assert "router" in (logs / "processes.json").read_text()
    assert group_members(started.pid) == []
    assert "--vllm-pd-disaggregation" in (logs / "router.log").read_text()
