"""The ``fleet`` scenario (``e2e.fleet``) without vLLM: its sizes, its plan's checks,
its orchestration with the processes recorded, and a whole run over stand-in servers,
router and benchmark as real processes, every one of them reaped."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from builders import standard_project

from hybridpd.e2e import fleet as fleet_mod
from hybridpd.e2e import metrics, prefix_repetition
from hybridpd.e2e import reap as reap_mod
from hybridpd.e2e import report as report_mod
from hybridpd.e2e import router as router_mod
from hybridpd.e2e import run as run_mod
from hybridpd.e2e import servers as servers_mod
from hybridpd.e2e.envs import Env
from hybridpd.proc import group_members

pytestmark = pytest.mark.usefixtures("isolated")

TINY = ["linear_attention"] * 3 + ["full_attention"]  # 3 Mamba groups, 1 attention group
BENCH = prefix_repetition.BenchOptions(prefix_len=300, suffix_len=32, num_prefixes=4,
                                       output_len=8, num_prompts=16, concurrency=1)


def test_the_limit_is_every_request_but_each_prefixs_first_on_its_whole_blocks() -> None:
    # 16 requests over 4 prefixes: 12 can hit, each on 300 // 128 = 2 blocks.
    assert fleet_mod.hit_limit(BENCH, 128) == 12 * 256
    # vllm bench sends num_prompts // num_prefixes per prefix: 17 prompts are 16.
    odd = prefix_repetition.BenchOptions(prefix_len=300, num_prefixes=4, num_prompts=17)
    assert fleet_mod.hit_limit(odd, 128) == 12 * 256


def test_the_default_pool_holds_an_even_share_of_the_prefixes_and_not_all() -> None:
    o = fleet_mod.FleetOptions(2, bench=BENCH)
    # null block + 2 prefixes x 2 attention blocks (no Mamba state per prefix on a
    # decode instance: it comes from the prefill instance) + the running request's 3rd
    # attention block + 2 pages x 3 Mamba groups
    assert fleet_mod.decode_blocks(o, TINY) == 1 + 2 * 2 + 1 + 6
    # Refused where every prefix may fit beside a running request taking one page per
    # Mamba group (the fewest it takes).
    assert not fleet_mod.holds_every_prefix(o, 1 + 4 * 2 + 1 + 3 - 1, TINY)
    assert fleet_mod.holds_every_prefix(o, 1 + 4 * 2 + 1 + 3, TINY)
    three = fleet_mod.FleetOptions(3, bench=BENCH)  # ceil(4 / 3) = 2 prefixes each
    assert fleet_mod.decode_blocks(three, TINY) == 12


def test_the_fleet_counts_its_pool_in_the_blocks_vllm_serves(tmp_path: Path) -> None:
    # vLLM serves the tiny model on CPU in blocks of 256 (one holds a Mamba state), not
    # --block-size 128: a pool and a prefix counted in blocks of 128 held every prefix
    # on one instance and nothing evicted.
    _, series = standard_project(tmp_path)
    o = run_mod.fleet_options(_options(tmp_path, series, num_prefixes=4, num_prompts=16))
    assert o.block_size == run_mod.pair_mod.served_block_size(dict(run_mod.SPEC), 128, 0) == 256
    # null block + 2 prefixes x 1 attention block + the running request's 2nd attention
    # block + 2 pages x 3 Mamba groups
    assert fleet_mod.decode_blocks(o, TINY) == 1 + 2 * 1 + 1 + 6 == 10
    # Measured: 10 blocks held all 4 prefixes (nothing evicted), so it is refused; with
    # 8 prefixes the default pool (4 each) is 12 and one pool may hold 7 at most.
    assert fleet_mod.holds_every_prefix(o, 10, TINY)
    eight = run_mod.fleet_options(_options(tmp_path, series))
    assert fleet_mod.decode_blocks(eight, TINY) == 12
    assert not fleet_mod.holds_every_prefix(eight, 12, TINY)
    assert fleet_mod.hit_limit(o.bench, o.block_size) == 12 * 256
    # Where it cannot be derived (a GPU), --block-size.
    assert run_mod.fleet_options(_options(tmp_path, series, device="cuda")).block_size == 128
    # The documented workload's 4 prefixes fit one pool of 10 blocks: refused.
    with pytest.raises(run_mod.E2EUsageError, match="^a decode pool of 10 blocks holds all 4"):
        run_mod.run(series, _options(tmp_path, series, num_prefixes=4, num_prompts=16), [], print)


def test_each_instance_gets_cores_of_its_own_where_there_are_enough() -> None:
    sixteen = list(range(16))
    assert [fleet_mod.cpu_binding(i, 3, "P" if i == 0 else "D", sixteen) for i in range(3)] == [
        "0,1,2,3,4", "5,6,7,8,9", "10,11,12,13,14,15"]
    # Two cores for three instances: the pair's halves, the decode instances sharing one.
    assert [fleet_mod.cpu_binding(i, 3, "P" if i == 0 else "D", [0, 1]) for i in range(3)] == [
        "0", "1", "1"]


def _options(tmp_path: Path, series, **kw) -> run_mod.E2EOptions:
    given = dict(scenario="fleet", prefix_len=300, suffix_len=32, num_prefixes=8,
                 output_len=8, num_prompts=24, concurrency=1)
    return run_mod.E2EOptions(pin=series.pin("1.0"), tiny=True, out_dir=tmp_path / "out",
                              **{**given, **kw})


@pytest.mark.parametrize(("given", "message"), [
    ({"device": "cuda"}, "the fleet scenario runs on CPU so far"),
    ({"front": "proxy"}, "the fleet scenario needs --front router"),
    ({"decode_instances": 1}, "--decode-instances 1: a fleet has at least 2"),
    ({"policies": ("least_busy",)}, "--policy least_busy: choose from random, round_robin"),
    ({"num_prompts": 3}, "--num-prompts 3 is fewer than --num-prefixes 8"),
    ({"prefix_len": 100}, "--prefix-len 100 is shorter than a block"),
    ({"decode_num_blocks": 40}, "a decode pool of 40 blocks holds all 8 prefixes"),
    ({"connectors": ("lmcache+nixl",)}, "lmcache+nixl: the fleet scenario does not start"),
    ({"hosts": "netns"}, "--hosts netns: the fleet scenario runs its instances on this host"),
])
def test_a_fleet_that_cannot_measure_anything_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: dict, message: str
) -> None:
    _, series = standard_project(tmp_path)
    monkeypatch.setattr(run_mod, "preflight", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(run_mod.E2EUsageError) as info:
        run_mod.run(series, _options(tmp_path, series, **given), [], print)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


class _Procs:
    """Processes for the real fleet code: records what starts, stops and is waited for."""

    def __init__(self, log_dir: Path, events: list) -> None:
        self.log_dir, self.events, self.procs = Path(log_dir), events, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.events.append(("close",))
        return False

    def start(self, name, cmd, env=None, cwd=None, shm=()):
        self.events.append(("start", name, cmd))
        self.procs[name] = cmd

    def wait_ready(self, urls, timeout, progress=None):
        self.events.append(("wait", *urls))
        return {n: 1.0 for n in urls}

    def stop(self, name, **kw):
        self.events.append(("stop", name))

    def check_soon(self):
        pass

    def leftovers(self):
        return {}


def _snapshot(hits: int, queries: int, requests: int) -> metrics.Snapshot:
    return metrics.Snapshot({"vllm:prefix_cache_hits_total": hits,
                             "vllm:prefix_cache_queries_total": queries,
                             "vllm:request_success_total": requests})


@pytest.fixture
def stood_in_fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list:
    """Environments, probes and the tiny model stood in; the fleet's processes recorded;
    each decode instance's counters grow by a figure per (URL, policy)."""
    events: list = []

    def prepare(series, version, build, device, log, torch=None):
        venv = tmp_path / f"venv-{build}"
        return Env(build, venv / "bin" / "python", venv, None, "0" * 40, True, {})

    def tiny_model(env, arch, seed, cache, process_env, variant="default", mtp=False):
        path = tmp_path / "tiny"
        path.mkdir(exist_ok=True)
        (path / "hybridpd-tiny.json").write_text(json.dumps(
            {"architectures": ["Qwen3_5ForCausalLM"], "parameters": 10, "vocab_size": 300}))
        return path

    state = {"policy": None, "scrapes": 0}
    # hits per (build, policy) and decode instance; each is scraped before the
    # workload, then after it.
    gains = {("patched", "round_robin"): (1024, 512), ("patched", "cache_aware"): (1536, 1536),
             ("stock", "round_robin"): (0, 0), ("stock", "cache_aware"): (0, 0)}

    def settled_scrape(url, previous=None, wait=1.0, tries=10):
        index = state["scrapes"] % 2  # decode-1, then decode-2
        after = state["scrapes"] >= 2
        state["scrapes"] += 1
        hits = gains[(state["build"], state["policy"])][index] if after else 0
        return _snapshot(hits + 7, 4000 if after else 0, 8 if after else 0)

    def run_bench(front, procs, env, model, opts, out_dir, log, name="bench"):
        events.append(("bench", name, opts.prefix_len))
        return {"mean_ttft_ms": 100.0}, ["vllm", "bench"]

    def start_router(procs, env, fleet, policy, opts, progress):
        state["policy"], state["build"], state["scrapes"] = policy, env.build, 0
        return real_start_router(procs, env, fleet, policy, opts, progress)

    real_start_router = fleet_mod.start_router
    monkeypatch.setattr(run_mod, "preflight", lambda *a, **k: None)
    monkeypatch.setattr(router_mod, "install", lambda python, log: None)
    monkeypatch.setattr(run_mod, "prepare", prepare)
    monkeypatch.setattr(run_mod, "probe", lambda *a: {
        "nixl": "ok", "qwen3_5": "ok", "vllm": "1.0",
        "kernels": {"module": "vllm._C_AVX2", "status": "ok"}})
    monkeypatch.setattr(run_mod, "tiny_model", tiny_model)
    monkeypatch.setattr(run_mod, "Processes", lambda d: _Procs(d, events))
    monkeypatch.setattr(fleet_mod, "reset_caches",
                        lambda fleet: events.append(("reset", fleet.prefill, *fleet.decodes)))
    monkeypatch.setattr(fleet_mod, "settled_scrape", settled_scrape)
    monkeypatch.setattr(prefix_repetition, "run_bench", run_bench)
    monkeypatch.setattr(fleet_mod, "start_router", start_router)
    return events


def _flag(cmd: list[str], name: str) -> list[str]:
    return [cmd[i + 1] for i, arg in enumerate(cmd) if arg == name]


def test_each_build_starts_one_fleet_and_each_policy_a_router_over_it(
    tmp_path: Path, stood_in_fleet: list
) -> None:
    _, series = standard_project(tmp_path)
    options = _options(tmp_path, series, compare="stock",
                       policies=("round_robin", "cache_aware"))
    result = run_mod.run(series, options, ["hybridpd", "e2e"], print)
    events = stood_in_fleet

    steps = [e[:2] if e[0] in ("start", "stop", "bench") else e[:1] for e in events]
    per_policy = lambda p: [("reset",), ("start", f"router-{p}"), ("wait",),  # noqa: E731
                            ("bench", f"bench-{p}"), ("stop", f"router-{p}")]
    fleet = [("start", "prefill"), ("start", "decode-1"), ("start", "decode-2"), ("wait",),
             *per_policy("round_robin"), *per_policy("cache_aware"), ("close",)]
    assert steps == fleet * 2  # patched, then stock

    started = {e[1]: e[2] for e in events[:3]}
    ports = {n: _flag(c, "--port")[0] for n, c in started.items()}
    # Each decode instance has the shrunken pool (in the 256-token blocks vLLM serves the
    # tiny model in on CPU); the prefill instance's is from memory.
    assert [_flag(started[n], "--num-gpu-blocks-override") for n in started] == [
        [], ["12"], ["12"]]
    router = next(e[2] for e in events if e[:2] == ("start", "router-round_robin"))
    assert _flag(router, "--prefill") == [f"http://127.0.0.1:{ports['prefill']}"]
    assert _flag(router, "--decode") == [f"http://127.0.0.1:{ports['decode-1']}",
                                         f"http://127.0.0.1:{ports['decode-2']}"]
    assert _flag(router, "--decode-policy") == ["round_robin"]
    # The caches are reset on every instance before each policy.
    assert events[4] == ("reset", *(f"http://127.0.0.1:{ports[n]}" for n in started))

    runs = result.report.runs
    assert [(r.build, r.figures["policy"]) for r in runs] == [
        ("patched", "round_robin"), ("patched", "cache_aware"),
        ("stock", "round_robin"), ("stock", "cache_aware")]
    rr = runs[0]
    assert rr.decode_prefix_cache_hits == sum(
        i["prefix_cache_hits"] for i in rr.figures["instances"])
    assert rr.figures["hit_limit_tokens"] == 16 * 256
    assert rr.figures["hit_of_limit"] == round(rr.decode_prefix_cache_hits / (16 * 256), 3)
    assert result.failures == []

    table = report_mod.table(result.report)
    assert table[2:] == [
        "| nixl | round_robin | 4 096 | 0 | 1 536 | 0.0% | 37.5% | 0 (8) / 0 (8) "
        "| 1024 (8) / 512 (8) | 100 | 100 |",
        "| nixl | cache_aware | 4 096 | 0 | 3 072 | 0.0% | 75.0% | 0 (8) / 0 (8) "
        "| 1536 (8) / 1536 (8) | 100 | 100 |",
    ]
    data = json.loads(result.paths["json"].read_text())
    assert data["scenario"] == "fleet" and len(data["runs"]) == 4
    assert data["options"]["policies"] == ["round_robin", "cache_aware"]
    assert "decode-2" in data["runs"][0]["server_commands"]


def test_a_policy_that_fails_keeps_the_policies_before_it_in_the_report(
    tmp_path: Path, stood_in_fleet: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, series = standard_project(tmp_path)
    real = fleet_mod.run_policy

    def run_policy(fleet, procs, env, model, policy, *a, **k):
        if policy == "kv_aware":
            raise servers_mod.E2EError("router-kv_aware exited with status 2")
        return real(fleet, procs, env, model, policy, *a, **k)

    monkeypatch.setattr(fleet_mod, "run_policy", run_policy)
    with pytest.raises(servers_mod.E2EError,
                       match=r"^patched / nixl: router-kv_aware exited with status 2$"):
        run_mod.run(series, _options(tmp_path, series), [], print)
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [(r.get("policy"), r.get("error")) for r in data["runs"]] == [
        ("round_robin", None), ("cache_aware", None),
        (None, "router-kv_aware exited with status 2")]
    assert stood_in_fleet[-1] == ("close",)


# --------------------------------------------------------------------------- real processes

#: One stand-in for every process of a fleet: a vLLM server (``-m ...`` with --port:
#: /v1/models, /metrics, POST /reset_prefix_cache), vllm-router (argv with
#: --vllm-pd-disaggregation: /health) and ``vllm bench serve`` (``-c``: writes its
#: result file). Each logs its argv.
STAND_IN = textwrap.dedent(
    """\
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    argv = sys.argv[1:]
    print("argv:", " ".join(argv), flush=True)
    if argv[0] == "-c":
        out = argv[argv.index("--result-dir") + 1]
        name = argv[argv.index("--result-filename") + 1]
        with open(os.path.join(out, name), "w") as f:
            json.dump({"completed": 16, "mean_ttft_ms": 12.0, "output_throughput": 3.0}, f)
        sys.exit(0)
    port = int(argv[argv.index("--port") + 1])
    router = "--vllm-pd-disaggregation" in argv

    class H(BaseHTTPRequestHandler):
        def _answer(self, body=b""):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if router and self.path == "/health":
                return self._answer()
            if not router and self.path == "/v1/models":
                return self._answer(b"{}")
            if not router and self.path == "/metrics":
                return self._answer(b"vllm:prefix_cache_hits_total 0\\n")
            self.send_response(404)
            self.end_headers()

        def do_POST(self):
            self._answer() if self.path == "/reset_prefix_cache" else self.send_error(404)

        def log_message(self, *a):
            pass

    HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def test_a_fleet_of_stand_in_processes_is_recorded_and_reaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    script = tmp_path / "standin.py"
    script.write_text(STAND_IN)
    for name in ("python", router_mod.SCRIPT):
        exe = venv / "bin" / name
        exe.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
        exe.chmod(0o755)
    env = Env("patched", venv / "bin" / "python", venv, None, None, False, {})
    recorded: list[set[str]] = []
    write = reap_mod.write

    def record(path, entries, writer, network=None):
        recorded.append({e.name for e in entries})
        write(path, entries, writer, network)

    monkeypatch.setattr(reap_mod, "write", record)
    opts = run_mod.pair_mod.ServerOptions(decode_num_blocks=18, ready_timeout=60)
    o = fleet_mod.FleetOptions(2, ("round_robin", "kv_aware"), BENCH)
    results: list[dict] = []
    run_dir = tmp_path / "run"
    with servers_mod.Processes(run_dir, grace=2) as procs:
        fleet = fleet_mod.run_fleet(procs, env, str(tmp_path / "model"), "nixl", "kv_both",
                                    opts, o, run_dir, print, results)
        pids = [p.pid for p in procs.procs.values()]
    assert len(fleet.decodes) == 2
    assert [r["policy"] for r in results] == ["round_robin", "kv_aware"]
    assert results[0]["hit_limit_tokens"] == 12 * 256
    assert [i["prefix_cache_hits"] for i in results[0]["instances"]] == [0, 0]
    # Every process was in the run's record while it ran, and none is left.
    seen = set().union(*recorded)
    assert {"prefill", "decode-1", "decode-2", "router-round_robin", "router-kv_aware",
            "bench-round_robin", "bench-kv_aware"} <= seen
    for policy in o.policies:  # each router beside all three servers
        assert any({"prefill", "decode-1", "decode-2", f"router-{policy}"} <= names
                   for names in recorded)
    assert recorded[-1] == set()
    assert all(group_members(pid) == [] for pid in pids)
    assert reap_mod.reap(run_dir) == []
    [argv] = [line for line in (run_dir / "router-kv_aware.log").read_text().splitlines()
              if line.startswith("argv: ")]
    assert "--decode-policy kv_aware" in argv and argv.count("--decode ") == 2


# --------------------------------------------------------------------------- routing probe

#: A stand-in router for the probe: PD mode's two steps, its decode instances in turn.
TOY_ROUTER = textwrap.dedent(
    """\
    import itertools, json, sys, urllib.request
    from http.server import BaseHTTPRequestHandler, HTTPServer
    argv = sys.argv[1:]
    port = int(argv[argv.index("--port") + 1])
    prefill = argv[argv.index("--prefill") + 1]
    decodes = itertools.cycle([argv[i + 1] for i, a in enumerate(argv) if a == "--decode"])

    def post(url, body):
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
        with urllib.request.urlopen(req) as resp:
            return resp.read()

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            post(prefill, body)
            answer = post(next(decodes), body)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *a):
            pass

    HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def test_the_probe_reads_each_requests_decode_instance_from_the_stand_ins(
    tmp_path: Path
) -> None:
    from hybridpd.e2e import routing

    script = tmp_path / "toy_router.py"
    script.write_text(TOY_ROUTER)
    router = tmp_path / "bin" / "vllm-router"
    router.parent.mkdir()
    router.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    router.chmod(0o755)
    work = routing.prompts(3, 2, 20, 4, seed=1)
    assert sorted(p for p, _ in work) == [0, 0, 1, 1, 2, 2]
    chosen = routing.probe(router, "round_robin", 2, work, tmp_path / "logs", timeout=30)
    assert chosen == [0, 1, 0, 1, 0, 1]
    assert reap_mod.reap(tmp_path / "logs") == []


def test_spread_counts_the_requests_that_are_new_to_their_instance() -> None:
    from hybridpd.e2e import routing

    work = [(0, "a"), (1, "b"), (0, "c"), (1, "d")]
    # Alternating: each prefix lands on both instances, 4 firsts against the ideal 2.
    assert routing.spread(work, [0, 1, 1, 0], 2) == {
        "requests": [2, 2], "prefixes": [2, 2], "first_on_instance": 4, "ideal_first": 2}
    # All on one: the ideal firsts, but one instance holds every prefix.
    assert routing.spread(work, [0, 0, 0, 0], 2) == {
        "requests": [4, 0], "prefixes": [2, 0], "first_on_instance": 2, "ideal_first": 2}
