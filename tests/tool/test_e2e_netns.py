"""``hybridpd e2e --hosts netns``: prefill and decode on two simulated hosts (issue 45,
item 2): the network's names and addresses, the proof of UCX's transport read from its
protocol tables, the options refused with one line, and (as root: namespaces are real
here) a network made, used, removed on close, and removed by ``e2e --reap`` after a
SIGKILLed run.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner
from hybridpd.cli.main import main
from hybridpd.e2e import netns, reap
from hybridpd.e2e import pair as pair_mod
from hybridpd.e2e import report as report_mod
from hybridpd.e2e import run as run_mod
from hybridpd.e2e.servers import Processes, group_members
from hybridpd.series.model import Pin

pytestmark = pytest.mark.usefixtures("isolated")

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="makes network namespaces: root only (CI runs as root)")

#: UCX's protocol tables (UCX_PROTO_INFO=y) as the e2e's vLLM instances log them.
SELF_TABLE = """\
[1795899936.2] [vm:9775 :0]   | ucp_context_0 self cfg#0                                   |
[1795899936.2] [vm:9775 :0]   | active message by ucp_am_send* from host memory            |
[1795899936.2] [vm:9775 :0]   +------------+----------------------+------------------------+
[1795899936.2] [vm:9775 :0]   |      Range |     Description      |         Config         |
[1795899936.2] [vm:9775 :0]   |   0..8176  | short                | self/memory            |
"""


def remote_table(lane: str, kind: str = "inter-node") -> str:
    return f"""\
[1795899937.1] [vm:9801 :1]   | ucp_context_0 {kind} cfg#1                               |
[1795899937.1] [vm:9801 :1]   | remote memory read by ucp_get* from host memory            |
[1795899937.1] [vm:9801 :1]   +------------+----------------------+------------------------+
[1795899937.1] [vm:9801 :1]   |   1..65520 | zero-copy            | {lane}                 |
[1795899937.1] [vm:9801 :1]   | 65521..inf | multi-frag zero-copy | {lane}                 |
"""


NET = netns.Network("a1b2c3", "10.231.4")


def test_names_and_addresses_of_a_network() -> None:
    assert NET.names() == ["hpd-a1b2c3-p", "hpd-a1b2c3-d", "hpda1b2c3p", "hpda1b2c3d",
                           "hpda1b2c3br"]
    assert all(netns.NAME.match(n) and len(n) <= 15 for n in NET.names())
    assert (NET.gateway, NET.address("p"), NET.address("d")) == (
        "10.231.4.1", "10.231.4.2", "10.231.4.3")
    assert NET.device("d") == "hpda1b2c3dn"
    assert netns.Network.from_json(json.loads(json.dumps(NET.to_json()))) == NET
    env = netns.server_env(NET, "d")
    assert env == {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.231.4.3", "UCX_TLS": "tcp,self",
                   "UCX_NET_DEVICES": "hpda1b2c3dn", "UCX_PROTO_INFO": "y"}


@pytest.mark.parametrize("data", [
    {"id": "a1b2c3; rm", "subnet": "10.231.4"}, {"id": "a1b2c3", "subnet": "10.231.4.0/24"},
    {"id": "../x", "subnet": "10.1.1"},
])
def test_a_record_naming_another_network_is_refused(data: dict) -> None:
    with pytest.raises(ValueError):
        netns.Network.from_json(data)


def test_a_new_network_avoids_the_routes_of_this_machine() -> None:
    # Every /24 of 10.200.0.0/16..10.254.255.0/24 but one is taken: that one is picked.
    taken = [ipaddress.IPv4Network(f"10.{a}.0.0/16") for a in range(200, 255) if a != 222]
    taken += [ipaddress.IPv4Network(f"10.222.{b}.0/24") for b in range(256) if b != 17]
    net = netns.Network.new(taken)
    assert net.subnet == "10.222.17"
    assert netns.Network.new(taken).id != net.id
    with pytest.raises(netns.NetnsError, match="no free private /24"):
        netns.Network.new([ipaddress.IPv4Network("10.0.0.0/8")])


def test_tcp_on_the_decode_link_is_the_verdict() -> None:
    d_log = SELF_TABLE + remote_table("tcp/hpda1b2c3dn")
    ok, seen = netns.tcp_verdict(NET, {"p": SELF_TABLE, "d": d_log})
    assert ok
    assert seen["remote_endpoints"] == {"p": [], "d": ["tcp/hpda1b2c3dn"]}
    assert seen["other_transports"] == []


@pytest.mark.parametrize("d_log, why", [
    (SELF_TABLE, "no endpoint to the other host: no transfer at all"),
    (remote_table("tcp/lo"), "TCP, but not on the link"),
    (remote_table("tcp/hpda1b2c3dn") + remote_table("posix/memory", "intra-node"),
     "shared memory beside it"),
    (remote_table("tcp/hpda1b2c3dn") + remote_table("cma/memory"), "cross-memory attach"),
])
def test_any_other_transport_or_none_fails(d_log: str, why: str) -> None:
    ok, seen = netns.tcp_verdict(NET, {"p": SELF_TABLE, "d": d_log})
    assert not ok, why


def test_a_run_whose_transfer_went_another_way_fails() -> None:
    run = report_mod.RunResult.from_json({
        "build": "patched", "connector": "nixl", "checks": {"nixl_over_tcp": False},
        "ucx_transports": {"expected": "tcp/hpda1b2c3dn", "remote_endpoints": {
            "d": ["posix/memory"]}, "other_transports": ["posix/memory"]},
        "requests": [], "logs": "x",
    })
    failures = run_mod._failures(run, "correctness", False, Pin("0.32.0", "v0.32.0", "", ""))
    assert len(failures) == 1 and "did not go over tcp/hpda1b2c3dn alone" in failures[0]
    assert "posix/memory" in failures[0]


@pytest.mark.parametrize("args, line", [
    (["--device", "cuda", "--gpus", "0,1"], "--hosts netns runs on CPU only so far"),
])
def test_options_refused_with_one_line(args: list[str], line: str) -> None:
    result = CliRunner().invoke(main, ["e2e", "--pin", "0.32.0", "--tiny", "--hosts", "netns",
                                       *args])
    assert result.exit_code == 2, result.output
    # click's usage error: the command's usage line, then the refusal in one line.
    errors = [x for x in result.output.splitlines() if x.startswith("Error")]
    assert len(errors) == 1 and errors[0].startswith(f"Error: {line}"), result.output


def test_not_root_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    result = CliRunner().invoke(main, ["e2e", "--pin", "0.32.0", "--tiny", "--hosts", "netns"])
    assert result.exit_code == 2, result.output
    errors = [x for x in result.output.splitlines() if x.startswith("Error")]
    assert errors == ["Error: --hosts netns makes network namespaces and links: run it as "
                      "root (or leave --hosts at one)"], result.output


def test_dry_run_shows_each_instance_on_its_host() -> None:
    result = CliRunner().invoke(main, ["e2e", "--pin", "0.32.0", "--tiny", "--hosts", "netns",
                                       "--patched-venv", "/nonexistent", "--dry-run"])
    assert result.exit_code == 0, result.output
    p, d = [line for line in result.output.splitlines() if line.startswith("# on ")]
    assert p.startswith("# on hpd-000000-p:") and "--host 10.200.0.2" in p
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST=10.200.0.3" in d and "UCX_TLS=tcp,self" in d


# --------------------------------------------------------------------------- real namespaces


def _serve(hosts: pair_mod.Hosts, procs: Processes, side: str, tmp: Path, tag: str) -> None:
    """A stand-in server on ``side``'s host: HTTP on its address, and a file in its
    /dev/shm that it holds open."""
    script = (f"import http.server,os; f=open('/dev/shm/{tag}-{side}-'+str(os.getpid()),'w'); "
              f"http.server.test(http.server.SimpleHTTPRequestHandler, port=8765, "
              f"bind='{hosts.address(side)}')")
    procs.start(side, hosts.command(side, [sys.executable, "-c", script], tmp), dict(os.environ),
                cwd=tmp, shm=(f"/dev/shm/{tag}-{side}-{{pid}}",), root=hosts.root(side))


def _answers(url: str, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status == 200
        except OSError:
            time.sleep(0.1)
    return False


@needs_root
def test_two_hosts_share_no_shm_reach_each_other_and_are_removed_on_close(tmp_path: Path) -> None:
    tag = f"hybridpd-test-{uuid.uuid4().hex[:8]}"
    with Processes(tmp_path / "run") as procs:
        hosts = pair_mod.make_hosts(procs, pair_mod.ServerOptions(hosts="netns"))
        net = hosts.network
        recorded = json.loads((tmp_path / "run" / reap.RECORD).read_text())["network"]
        assert netns.Network.from_json(recorded) == net
        assert sorted(netns.exists(net)) == sorted(net.names())
        for side in netns.SIDES:
            _serve(hosts, procs, side, tmp_path, tag)
        # The front's namespace reaches both; P reaches D over the link.
        assert all(_answers(f"http://{net.address(s)}:8765/") for s in netns.SIDES)
        p_to_d = subprocess.run(
            netns.join_command(hosts.root("p"), [sys.executable, "-c", (
                "import urllib.request; print(urllib.request.urlopen("
                f"'http://{net.address('d')}:8765/', timeout=5).status)")]),
            capture_output=True, text=True, timeout=60)
        assert p_to_d.stdout.strip() == "200", p_to_d.stderr
        # Each side's /dev/shm is its own: not this host's, not the other side's.
        d_files = procs.shm_files("d")
        assert [f.name for f in d_files] == [f"{tag}-d-{procs.procs['d'].pid}"]
        assert all(str(f).startswith(f"/proc/{hosts.root('d')}/root/dev/shm/") for f in d_files)
        assert not list(Path("/dev/shm").glob(f"{tag}-*"))
        assert not list(netns.shm_root(hosts.root("p")).glob(f"{tag}-d-*"))
        # A server's own view of what it holds names its host's /dev/shm.
        owned = reap.owned_shm(procs.procs["d"].pid)
        assert [f"/proc/{procs.procs['d'].pid}/root/dev/shm/{f.name}" for f in d_files] == [
            str(f) for f in owned]
        assert {f.stat().st_ino for f in owned} == {f.stat().st_ino for f in d_files}
    assert netns.exists(net) == []
    assert not (tmp_path / "run" / reap.RECORD).exists()


KILLED = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from hybridpd.e2e import pair as pair_mod
    from hybridpd.e2e.servers import Processes
    run_dir, tag = Path(sys.argv[1]), sys.argv[2]
    procs = Processes(run_dir).__enter__()
    hosts = pair_mod.make_hosts(procs, pair_mod.ServerOptions(hosts="netns"))
    for side in ("p", "d"):
        procs.start(side, hosts.command(side, ["sh", "-c",
                    f"echo kv > /dev/shm/{tag}-$$; exec sleep 600"], run_dir),
                    dict(os.environ), shm=(f"/dev/shm/{tag}-{{pid}}",), root=hosts.root(side))
    print(hosts.network.id, flush=True)
    time.sleep(600)
    """
)


@needs_root
def test_a_sigkilled_runs_network_is_removed_by_reap(tmp_path: Path) -> None:
    tag = f"hybridpd-test-{uuid.uuid4().hex[:8]}"
    (tmp_path / "killed.py").write_text(KILLED)
    out = tmp_path / "out"
    run_dir = out / "patched-nixl"
    child = subprocess.Popen([sys.executable, tmp_path / "killed.py", run_dir, tag],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    entries = {}
    try:
        net_id = child.stdout.readline().strip()
        assert len(net_id) == 6, net_id + child.stdout.read()
        doc = json.loads((run_dir / reap.RECORD).read_text())
        net = netns.Network.from_json(doc["network"])
        entries = {e["name"]: reap.Entry.from_json(e) for e in doc["processes"]}
        assert set(entries) == {"host-p", "host-d", "p", "d"}
        child.kill()
        child.wait()
        # Killed: its hosts, servers and network live on until a reap.
        assert sorted(netns.exists(net)) == sorted(net.names())
        assert all(group_members(e.pgid) for e in entries.values())
        root_d = reap.shm_dir(entries["d"].root)
        assert root_d is not None and [p.name for p in entries["d"].shm_paths()] == [
            f"{tag}-{entries['d'].pid}"]
        result = CliRunner().invoke(main, ["e2e", "--reap", str(out)])
        assert result.exit_code == 0, result.output
        assert f"network of simulated hosts {net.id} removed hpd-{net.id}-p" in result.output
        assert netns.exists(net) == []
        assert not any(group_members(e.pgid) for e in entries.values())
        assert not (run_dir / reap.RECORD).exists()
        # The hosts' /dev/shm went with them; this host's never had their files.
        assert reap.shm_dir(entries["d"].root) is None and entries["d"].shm_paths() == set()
        assert not list(Path("/dev/shm").glob(f"{tag}-*"))
        again = CliRunner().invoke(main, ["e2e", "--reap", str(out)])
        assert again.exit_code == 0 and "nothing to reap" in again.output
    finally:
        if child.poll() is None:
            child.kill()
        for e in entries.values():
            if group_members(e.pgid):
                os.killpg(e.pgid, signal.SIGKILL)
        try:
            netns.remove(netns.Network.from_json(json.loads(
                (run_dir / reap.RECORD).read_text())["network"]))
        except (OSError, ValueError, KeyError):
            pass


def test_the_decode_side_and_its_lmcache_server_share_a_host(tmp_path: Path) -> None:
    """lmcache+nixl on two hosts: the lmcache server joins the decode host (their
    /dev/shm is one), listens on its address, and the decode instance's connector and
    the readiness check name that address; the prefill host runs vLLM alone."""
    started: dict[str, dict] = {}

    class Procs:
        log_dir = tmp_path
        procs: dict = {}

        def start(self, name, cmd, env=None, cwd=None, shm=(), root=None):
            started[name] = {"cmd": list(cmd), "env": dict(env or {}), "root": root}

        def wait_ready(self, urls, timeout, progress):
            started[next(iter(urls))]["ready"] = next(iter(urls.values()))
            return {n: 1.0 for n in urls}

    class Env:
        python = Path("/v/bin/python")

    hosts = pair_mod.Hosts(NET, {"p": 111, "d": 222})
    pair = pair_mod._start_pair_once(Procs(), Env(), "m", "lmcache+nixl", "kv_both",
                                     pair_mod.ServerOptions(hosts="netns"), print, hosts)
    lm, p, d = started["lmcache"], started["prefill"], started["decode"]
    assert lm["cmd"][:5] == ["nsenter", "--target=222", "--net", "--ipc", "--mount"]
    assert lm["root"] == 222 and lm["cmd"][lm["cmd"].index("--host") + 1] == "10.231.4.3"
    assert lm["ready"].startswith("http://10.231.4.3:")
    assert p["cmd"][1] == "--target=111" and p["root"] == 111
    assert p["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.231.4.2"
    assert d["env"]["UCX_NET_DEVICES"] == "hpda1b2c3dn" and d["root"] == 222
    kv = json.loads(d["cmd"][d["cmd"].index("--kv-transfer-config") + 1])
    lm_child = kv["kv_connector_extra_config"]["connectors"][0]
    assert lm_child["kv_connector_extra_config"]["lmcache.mp.host"] == "tcp://10.231.4.3"
    assert (pair.prefill, pair.decode) == (f"http://10.231.4.2:{p['cmd'][p['cmd'].index('--port') + 1]}",
                                           f"http://10.231.4.3:{d['cmd'][d['cmd'].index('--port') + 1]}")
    assert pair.front.startswith("http://127.0.0.1:") and pair.network == NET
    # The router runs here, in the root namespace, and names both hosts' addresses.
    router = started["router"]["cmd"]
    assert router[0] != "nsenter" and pair.prefill in router and pair.decode in router
