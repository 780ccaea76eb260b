"""Named KV connector sets for ``explain --connector`` (vLLM's own
``--kv-transfer-config`` JSON is taken as it is)."""

from __future__ import annotations

import json
from pathlib import Path

from hybridpd.errors import HybridpdError


class ConnectorError(HybridpdError):
    """A connector set that is neither a known name nor vLLM's JSON."""


def _one(name: str, role: str) -> dict:
    return {"kv_connector": name, "kv_role": role}


def _multi(role: str, *children: dict) -> dict:
    return {"kv_connector": "MultiConnector", "kv_role": role,
            "kv_connector_extra_config": {"connectors": list(children)}}


def _offloading(role: str) -> dict:
    # The CPU tier's size is required; 10 GiB is vLLM's docs' example
    # (docs/features/kv_offloading_usage.md).
    return {**_one("OffloadingConnector", role),
            "kv_connector_extra_config": {"cpu_bytes_to_use": 10 << 30}}


#: The decode instance's sets an operator of a hybrid model asks about, by name.
SETS = {
    "nixl": lambda role: _one("NixlConnector", role),
    "nixl+lmcache": lambda role: _multi(
        role, _one("NixlConnector", role), _one("LMCacheMPConnector", role)),
    "lmcache+nixl": lambda role: _multi(
        role, _one("LMCacheMPConnector", role), _one("NixlConnector", role)),
    "nixl+offloading": lambda role: _multi(role, _one("NixlConnector", role), _offloading(role)),
    "lmcache-v1": lambda role: _one("LMCacheConnectorV1", role),
}


def _classes(kv: dict) -> set[str]:
    children = (kv.get("kv_connector_extra_config") or {}).get("connectors") or []
    return {kv["kv_connector"]} | set().union(*map(_classes, children))


#: The connector class names a ``--kv-transfer-config`` may configure that hybridpd
#: knows: those of the named sets, and vLLM's DecodeBenchConnector (``hybridpd bench``
#: and the e2e run it). A risk record's ``when.connectors`` must name one of these (or
#: ``"*"``): a name no deployment configures would never match.
KNOWN = frozenset(set().union(*(_classes(s("kv_both")) for s in SETS.values()))
                  | {"DecodeBenchConnector"})


def kv_transfer_config(connector: str | None, config_json: str | None,
                       role: str = "kv_both") -> dict | None:
    """The ``--kv-transfer-config`` the deployment runs: a named set, vLLM's JSON (or
    ``@FILE`` holding it), or None (no connector)."""
    if connector and config_json:
        raise ConnectorError("give --connector or --kv-transfer-config, not both")
    if connector:
        if connector not in SETS:
            raise ConnectorError(f"--connector {connector}: not a known set "
                                 f"({', '.join(SETS)}); or pass --kv-transfer-config")
        return SETS[connector](role)
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
