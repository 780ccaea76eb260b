"""The ``--json`` contract: every command run with ``--json`` prints one JSON document
on stdout, whether it succeeds or fails.

On success the document is the command's own (see each command). On failure, unless
the command already printed its document (``check`` and ``port`` describe their
failures themselves), it is ``{"ok": false, "error": "<the one-line message>"}``; the
message also goes to stderr as ``Error: ...`` and the exit code stays 1 (a failed
operation), 2 (bad usage) or 130 (interrupted).

Commands declare the flag with :func:`flag`, print with :func:`emit`, and the
command group (:class:`JsonGroup`) writes the failure document.
"""

from __future__ import annotations

import errno
import json
import os
import urllib.error
from typing import Any

import click

from hybridpd.cli import signals
from hybridpd.cli.argv import wants_json
from hybridpd.errors import HybridpdError, Interrupted, LocalFileError, UsageError

_META = "hybridpd.json"
#: Set, a crash (an exception that is not one of hybridpd's errors) shows its traceback.
DEBUG_ENV = "HYBRIDPD_DEBUG"


def _remember(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    ctx.meta[_META] = {"on": value, "emitted": False}
    return value


def flag(help: str = "Print JSON for machines.") -> Any:
    """The ``--json`` option (``as_json``). Eager: a later usage error still sees it."""
    return click.option(
        "--json", "as_json", is_flag=True, is_eager=True, callback=_remember, help=help
    )


def emit(data: Any) -> None:
    """Print the command's JSON document."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None and _META in ctx.meta:
        ctx.meta[_META]["emitted"] = True
    click.echo(json.dumps(data, indent=2))


def failure_document(ctx: click.Context, exc: click.ClickException | HybridpdError) -> dict | None:
    """What a failed ``--json`` run prints on stdout, or None."""
    state = ctx.meta.get(_META)
    if not state or not state["on"] or state["emitted"]:
        return None
    return {"ok": False, "error": exc.format_message()}


class _Failed(click.ClickException):
    """A library error, for click to print and exit with."""

    def __init__(self, exc: HybridpdError) -> None:
        super().__init__(exc.message)
        self.exit_code = exc.exit_code


class UsageGroup(click.Group):
    """A group whose subcommands' :class:`~hybridpd.errors.UsageError` is click's own,
    with the subcommand's usage line (a nested group such as ``bench`` is one too, so
    that its subcommands' usage line is theirs, not the group's)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except UsageError as exc:
            raise click.UsageError(exc.message, _command_context(self, ctx)) from None


class JsonGroup(UsageGroup):
    """The CLI's one error handler; its commands keep the ``--json`` contract on failure.

    A :class:`~hybridpd.errors.HybridpdError` is printed as ``Error: <message>`` with
    its exit code (a :class:`~hybridpd.errors.UsageError` as click prints its own, with
    the command's usage line); an ``OSError`` that reaches it is a local file system error (network
    errors are :class:`~hybridpd.errors.PackageIndexError` by then), reported in one
    line like any other failure, not as a traceback; Ctrl-C or SIGTERM (which the CLI
    turns into KeyboardInterrupt) is :class:`~hybridpd.errors.Interrupted` (exit 130)
    once the command's own cleanup has run. Any other exception is a bug: one line
    ``internal error: ...`` (exit 1, and the ``--json`` document), its traceback only
    with ``HYBRIDPD_DEBUG=1``.
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # The group's own options (`--series`, an unknown one) are parsed before any
        # command's --json callback: the command line says whether JSON was asked for.
        asked = wants_json(list(args))
        try:
            try:
                with signals.armed():
                    return super().parse_args(ctx, args)
            except KeyboardInterrupt:
                raise _Failed(Interrupted("interrupted")) from None
        except click.ClickException as exc:
            if asked:
                click.echo(json.dumps({"ok": False, "error": exc.format_message()}))
            raise

    def invoke(self, ctx: click.Context) -> Any:
        # A usage error that click's parser raises (an unknown option, an option without
        # its value) comes before the subcommand's --json callback has run: its own
        # command line says whether it asked for JSON.
        asked = wants_json([*_protected_args(ctx), *ctx.args])
        try:
            try:
                try:
                    with signals.armed():
                        return super().invoke(ctx)
                except OSError as exc:
                    # A closed stdout (`hybridpd list | head`) is click's to handle
                    # quietly, and a network error is not a local one.
                    if exc.errno == errno.EPIPE or isinstance(exc, urllib.error.URLError):
                        raise
                    raise LocalFileError.from_os_error(exc) from exc
            except HybridpdError as exc:
                raise _Failed(exc) from exc
            except KeyboardInterrupt:
                raise _Failed(Interrupted("interrupted")) from None
            except (click.ClickException, click.exceptions.Exit, click.Abort):
                raise
            except BrokenPipeError:  # click's to end quietly (see above)
                raise
            except Exception as exc:
                if os.environ.get(DEBUG_ENV):
                    raise
                raise _Failed(HybridpdError(
                    f"internal error: {type(exc).__name__}: {exc} "
                    f"(a hybridpd bug; {DEBUG_ENV}=1 shows where)"
                )) from exc
        except click.ClickException as exc:
            doc = failure_document(ctx, exc)
            if doc is None and asked and _META not in ctx.meta:
                doc = {"ok": False, "error": exc.format_message()}
            if doc is not None:
                click.echo(json.dumps(doc))
            raise


def _command_context(group: click.Group, ctx: click.Context) -> click.Context | None:
    """A context of the subcommand that ran, for its usage line (its own is closed)."""
    name = ctx.invoked_subcommand
    command = group.get_command(ctx, name) if name else None
    return None if command is None else click.Context(command, info_name=name, parent=ctx)


def _protected_args(ctx: click.Context) -> list[str]:
    """The group's subcommand name and the arguments before its options (click 8.2
    renamed ``protected_args`` to ``_protected_args`` and deprecated the old name)."""
    if hasattr(ctx, "_protected_args"):
        return list(ctx._protected_args)
    return list(ctx.protected_args)
