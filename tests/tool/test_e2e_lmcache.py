"""The LMCache connector sets of the e2e: configs, servers, cases, option checks (no
vLLM, no lmcache: what a run would start and ask)."""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import pytest
from hybridpd.e2e import lmcache as lm
from hybridpd.e2e import run as run_mod
from hybridpd.e2e import scenarios as sc
from hybridpd.e2e.servers import E2EError


def _children(cfg: dict) -> list[str]:
    return [c["kv_connector"] for c in cfg["kv_connector_extra_config"]["connectors"]]


@pytest.mark.parametrize(
    ("connector", "order"),
    [("nixl+lmcache", ["NixlConnector", "LMCacheMPConnector"]),
     ("lmcache+nixl", ["LMCacheMPConnector", "NixlConnector"])],
)
def test_the_decode_instance_runs_both_children_in_the_named_order(connector, order) -> None:
    d = sc.kv_transfer_config(connector, "D", "kv_producer/kv_consumer", "cpu", 6555)
    assert d["kv_connector"] == "MultiConnector" and d["kv_role"] == "kv_consumer"
    assert _children(d) == order
    child = next(c for c in d["kv_connector_extra_config"]["connectors"]
                 if c["kv_connector"] == "LMCacheMPConnector")
    # kv_both: a consumer's LMCacheMPConnector would never store what D computes.
    assert child["kv_role"] == "kv_both"
    assert child["kv_connector_extra_config"] == {
        "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 6555}
    # The prefill instance stays on NIXL alone: its cold reference never hits LMCache.
    p = sc.kv_transfer_config(connector, "P", "kv_producer/kv_consumer", "cpu")
    assert p["kv_connector"] == "NixlConnector"


def test_a_decode_config_without_its_server_is_refused() -> None:
    with pytest.raises(E2EError, match="lmcache server port"):
        sc.kv_transfer_config("nixl+lmcache", "D", "kv_both", "cpu")


def test_the_server_command_is_lmcaches_own_on_loopback() -> None:
    cmd = lm.server_command(Path("/v/bin/python"), 6555, 6556)
    assert cmd[:2] == ["/v/bin/lmcache", "server"]
    args = dict(zip(cmd[2::2], cmd[3::2]))
    assert args["--host"] == "127.0.0.1" and args["--port"] == "6555"
    assert args["--http-port"] == "6556" and args["--chunk-size"] == "256"
    # lmcache exits when --l1-size-gb comes without --eviction-policy.
    assert "--l1-size-gb" in args and "--eviction-policy" in args
    assert "--separate-object-groups" not in cmd  # LMCache's default layout


def test_lmcache_cases_reset_the_decode_cache_before_each_load() -> None:
    rng = random.Random(0)
    cases = sc.lmcache_cases(lambda n: [rng.randrange(2, 100) for _ in range(n)], 16)
    by_kind = {c["lmcache"]: c for c in cases}
    assert [c.get("reset_decode", False) for c in cases] == [False, True, False, True]
    assert all(c["via"] == "decode" for c in cases)  # plain requests: LMCache serves them
    store, hit = cases[0]["prompt"], by_kind["hit"]["prompt"]
    assert hit[:256] == store[:256] and hit[256] != store[256]
    n1, n2 = cases[2]["prompt"], by_kind["null-slot"]["prompt"]
    assert len(n1) == 600 and n2[:300] == n1[:300] and len(n2) == 360


def test_correctness_adds_the_lmcache_cases_only_for_lmcache_sets() -> None:
    plain = sc.correctness_cases(1000, sc.CorrectnessOptions())
    with_lm = sc.correctness_cases(1000, sc.CorrectnessOptions(lmcache=True))
    assert not any("lmcache" in c for c in plain)
    assert [c["lmcache"] for c in with_lm if "lmcache" in c] == [
        "store", "hit", "store", "null-slot"]


def test_lmcache_sets_run_on_their_own(tmp_path: Path) -> None:
    from builders import standard_project

    _, series = standard_project(tmp_path)
    opts = dict(version="1.0", tiny=True, out_dir=tmp_path / "out")
    with pytest.raises(run_mod.E2EUsageError, match="e2e run of their own"):
        run_mod.run(series, run_mod.E2EOptions(
            connectors=("nixl", "nixl+lmcache"), **opts), [], print)
    with pytest.raises(run_mod.E2EUsageError, match="needs an LMCache connector set"):
        run_mod.run(series, run_mod.E2EOptions(lmcache_without=("x",), **opts), [], print)
    with pytest.raises(run_mod.E2EUsageError, match="CPU only"):
        run_mod.run(series, run_mod.E2EOptions(
            connectors=("nixl+lmcache",), device="cuda", **opts), [], print)


def test_the_lmcache_series_is_found_beside_the_vllm_one(tmp_path: Path) -> None:
    from builders import standard_project

    _, series = standard_project(tmp_path)
    with pytest.raises(E2EError, match="no LMCache series"):
        lm.lmcache_series(series)
    root = Path(__file__).resolve().parents[2]
    from hybridpd.series import load

    found = lm.lmcache_series(load(root / "patches" / "series.toml"))
    assert found.package == "lmcache"
    assert all(found.patch(p) for p in ("cpu-shm-vllm-state-binding", "null-recurrent-slot-not-stored"))


def test_the_server_starts_before_the_decode_instance_whose_record_names_its_shm(
    tmp_path: Path,
) -> None:
    """The decode instance registers its KV cache with its server at start-up, so the
    server is ready first; LMCache's segments of the decode instance's processes are
    in its record, so they are removed with it (also by a later reap)."""
    started: list[tuple[str, tuple]] = []

    class Procs:
        log_dir = tmp_path
        procs: dict = {}

        def start(self, name, cmd, env=None, cwd=None, shm=()):
            started.append((name, tuple(shm)))

        def wait_ready(self, urls, timeout, progress):
            assert [n for n, _ in started][-1] == ("lmcache" if "lmcache" in urls else "proxy")
            return {n: 1.0 for n in urls}

    class Env:
        python = Path("/v/bin/python")

    sc._start_pair_once(Procs(), Env(), "m", "lmcache+nixl", "kv_both",
                        sc.ServerOptions(), print)
    assert [n for n, _ in started] == ["lmcache", "prefill", "decode", "proxy"]
    assert dict(started)["decode"] == lm.SHM_GLOBS and dict(started)["prefill"] == ()


def test_the_decode_records_globs_name_lmcaches_segments(tmp_path: Path) -> None:
    """The record's globs must match LMCache's segments as a reap sees them: a relative
    glob matched nothing in /dev/shm, and a reap of a dead decode instance removed none."""
    from hybridpd.e2e import reap

    entry = reap.Entry.of("decode", os.getpid(), lm.SHM_GLOBS)
    segment = Path(f"/dev/shm/lmcache_kv_{os.getpid()}_hybridpd-test")
    segment.write_bytes(b"kv")
    try:
        assert segment in entry.shm_paths()
    finally:
        segment.unlink(missing_ok=True)


# A stand-in decode instance: its worker (a child in its group) creates a segment named
# as LMCache's CPU path names them and exits on SIGTERM without removing it, as vLLM's
# does; a stand-in lmcache server that, on SIGTERM, removes the segments of exited
# workers (patched) or leaves them (stock).
DECODE = """
import os, time
if os.fork() == 0:
    open(f"/dev/shm/lmcache_kv_{os.getpid()}_0", "w").write("kv")
while True:
    time.sleep(1)
"""
LMCACHE = """
import glob, os, signal, sys, time
held = {}  # the server maps every segment registered with it
def stop(*_):
    if sys.argv[1] == "patched":
        for path in glob.glob(f"/dev/shm/lmcache_kv_*_0"):
            try:  # gone, or a zombie nobody reaped (what LMCache's check reads)
                state = open(f"/proc/{path.split('_')[2]}/stat").read().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                state = "Z"
            if state == "Z":
                os.unlink(path)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    for path in glob.glob("/dev/shm/lmcache_kv_*_0"):
        held.setdefault(path, open(path))
    time.sleep(0.02)
"""


@pytest.mark.parametrize("server", ["patched", "stock"])
def test_the_segment_check_runs_before_hybridpd_removes_them(
    tmp_path: Path, server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run stops the decode instance, then its lmcache server, and only then counts
    (a plain stop of the server removed the segments it mapped as its own, so every
    server seemed to remove them); either way, the run's close removes them."""
    from hybridpd.e2e.servers import Processes

    monkeypatch.setattr(lm, "SEGMENTS_TIMEOUT", 1.0)  # the stock server never removes them
    with Processes(tmp_path) as procs:
        procs.start("lmcache", [sys.executable, "-c", LMCACHE, server])
        procs.start("decode", [sys.executable, "-c", DECODE], shm=lm.SHM_GLOBS)
        worker_segments = lambda: procs.shm_files("decode")  # noqa: E731
        deadline = time.monotonic() + 20
        while not worker_segments() and time.monotonic() < deadline:
            time.sleep(0.05)
        made = worker_segments()
        assert made, "the stand-in worker made no segment"
        lmcache_pid = procs.procs["lmcache"].pid
        while not any("lmcache_kv_" in os.readlink(f"/proc/{lmcache_pid}/fd/{fd}")
                      for fd in os.listdir(f"/proc/{lmcache_pid}/fd")):
            assert time.monotonic() < deadline, "the stand-in server mapped no segment"
            time.sleep(0.02)
        found = lm.segments_after_stop(procs, lambda line: None)
    assert found["decode_shm_segments_while_serving"] == 1
    assert found["check"] is (server == "patched")
    assert found["decode_shm_segments_left_by_lmcache"] == (
        [] if server == "patched" else sorted(p.name for p in made))
    assert not any(p.exists() for p in made), "the run's close left a segment"
