"""What the command line asks for, read before click parses it: standard library only,
so the console script (:mod:`.entry`) and the error handler (:mod:`.jsonout`) agree on it
even while the CLI is still importing."""

from __future__ import annotations


def wants_json(args: list[str]) -> bool:
    """Whether the command line asks for ``--json`` (an option: before any ``--``)."""
    return "--json" in (args[: args.index("--")] if "--" in args else args)
