"""The ``hybridpd`` console script: the CLI, with a Ctrl-C during start-up reported as
one line.

Importing the CLI (click, GitPython, every command: :mod:`hybridpd.cli.main`) takes a noticeable moment, before
its one error handler (:class:`hybridpd.cli.jsonout.JsonGroup`) exists; a Ctrl-C then
used to print a traceback. This module imports only the standard library, so a
KeyboardInterrupt from here on ends as any other Ctrl-C does: ``Error: interrupted``
and exit 130, and, for a ``--json`` run, the failure document on stdout that the CLI
prints for every failure (:func:`hybridpd.cli.jsonout.failure_document`).
"""

from __future__ import annotations

import json
import os
import signal
import sys

from hybridpd.cli.argv import wants_json

#: The fault-injection hook's variable (see :func:`hybridpd.guard.fault`); this module
#: cannot import guard (that is the start-up it guards).
_FAULT_ENV = "HYBRIDPD_FAULT"


def main() -> int:
    try:
        if os.environ.get(_FAULT_ENV) == "startup:INT":  # tests: Ctrl-C while importing
            os.kill(os.getpid(), signal.SIGINT)
        from hybridpd.cli.main import main as cli

        return cli(prog_name="hybridpd")
    except KeyboardInterrupt:
        if wants_json(sys.argv[1:]):
            # The shape of hybridpd.cli.jsonout.failure_document, which is not imported
            # yet (or only in part) here.
            print(json.dumps({"ok": False, "error": "interrupted"}), flush=True)
        print("Error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
