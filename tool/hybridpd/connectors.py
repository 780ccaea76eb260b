"""The KV connector sets hybridpd knows, by name: one registry for ``e2e``, ``bench``,
``explain`` and the series' risk records (vLLM's own ``--kv-transfer-config`` JSON is
taken as it is).

A set is the decode instance's connectors, in MultiConnector order (the first child that
reports tokens serves a request); one name each, older spellings kept as aliases. Which
commands offer a set is a property of the set: ``e2e`` runs real engines (a set must start
on one), ``bench`` times the lookup and ``replay`` (``bench replay``) replays the
scheduler with the connectors the patch tests' builders construct, ``explain`` asks vLLM whether the set starts and what it serves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hybridpd.errors import HybridpdError

class ConnectorError(HybridpdError):
    """A connector set that is neither a known name nor vLLM's JSON."""


@dataclass(frozen=True)
class ConnectorSet:
    """A decode instance's KV connector set."""

    name: str
    #: vLLM connector class names, in MultiConnector order (one: no MultiConnector).
    children: tuple[str, ...]
    #: The commands that offer it (``e2e``, ``bench``, ``explain``).
    commands: frozenset[str]
    #: Whether vLLM starts it on a CPU engine (``e2e --device cpu``).
    cpu: bool = True
    aliases: tuple[str, ...] = ()


#: Each child class's ``kv_connector_extra_config`` beyond what a deployment adds itself
#: (NIXL's buffer device, the LMCache server's address). The CPU tier's size is required by
#: OffloadingConnector; 10 GiB is vLLM's docs' example (docs/features/kv_offloading_usage.md).
CHILD_EXTRA: dict[str, dict] = {
    "OffloadingConnector": {"cpu_bytes_to_use": 10 << 30},
    "DecodeBenchConnector": {},
}

_ALL = frozenset({"e2e", "bench", "replay", "explain"})

#: The named sets, in the order commands list them.
SETS: dict[str, ConnectorSet] = {s.name: s for s in (
    ConnectorSet("nixl", ("NixlConnector",), _ALL),
    # On CPU the stand-in for an offloading connector: it supports HMA but does not
    # declare divergent local hybrid hits, so upstream's capability gate
    # (``supports_divergent_local_hybrid_hits``) gives D no local hit.
    ConnectorSet("nixl+decodebench", ("NixlConnector", "DecodeBenchConnector"),
                 frozenset({"e2e", "bench", "replay"})),
    # The production pairing; OffloadingConnector refuses to start on a CPU engine.
    ConnectorSet("nixl+offloading", ("NixlConnector", "OffloadingConnector"),
                 frozenset({"e2e", "replay", "explain"}), cpu=False, aliases=("nixl+offload",)),
    # The other order: the CPU tier serves a request before NIXL is asked.
    ConnectorSet("offloading+nixl", ("OffloadingConnector", "NixlConnector"),
                 frozenset({"replay"}), cpu=False),
    # NIXL and LMCacheMPConnector in both child orders, the decode instance with its own
    # `lmcache server`.
    ConnectorSet("nixl+lmcache", ("NixlConnector", "LMCacheMPConnector"),
                 frozenset({"e2e", "replay", "explain"})),
    ConnectorSet("lmcache+nixl", ("LMCacheMPConnector", "NixlConnector"),
                 frozenset({"e2e", "replay", "explain"})),
    # vLLM refuses a hybrid Mamba model with it at start-up (see the dropped record of
    # lmcache-connector-hma): explain says so, e2e cannot run it.
    ConnectorSet("lmcache-v1", ("LMCacheConnectorV1",), frozenset({"explain"})),
)}

_ALIASES = {alias: s.name for s in SETS.values() for alias in s.aliases}


def names(command: str) -> tuple[str, ...]:
    """The sets ``command`` offers, by name."""
    return tuple(name for name, s in SETS.items() if command in s.commands)


def choices(command: str) -> tuple[str, ...]:
    """What ``command``'s ``--connector`` accepts: its sets' names, then their aliases."""
    offered = names(command)
    return offered + tuple(a for a, name in _ALIASES.items() if name in offered)


def get(name: str) -> ConnectorSet:
    """The set named ``name`` (or one of its aliases)."""
    found = SETS.get(_ALIASES.get(name, name))
    if found is None:
        raise ConnectorError(f"--connector {name}: not a known set "
                             f"({', '.join(SETS)}); or pass --kv-transfer-config")
    return found


def uses(name: str, child: str) -> bool:
    """Whether set ``name`` has a ``child`` connector class."""
    return child in get(name).children


def multi(role: str, children: list[dict]) -> dict:
    """vLLM's MultiConnector over ``children``."""
    return {"kv_connector": "MultiConnector", "kv_role": role,
            "kv_connector_extra_config": {"connectors": children}}


def child_config(child: str, role: str) -> dict:
    """One child's config: its class, role and :data:`CHILD_EXTRA`."""
    extra = CHILD_EXTRA.get(child)
    return {"kv_connector": child, "kv_role": role,
            **({"kv_connector_extra_config": dict(extra)} if extra is not None else {})}


def set_config(name: str, role: str) -> dict:
    """Set ``name`` as vLLM's ``--kv-transfer-config``, every child with ``role``."""
    children = [child_config(c, role) for c in get(name).children]
    return children[0] if len(children) == 1 else multi(role, children)


def _classes(kv: dict) -> set[str]:
    children = (kv.get("kv_connector_extra_config") or {}).get("connectors") or []
    return {kv["kv_connector"]} | set().union(*map(_classes, children))


#: The connector class names a named set configures (MultiConnector for those of several
#: children). A risk record's ``when.connectors`` must name one of these (or ``"*"``): a
#: name no deployment configures would never match.
KNOWN = frozenset(set().union(*(_classes(set_config(name, "kv_both")) for name in SETS)))


def kv_transfer_config(connector: str | None, config_json: str | None,
                       role: str = "kv_both") -> dict | None:
    """The ``--kv-transfer-config`` the deployment runs: a named set, vLLM's JSON (or
    ``@FILE`` holding it), or None (no connector)."""
    if connector and config_json:
        raise ConnectorError("give --connector or --kv-transfer-config, not both")
    if connector:
        return set_config(connector, role)
    if not config_json:
        return None
    text = config_json
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            raise ConnectorError(f"--kv-transfer-config {config_json}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConnectorError(f"--kv-transfer-config: not JSON ({exc})") from None
    if not isinstance(data, dict) or "kv_connector" not in data:
        raise ConnectorError("--kv-transfer-config: a JSON object with kv_connector, "
                             "as vLLM's own flag takes")
    return data
