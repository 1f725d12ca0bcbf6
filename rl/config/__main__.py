"""`python -m rl.config show FILE [k=v ...]`: the same as `odyssey config show`."""

import sys

from rl.config.loader import cli_main

sys.exit(cli_main(sys.argv[1:]))
