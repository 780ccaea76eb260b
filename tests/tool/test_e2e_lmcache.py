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
from hybridpd.e2e import client, correctness
from hybridpd.e2e import pair as pair_mod
from hybridpd.e2e.servers import E2EError


def _children(cfg: dict) -> list[str]:
    return [c["kv_connector"] for c in cfg["kv_connector_extra_config"]["connectors"]]


@pytest.mark.parametrize(
    ("connector", "order"),
    [("nixl+lmcache", ["NixlConnector", "LMCacheMPConnector"]),
     ("lmcache+nixl", ["LMCacheMPConnector", "NixlConnector"])],
)
def test_the_decode_instance_runs_both_children_in_the_named_order(connector, order) -> None:
    d = pair_mod.kv_transfer_config(connector, "D", "kv_producer/kv_consumer", "cpu", 6555)
    assert d["kv_connector"] == "MultiConnector" and d["kv_role"] == "kv_consumer"
    assert _children(d) == order
    child = next(c for c in d["kv_connector_extra_config"]["connectors"]
                 if c["kv_connector"] == "LMCacheMPConnector")
    # kv_both: a consumer's LMCacheMPConnector would never store what D computes.
    assert child["kv_role"] == "kv_both"
    assert child["kv_connector_extra_config"] == {
        "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 6555,
        "lmcache.mp.heartbeat_interval": 30.0}
    # The prefill instance stays on NIXL alone: its cold reference never hits LMCache.
    p = pair_mod.kv_transfer_config(connector, "P", "kv_producer/kv_consumer", "cpu")
    assert p["kv_connector"] == "NixlConnector"


def test_a_decode_config_without_its_server_is_refused() -> None:
    with pytest.raises(E2EError, match="lmcache server port"):
        pair_mod.kv_transfer_config("nixl+lmcache", "D", "kv_both", "cpu")


def test_the_server_command_is_lmcaches_own_on_loopback() -> None:
    cmd = lm.server_command(Path("/v/bin/python"), 6555, 6556)
    assert cmd[:2] == ["/v/bin/lmcache", "server"]
    args = dict(zip(cmd[2::2], cmd[3::2]))
    assert args["--host"] == "127.0.0.1" and args["--port"] == "6555"
    assert args["--http-port"] == "6556" and args["--chunk-size"] == "256"
    # lmcache exits when --l1-size-gb comes without --eviction-policy.
    assert "--l1-size-gb" in args and "--eviction-policy" in args
    assert "--separate-object-groups" not in cmd  # LMCache's default layout


def test_on_a_simulated_host_both_of_the_servers_listeners_bind_its_address() -> None:
    # The readiness check polls the HTTP listener from the root namespace: on
    # loopback (lmcache's default) it is unreachable there.
    cmd = lm.server_command(Path("/v/bin/python"), 6555, 6556, host="10.9.8.3")
    args = dict(zip(cmd[2::2], cmd[3::2]))
    assert args["--host"] == args["--http-host"] == "10.9.8.3"


def test_lmcache_cases_reset_the_decode_cache_before_each_load() -> None:
    rng = random.Random(0)
    cases = correctness.lmcache_cases(lambda n: [rng.randrange(2, 100) for _ in range(n)], 16)
    assert [c.get("reset_decode", False) for c in cases] == [False, True] * 4
    assert all(c["via"] == "decode" for c in cases)  # plain requests: LMCache serves them
    pairs = [cases[i:i + 2] for i in range(0, len(cases), 2)]
    assert [[c["lmcache"] for c in pair] for pair in pairs] == (
        [["store", "hit"]] * correctness.LMCACHE_HIT_ATTEMPTS + [["store", "null-slot"]])
    # Each L attempt is a new prompt whose second request shares its first chunk only.
    for store, hit in pairs[:-1]:
        assert hit["prompt"][:256] == store["prompt"][:256]
        assert hit["prompt"][256] != store["prompt"][256]
    firsts = {tuple(store["prompt"][:256]) for store, _ in pairs[:-1]}
    assert len(firsts) == correctness.LMCACHE_HIT_ATTEMPTS
    assert [c["attempt"] for c in cases[:-2]] == [1, 1, 2, 2, 3, 3]
    assert len({c["label"] for c in cases}) == len(cases)  # rows are found by label
    n1, n2 = pairs[-1][0]["prompt"], pairs[-1][1]["prompt"]
    assert len(n1) == 600 and n2[:300] == n1[:300] and len(n2) == 360


def test_with_mtp_l1_puts_vllms_checkpoint_at_the_end_of_the_chunk_l2_takes() -> None:
    # vLLM's rule (use_eagle_block_drop): the step's interior checkpoint is the state
    # at floor(s / B) * B - B, kept in column cdiv(s, B) - 2; LMCache serves chunk 0
    # (256 tokens) only with the state at 256 in its last column.
    for block in (128, 256):
        s = correctness.l1_tokens(correctness.CorrectnessOptions(block_size=block,
                                                                 speculative=True))
        assert s // block * block - block == 256
        assert (-(-s // block) - 1) * block == 256  # the column's end
    # The blocks vLLM serves decide it: 512 for its blocks of 256 with a --block-size 128.
    assert correctness.l1_tokens(correctness.CorrectnessOptions(
        speculative=True, served_block_size=256)) == 512
    # Without speculative decoding the state at the last boundary of the step (256).
    assert correctness.l1_tokens(correctness.CorrectnessOptions()) == 300
    cases = correctness.correctness_cases(1000, correctness.CorrectnessOptions(
        lmcache=True, speculative=True))
    assert [len(c["prompt"]) for c in cases if c.get("lmcache") == "store"] == [384] * 3 + [600]


def test_correctness_adds_the_lmcache_cases_only_for_lmcache_sets() -> None:
    plain = correctness.correctness_cases(1000, correctness.CorrectnessOptions())
    with_lm = correctness.correctness_cases(1000, correctness.CorrectnessOptions(lmcache=True))
    assert not any("lmcache" in c for c in plain)
    assert [c["lmcache"] for c in with_lm if "lmcache" in c] == (
        ["store", "hit"] * correctness.LMCACHE_HIT_ATTEMPTS + ["store", "null-slot"])


def test_the_adapters_trouble_is_read_from_both_logs(tmp_path: Path) -> None:
    decode, server = tmp_path / "decode.log", tmp_path / "lmcache.log"
    decode.write_text("\x1b[33mLMCache WARNING:\x1b[0m LMCache server is unhealthy — old\n")
    trouble = lm.Trouble(decode, server)  # what was logged before it is not taken
    with decode.open("a") as f:
        f.write("INFO: 127.0.0.1 - POST /v1/completions 200 OK\n"
                "\x1b[33mLMCache WARNING:\x1b[0m LMCache server is unhealthy — entering "
                "degraded mode (x.py:617)\nLMCache WARNING: Reaped GPU ins")
    server.write_text("LMCache INFO: Stored 256 tokens in 0.002 seconds\n")
    assert trouble.take() == [
        "decode.log: LMCache WARNING: LMCache server is unhealthy — entering degraded "
        "mode (x.py:617)"]
    with decode.open("a") as f:
        f.write("tance 7: silent for 130.0s (pinged=True)\n")
    assert trouble.take() == [
        "decode.log: LMCache WARNING: Reaped GPU instance 7: silent for 130.0s (pinged=True)"]
    assert trouble.take() == []
    assert lm.Trouble(tmp_path / "none.log").take() == []


class _FakePair:
    """The HTTP side of a correctness run, faked: every completion equals its reference,
    the decode instance's metrics count what a case is told to, and LMCache's log says
    what the case's ``serve`` decides (a load, or the adapter's degraded mode)."""

    def __init__(self, log_dir: Path, serve) -> None:
        self.log_dir, self.serve = log_dir, serve
        self.samples = {"vllm:prefix_cache_hits": 0.0,
                        "vllm:external_prefix_cache_hits": 0.0,
                        "vllm:num_preemptions": 0.0}
        self.decode_prompts: list[list[int]] = []
        self.pair = pair_mod.Pair("http://p", "http://d", "http://x")
        (log_dir / "lmcache.log").write_text("")
        (log_dir / "decode.log").write_text("")

    def complete(self, url, prompt, max_tokens, procs, extra=None, headers=None):
        if url == "http://d":
            self.decode_prompts.append(prompt)
            loaded = self.serve(len(self.decode_prompts), prompt)
            if loaded:
                self.samples["vllm:external_prefix_cache_hits"] += loaded
                with open(self.log_dir / "lmcache.log", "a") as f:
                    f.write(f"LMCache INFO: Retrieved {loaded} tokens in 0.002 seconds\n")
            elif loaded == 0:
                with open(self.log_dir / "decode.log", "a") as f:
                    f.write("LMCache WARNING: LMCache server is unhealthy — entering "
                            "degraded mode\n")
            self.samples["vllm:prefix_cache_hits"] += 256  # B's local hit
            self.samples["vllm:num_preemptions"] += 1
        ids = [t % 7 for t in prompt[:max_tokens]]
        return client.Completion(ids, "", 0.0, 0.0, len(prompt), [str(i) for i in ids],
                             [0.0] * len(ids), [{str(i): 0.0} for i in ids])

    def install(self, monkeypatch) -> None:
        from hybridpd.e2e import metrics

        monkeypatch.setattr(correctness, "warm_up", lambda *a, **k: None)
        monkeypatch.setattr(correctness, "post", lambda *a, **k: None)
        monkeypatch.setattr(correctness, "complete", self.complete)
        monkeypatch.setattr(correctness, "settled_scrape",
                            lambda *a, **k: metrics.Snapshot(dict(self.samples)))
        monkeypatch.setattr(correctness, "prefill_for_remote_decode", lambda *a, **k: {"p": 1})
        monkeypatch.setattr(correctness, "score", lambda *a, **k: None)
        monkeypatch.setattr(correctness, "compare_teacher_forced", lambda *a, **k: (True, ""))


def test_an_l_pair_lmcache_did_not_serve_is_tried_again_and_reported(
    tmp_path: Path, monkeypatch
) -> None:
    """The first L2 meets LMCache's degraded adapter; a second pair (new tokens) takes
    the hit; the third is not run; both attempts are rows, the miss with what the log
    said."""
    seen: list[int] = []

    def serve(n: int, prompt: list[int]):
        if len(prompt) != 456:
            return None  # not an L2: nothing logged
        seen.append(n)
        return 0 if len(seen) == 1 else 256

    fake = _FakePair(tmp_path, serve)
    fake.install(monkeypatch)
    procs = type("Procs", (), {"log_dir": tmp_path})()
    opts = correctness.CorrectnessOptions(lmcache=True, concurrent=1)
    out = correctness.run_correctness(fake.pair, procs, 1000, opts, lambda _: None)
    labels = [r["label"] for r in out["requests"]]
    assert [lb.split(" ")[0] for lb in labels if lb.startswith("L")] == ["L1", "L2", "L1", "L2"]
    assert "L2 (attempt 2) L1's first chunk from LMCache (D's prefix cache reset)" in labels
    assert not any("attempt 3" in lb for lb in labels)
    assert out["checks"]["lmcache_served_a_hit"]
    [miss] = out["lmcache_not_served"]
    assert miss["label"].startswith("L2 L1's first chunk")
    assert miss["log_lines"] == [
        "decode.log: LMCache WARNING: LMCache server is unhealthy — entering degraded mode"]


def test_no_l_pair_served_fails_the_run_naming_the_logs(tmp_path: Path, monkeypatch) -> None:
    fake = _FakePair(tmp_path, lambda n, prompt: 0 if len(prompt) == 456 else None)
    fake.install(monkeypatch)
    procs = type("Procs", (), {"log_dir": tmp_path})()
    opts = correctness.CorrectnessOptions(lmcache=True, concurrent=1)
    out = correctness.run_correctness(fake.pair, procs, 1000, opts, lambda _: None)
    assert not out["checks"]["lmcache_served_a_hit"]
    assert len(out["lmcache_not_served"]) == correctness.LMCACHE_HIT_ATTEMPTS
    from hybridpd.e2e import report as report_mod

    result = report_mod.RunResult(build="patched", connector="lmcache+nixl", logs="",
                                  requests=out["requests"], checks=out["checks"],
                                  figures={"lmcache_not_served": out["lmcache_not_served"]})
    [failure] = [f for f in run_mod._correctness_failures(result, "patched / lmcache+nixl",
                                                          True)
                 if "LMCache" in f]
    assert "LMCache served no hit to the decode instance (L2, 3 attempt(s))" in failure
    assert "its logs say: decode.log: LMCache WARNING: LMCache server is unhealthy" in failure


def test_lmcache_sets_run_on_their_own(tmp_path: Path) -> None:
    from builders import standard_project

    _, series = standard_project(tmp_path)
    opts = dict(pin=series.pin("1.0"), tiny=True, out_dir=tmp_path / "out")
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
    from hybridpd.series.model import load

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

        def start(self, name, cmd, env=None, cwd=None, shm=(), root=None):
            started.append((name, tuple(shm)))

        def wait_ready(self, urls, timeout, progress):
            assert started[-1][0] in urls  # each wait follows the start of what it waits for
            return {n: 1.0 for n in urls}

    class Env:
        python = Path("/v/bin/python")

    pair_mod._start_pair_once(Procs(), Env(), "m", "lmcache+nixl", "kv_both",
                              pair_mod.ServerOptions(), print)
    assert [n for n, _ in started] == ["lmcache", "prefill", "decode", "router"]
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
