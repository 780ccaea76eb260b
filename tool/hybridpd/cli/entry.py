"""The ``hybridpd`` command: the CLI, with a signal at any time after its first line
reported as an interruption.

Importing the CLI (click, GitPython, every command: :mod:`hybridpd.cli.main`) takes a
noticeable moment, before its one error handler (:class:`hybridpd.cli.jsonout.JsonGroup`)
exists. :func:`main` installs the signal handlers first (:mod:`.signals`), so Ctrl-C,
SIGTERM or SIGHUP from then on ends as any other Ctrl-C does: ``Error: interrupted``
and exit 130, and, for a ``--json`` run, the failure document on stdout that the CLI
prints for every failure (:func:`hybridpd.cli.jsonout.failure_document`). The console
script (``tool/scripts/hybridpd``) calls :func:`main` and imports nothing before it;
this module and :mod:`.signals` import only the standard library.
"""

from __future__ import annotations

import os
import sys

from hybridpd.cli import signals

#: The fault-injection hook's variable (see :func:`hybridpd.guard.fault`); this module
#: cannot import guard (that is the start-up it guards). ``startup:<SIG>`` sends SIG
#: (INT, TERM or HUP) while the CLI imports, ``imported:<SIG>`` between the import and
#: the command's parsing.
_FAULT_ENV = "HYBRIDPD_FAULT"
#: The failure document (see :func:`hybridpd.cli.jsonout.failure_document`), which
#: cannot be imported here.
INTERRUPTED_DOCUMENT = '{"ok": false, "error": "interrupted"}'


def main() -> int:
    signals.install()
    try:
        with signals.armed():
            _fault("startup")
            from hybridpd.cli.main import main as cli
        _fault("imported")
        return cli(prog_name="hybridpd")
    except KeyboardInterrupt:
        return interrupted()


def interrupted() -> int:
    """Report an interruption before the CLI's error handler exists; the exit code."""
    from hybridpd.cli.argv import wants_json

    if wants_json(sys.argv[1:]):
        print(INTERRUPTED_DOCUMENT, flush=True)
    print("Error: interrupted", file=sys.stderr)
    return 130


def _fault(point: str) -> None:
    wanted = os.environ.get(_FAULT_ENV, "")
    name, _, sig = wanted.rpartition(":")
    if name == point and sig in ("INT", "TERM", "HUP"):
        import signal

        os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))


if __name__ == "__main__":
    sys.exit(main())
