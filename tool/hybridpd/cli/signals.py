"""SIGINT, SIGTERM and SIGHUP end hybridpd as Ctrl-C does, from the console script's
first line on.

The console script (:mod:`.entry`) calls :func:`install` before it imports anything
else. From then on a signal is raised as KeyboardInterrupt inside an :func:`armed`
region, where hybridpd turns it into ``Error: interrupted`` (exit 130, and the
``--json`` failure document): the CLI's import, and the command group's parsing and
invocation (:class:`hybridpd.cli.jsonout.JsonGroup`). A signal that arrives between
two regions is held and raised as the next one opens; one that arrives after the
command finished is dropped, since its work is done. Outside a region the exception
would reach code that does not expect it (click's own start and teardown, the
interpreter's exit) and end in a traceback or click's ``Aborted!``.

Standard library only, and not even :mod:`signal` (it imports ``enum``, several
milliseconds of start-up in which SIGTERM would end the process without a word): its
C core ``_signal``, which the interpreter loads before any script runs.
"""

from __future__ import annotations

import _signal

#: The signals hybridpd handles, where each still has its default action.
_NAMES = ("SIGINT", "SIGTERM", "SIGHUP")

_held: list[int] = []
_depth = 0


def install() -> None:
    """Handle the signals that keep their default action: an ignored one (SIGHUP under
    ``nohup``) stays ignored, and a handler someone else installed stays theirs."""
    for name in _NAMES:
        signum = getattr(_signal, name)
        default = _signal.default_int_handler if name == "SIGINT" else _signal.SIG_DFL
        if _signal.getsignal(signum) is default:
            _signal.signal(signum, _handle)


def _handle(signum: int, _frame: object) -> None:
    if _depth:
        raise KeyboardInterrupt(_name(signum))
    _held.append(signum)


def _name(signum: int) -> str:
    return next((n for n in _NAMES if getattr(_signal, n) == signum), str(signum))


class armed:
    """A region where a signal is raised as KeyboardInterrupt; a signal held since the
    last region is raised on entering it."""

    def __enter__(self) -> None:
        global _depth
        if _held:
            signum = _held[0]
            _held.clear()
            raise KeyboardInterrupt(_name(signum))
        _depth += 1

    def __exit__(self, *_exc: object) -> None:
        global _depth
        _depth -= 1
