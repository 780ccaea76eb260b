"""``python -m hybridpd.e2e ARGS`` = ``hybridpd e2e ARGS``."""

import sys

from hybridpd.cli import main

sys.exit(main(["e2e", *sys.argv[1:]], prog_name="hybridpd"))
