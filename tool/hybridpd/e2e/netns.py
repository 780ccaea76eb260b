"""Two simulated hosts for an e2e run (``--hosts netns``): the prefill and the decode
instance each on a "host" of its own, joined by a network link the run creates.

A :class:`Network` is, per pair of servers, one bridge in the root network namespace
(address ``<subnet>.1``, from a private /24 no route of this machine covers) and, per
side (``p``, ``d``), a network namespace holding one end of a veth pair (address
``<subnet>.2`` and ``.3``) whose other end is on the bridge. The front (vLLM's router, or
hybridpd's proxy) and the client stay in the root namespace and reach both instances at
their addresses over the bridge; prefill and decode reach each other only over it.

Each side's "host" is a holder process (:func:`holder_command`): in the side's network
namespace, in IPC and mount namespaces of its own, with a fresh tmpfs on ``/dev/shm``;
every server of that side (vLLM, the decode side's ``lmcache server``) joins its
namespaces with ``nsenter`` (:func:`join_command`). So the two sides share no
``/dev/shm``, no System V IPC and no loopback, while a decode instance and its lmcache
server share them as on one host. A side's ``/dev/shm`` is read from the root
namespace as ``/proc/<holder pid>/root/dev/shm``; it goes when the last process of the
side ends.

Invariants:

- every name a run creates matches :data:`NAME` (links: ``hpd<id>br``, ``hpd<id>p``,
  ``hpd<id>d``; namespaces ``hpd-<id>-p``, ``hpd-<id>-d``; ``<id>`` 6 hex digits, new per
  network); :func:`remove` acts on no other name, whatever a record says;
- the network is recorded (:class:`~.servers.Processes`' record) before its first
  link or namespace is made, and dropped from the record only once :func:`remove`
  found each gone, so a SIGKILLed run's network is removed by the next ``hybridpd
  e2e`` or ``e2e --reap`` as its servers are;
- only addresses of the network's own /24 are assigned; nothing is routed elsewhere.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

from hybridpd import proc
from hybridpd.errors import HybridpdError

#: ``--hosts`` values: every process on this host, or prefill and decode on two
#: simulated ones.
HOSTS = ("one", "netns")
SIDES = ("p", "d")
#: The names a network's links and namespaces may have (see the module's invariants).
NAME = re.compile(r"^(hpd[0-9a-f]{6}(br|p|d)|hpd-[0-9a-f]{6}-[pd])$")
#: Where the /24 of a network is picked: 10.200.0.0/16 .. 10.254.255.0/24.
_RANGE = (200, 254)
#: The programs a network needs.
TOOLS = ("ip", "unshare", "nsenter")
#: UCX's transports on a simulated host: TCP between the hosts (``self`` for a
#: process's transfers to itself). No shared-memory transport can carry a transfer.
UCX_TLS = "tcp,self"


class NetnsError(HybridpdError):
    """A network of simulated hosts could not be made, joined or removed."""


@dataclasses.dataclass(frozen=True)
class Network:
    id: str  # 6 hex digits
    subnet: str  # "10.a.b": the network's /24 without its last octet

    @classmethod
    def new(cls, taken: Sequence[ipaddress.IPv4Network] | None = None) -> Network:
        """A network with a new id and a /24 that overlaps none of ``taken`` (default:
        this machine's routes and addresses)."""
        taken = list(taken if taken is not None else _taken_networks())
        # A random one first (two runs at once rarely pick the same), then each in turn.
        start = secrets.randbelow((_RANGE[1] - _RANGE[0] + 1) * 256)
        count = (_RANGE[1] - _RANGE[0] + 1) * 256
        for i in range(count):
            a, b = divmod((start + i) % count, 256)
            net = ipaddress.IPv4Network(f"10.{_RANGE[0] + a}.{b}.0/24")
            if not any(net.overlaps(t) for t in taken):
                return cls(secrets.token_hex(3), f"10.{_RANGE[0] + a}.{b}")
        raise NetnsError("no free private /24 in 10.200.0.0/16-10.254.255.0/24 for the "
                         "simulated hosts: this machine's routes cover them all")

    @property
    def bridge(self) -> str:
        return f"hpd{self.id}br"

    def namespace(self, side: str) -> str:
        return f"hpd-{self.id}-{side}"

    def link(self, side: str) -> str:
        """The bridge's end of the side's veth pair (root namespace)."""
        return f"hpd{self.id}{side}"

    def device(self, side: str) -> str:
        """The side's own end of its veth pair, in its namespace (UCX_NET_DEVICES)."""
        return f"hpd{self.id}{side}n"

    def address(self, side: str) -> str:
        return f"{self.subnet}.{2 + SIDES.index(side)}"

    @property
    def gateway(self) -> str:
        """The bridge's address: the root namespace's (the front's) on the link."""
        return f"{self.subnet}.1"

    def names(self) -> list[str]:
        """Every link and namespace the network has, in the order :func:`remove` takes."""
        return ([self.namespace(s) for s in SIDES] + [self.link(s) for s in SIDES]
                + [self.bridge])

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "subnet": self.subnet, "bridge": self.bridge,
                **{f"{s}": {"namespace": self.namespace(s), "link": self.link(s),
                            "device": self.device(s), "address": self.address(s)}
                   for s in SIDES}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Network:
        net = cls(str(data["id"]), str(data["subnet"]))
        if not re.fullmatch(r"[0-9a-f]{6}", net.id) or not re.fullmatch(
                r"10\.\d{1,3}\.\d{1,3}", net.subnet):
            raise ValueError(f"not a network of simulated hosts: {data!r}")
        return net


def check_usable() -> None:
    """NetnsError (one line) unless this process can make the network."""
    if os.geteuid() != 0:
        raise NetnsError("--hosts netns makes network namespaces and links: run it as root "
                         "(or leave --hosts at one)")
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise NetnsError(f"--hosts netns needs {', '.join(missing)} (iproute2, util-linux)")


def _ip(*args: str, check: bool = True) -> proc.Completed:
    done = proc.run(["ip", *args], env=dict(os.environ), timeout=60)
    if check and not done.ok:
        raise NetnsError(f"ip {' '.join(args)}: {done.tail()}")
    return done


def create(net: Network) -> None:
    """Make ``net``'s bridge, namespaces and veth pairs (record it first: a failure
    part-way leaves what :func:`remove` removes)."""
    _ip("link", "add", net.bridge, "type", "bridge")
    _ip("addr", "add", f"{net.gateway}/24", "dev", net.bridge)
    _ip("link", "set", net.bridge, "up")
    for side in SIDES:
        ns = net.namespace(side)
        _ip("netns", "add", ns)
        _ip("link", "add", net.link(side), "type", "veth", "peer", "name", net.device(side),
            "netns", ns)
        _ip("link", "set", net.link(side), "master", net.bridge)
        _ip("link", "set", net.link(side), "up")
        _ip("-n", ns, "addr", "add", f"{net.address(side)}/24", "dev", net.device(side))
        _ip("-n", ns, "link", "set", net.device(side), "up")
        _ip("-n", ns, "link", "set", "lo", "up")


def remove(net: Network) -> list[str]:
    """Remove ``net``'s namespaces and links that exist; the names removed. NetnsError
    where one exists and could not be removed."""
    removed = []
    for name in net.names():
        if not NAME.match(name):  # never: the names are made here; the invariant says so
            raise NetnsError(f"{name}: not a name of a simulated host's network")
        if name.startswith("hpd-"):
            if not Path("/run/netns", name).exists():
                continue
            done = _ip("netns", "delete", name, check=False)
        else:
            if not _ip("link", "show", "dev", name, check=False).ok:
                continue
            done = _ip("link", "delete", "dev", name, check=False)
        if not done.ok and name in exists(net):
            raise NetnsError(f"cannot remove {name}: {done.tail()}")
        # A veth end goes with its namespace, possibly while it is removed here.
        removed.append(name)
    return removed


def exists(net: Network) -> list[str]:
    """The names of ``net`` that exist now."""
    return [n for n in net.names()
            if (Path("/run/netns", n).exists() if n.startswith("hpd-")
                else _ip("link", "show", "dev", n, check=False).ok)]


def holder_command(net: Network, side: str) -> list[str]:
    """The process that is the side's host: in its network namespace, in IPC and mount
    namespaces of its own with a fresh ``/dev/shm``; it sleeps until it is stopped."""
    return ["ip", "netns", "exec", net.namespace(side),
            "unshare", "--ipc", "--mount", "--propagation", "private",
            "sh", "-c", "mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec sleep infinity"]


def wait_held(pid: int, timeout: float = 30.0) -> None:
    """Wait until the holder ``pid`` sleeps in its own mount namespace (its /dev/shm
    mounted); NetnsError if it exits or takes longer."""
    mine = os.readlink("/proc/self/ns/mnt")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            mnt = os.readlink(f"/proc/{pid}/ns/mnt")
        except OSError:
            raise NetnsError(f"the simulated host's holder (pid {pid}) exited") from None
        if comm == "sleep" and mnt != mine:
            return
        time.sleep(0.05)
    raise NetnsError(f"the simulated host's holder (pid {pid}) did not start in {timeout:.0f} s")


def join_command(holder: int, cmd: Sequence[str], cwd: Path | None = None) -> list[str]:
    """``cmd`` in the network, IPC and mount namespaces of the side whose holder is
    ``holder`` (nsenter execs it: its pid is the one started)."""
    wd = [f"--wd={cwd}"] if cwd is not None else []
    return ["nsenter", f"--target={holder}", "--net", "--ipc", "--mount", *wd, "--", *cmd]


def shm_root(holder: int) -> Path:
    """The side's ``/dev/shm``, as the root mount namespace sees it."""
    return Path(f"/proc/{holder}/root/dev/shm")


def server_env(net: Network, side: str) -> dict[str, str]:
    """What a vLLM instance on the side needs: NIXL's side channel on its address, UCX
    restricted to TCP over its link, and UCX's protocol tables in its log (the proof of
    the transport: :func:`transports`)."""
    return {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": net.address(side),
        "UCX_TLS": UCX_TLS,
        "UCX_NET_DEVICES": net.device(side),
        "UCX_PROTO_INFO": "y",
    }


# --------------------------------------------------------------------------- the proof

#: A header row of UCX's protocol table: "| ucp_context_0 inter-node cfg#2 |".
_TABLE = re.compile(r"\|\s*ucp_context_\d+\s+(\S+)\s+cfg#\d+\s*\|")
#: A row of it whose last column names transports: "| 0..8176 | short | tcp/dev |".
_ROW = re.compile(r"\|[^|]*\|[^|]*\|\s*([^|]*?)\s*\|\s*$")
_LANE = re.compile(r"\b([a-z_0-9]+)/([A-Za-z0-9_.:-]+)")


def transports(log_text: str) -> dict[str, set[str]]:
    """The transports (``tl/device``) UCX chose, per kind of endpoint configuration
    (``self``, ``intra-node``, ``inter-node``, ...), from the protocol tables
    ``UCX_PROTO_INFO=y`` writes when an endpoint is first used."""
    out: dict[str, set[str]] = {}
    kind = None
    for line in log_text.splitlines():
        m = _TABLE.search(line)
        if m:
            kind = m.group(1)
            continue
        if kind is None:
            continue
        r = _ROW.search(line)
        if r:
            lanes = {f"{a}/{b}" for a, b in _LANE.findall(r.group(1))}
            if lanes:
                out.setdefault(kind, set()).update(lanes)
    return out


def tcp_verdict(net: Network, logs: dict[str, str]) -> tuple[bool, dict[str, Any]]:
    """Whether NIXL moved KV over TCP on the link only: the decode instance (which
    reads the prefill's blocks) used ``tcp/<its device>`` for an endpoint to another
    process, and no endpoint of either side used another transport. The verdict, and
    the transports seen per side."""
    seen = {side: transports(text) for side, text in logs.items()}
    remote = {side: sorted(set().union(*[v for k, v in t.items() if k != "self"] or [set()]))
              for side, t in seen.items()}
    d_dev = f"tcp/{net.device('d')}"
    others = sorted({lane for lanes in remote.values() for lane in lanes
                     if not lane.startswith("tcp/")})
    ok = d_dev in remote.get("d", []) and not others
    return ok, {"remote_endpoints": remote, "other_transports": others,
                "expected": d_dev}


def _taken_networks() -> list[ipaddress.IPv4Network]:
    out = []
    for args in (("-4", "route", "show", "table", "all"), ("-4", "addr", "show")):
        done = _ip(*args, check=False)
        for m in re.finditer(r"(?<![\d.])(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", done.stdout):
            try:
                net = ipaddress.IPv4Network(m.group(1), strict=False)
            except ValueError:
                continue
            if net.prefixlen > 0:
                out.append(net)
    return out
