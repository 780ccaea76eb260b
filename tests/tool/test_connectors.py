"""One connector registry: every command's ``--connector`` offers its names."""

from __future__ import annotations

import click
import pytest

from hybridpd import connectors
from hybridpd.cli.main import main


def _connector_params(group: click.Group, path: tuple[str, ...] = ()):
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _connector_params(command, (*path, name))
            continue
        for param in command.params:
            if "--connector" in getattr(param, "opts", ()):
                yield " ".join((*path, name)), param


def test_every_connector_option_offers_the_registrys_names() -> None:
    found = dict(_connector_params(main))
    assert found, "no command has --connector"
    registry = set(connectors.SETS) | {a for s in connectors.SETS.values() for a in s.aliases}
    for command, param in found.items():
        assert isinstance(param.type, click.Choice), command
        assert set(param.type.choices) <= registry, command
        # Each command's own name: its sets, from the registry, nothing typed by hand.
        # (``bench replay`` offers the sets its replay builds: ``replay``.)
        tag = {"bench replay": "replay"}.get(command, command.split()[0])
        assert tuple(param.type.choices) == connectors.choices(tag), command


def test_an_alias_is_the_sets_one_name() -> None:
    assert connectors.get("nixl+offload") is connectors.SETS["nixl+offloading"]
    for command in ("e2e", "explain"):
        option = next(p for c, p in _connector_params(main) if c == command)
        ctx = click.Context(click.Command("x"))
        value = ("nixl+offload",) if option.multiple else "nixl+offload"
        assert option.process_value(ctx, value) in ("nixl+offloading", ("nixl+offloading",))


def test_an_unknown_set_is_one_line() -> None:
    with pytest.raises(connectors.ConnectorError, match="not a known set") as err:
        connectors.get("pd")
    assert "\n" not in str(err.value)


def test_sets_are_vllms_connector_classes_in_multiconnector_order() -> None:
    kv = connectors.set_config("lmcache+nixl", "kv_consumer")
    assert [c["kv_connector"] for c in kv["kv_connector_extra_config"]["connectors"]] \
        == ["LMCacheMPConnector", "NixlConnector"]
    assert connectors.set_config("nixl", "kv_both") == \
        {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    # One CPU cache size for the offloading tier, whichever command configures it.
    off = connectors.set_config("nixl+offloading", "kv_both")
    assert off["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"] \
        == {"cpu_bytes_to_use": 10 << 30}
    assert not connectors.SETS["nixl+offloading"].cpu
