"""The CI gate of ``hybridpd e2e --expect-patched-hit``: red on stock, green patched."""

from __future__ import annotations

from pathlib import Path

from hybridpd.e2e.report import RunResult
from hybridpd.e2e.run import _failures

from builders import stub_pin

from hybridpd.cli.options import State


def _run(build: str, connector: str, hit: bool) -> RunResult:
    return RunResult(build, connector, "logs", checks={"decode_local_hit": hit})


def test_gate_passes_when_only_the_gated_connector_set_is_red_on_stock() -> None:
    runs = [
        _run("stock", "nixl", True),
        _run("stock", "nixl+decodebench", False),
        _run("patched", "nixl", True),
        _run("patched", "nixl+decodebench", True),
    ]
    assert [f for r in runs for f in _failures(r, "smoke", True, stub_pin("0.32.0"))] == []


def test_gate_fails_when_patched_loses_the_hit() -> None:
    (failure,) = _failures(_run("patched", "nixl+decodebench", False), "smoke", True, stub_pin("0.32.0"))
    assert "took no local prefix hit" in failure


def test_gate_fails_when_stock_shows_nothing_to_fix() -> None:
    (failure,) = _failures(_run("stock", "nixl+decodebench", True), "smoke", True, stub_pin("0.32.0"))
    assert "proves nothing" in failure
    (failure,) = _failures(_run("stock", "nixl", False), "smoke", True, stub_pin("0.33.0"))
    assert "upstream keeps" in failure


def test_stock_expectations_only_where_upstream_has_the_gate() -> None:
    # v0.20.2 has no per-group path: stock NIXL alone loses the hit too.
    assert _failures(_run("stock", "nixl", False), "smoke", True, stub_pin("0.20.2")) == []
    assert _failures(_run("stock", "nixl", False), "smoke", False, stub_pin("0.32.0")) == []


#: The CLI's state over the repository's series (``--pin`` is resolved in it as it is
#: parsed).
_REPO = State(Path(__file__).resolve().parents[2] / "patches" / "series.toml")


def test_the_recorded_command_reproduces_non_default_options() -> None:
    import shlex

    import click

    from hybridpd.cli.e2e import e2e_command, reproducing_argv

    args = [
        "--pin", "0.32.0", "--tiny", "--scenario", "prefix-repetition",
        "--role", "kv_producer/kv_consumer", "--connector", "nixl",
        "--connector", "nixl+decodebench", "--compare", "stock", "--prefix-len", "2048",
        "--num-prompts", "64", "--concurrency", "8", "--server-arg", "--enforce-eager",
        "--no-decode-prefix-caching", "--out", "somewhere", "--json",
        "--patched-venv", "/some/venv",
    ]
    ctx = e2e_command.make_context("e2e", list(args), obj=_REPO)
    argv = reproducing_argv(ctx)
    assert argv[:2] == ["hybridpd", "e2e"]
    assert "--out" not in argv and "--json" not in argv and "--patched-venv" not in argv
    again = e2e_command.make_context("e2e", argv[2:], obj=_REPO)
    skip = ("out_dir", "as_json", "patched_venv")
    same = {k: v for k, v in ctx.params.items() if k not in skip}
    assert {k: v for k, v in again.params.items() if k not in skip} == same
    assert "--no-decode-prefix-caching" in argv and "--server-arg" in argv
    assert shlex.split(shlex.join(argv)) == argv
    assert isinstance(ctx, click.Context)


def test_an_explicit_series_is_part_of_the_recorded_command(tmp_path) -> None:
    from hybridpd.cli.main import main
    from hybridpd.cli.e2e import e2e_command, reproducing_argv

    from builders import standard_project

    from hybridpd.cli.options import State

    series = standard_project(tmp_path)[1].path
    group = main.make_context("hybridpd", ["--series", str(series), "e2e", "--pin", "1.0"],
                              obj=State(series))
    ctx = e2e_command.make_context("e2e", ["--pin", "1.0", "--tiny"], parent=group)
    assert reproducing_argv(ctx) == [
        "hybridpd", "--series", str(series), "e2e", "--pin", "1.0", "--tiny"
    ]


def test_e2e_options_have_the_cli_names_and_defaults() -> None:
    import dataclasses

    from hybridpd.cli.e2e import e2e_command
    from hybridpd.e2e.run import E2EOptions

    ctx = e2e_command.make_context("e2e", ["--pin", "0.32.0", "--tiny"], obj=_REPO)
    # --reap DIR and --dry-run are other actions (reap, or print the servers' command
    # lines; run nothing), not options of a run.
    params = {k: v for k, v in ctx.params.items()
              if k not in ("as_json", "reap_dir", "dry_run")}
    options = E2EOptions(**params)
    fields = {f.name for f in dataclasses.fields(E2EOptions)}
    assert fields == set(params)
    # Every default the dataclass declares is the CLI's (a script gets what the CLI gets).
    defaults = E2EOptions(pin=options.pin, tiny=True)
    assert {f: getattr(defaults, f) for f in fields} == {f: getattr(options, f) for f in fields}
