"""``python -m hybridpd.e2e ARGS`` = ``hybridpd e2e ARGS`` (also before cli.py registers it)."""

import sys

from hybridpd.cli import main

from .command import e2e_command

if "e2e" not in main.commands:
    main.add_command(e2e_command)
sys.exit(main(["e2e", *sys.argv[1:]], prog_name="hybridpd"))
