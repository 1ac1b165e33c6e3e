# `python -m vramledger ...`: runs the command line of vramledger.cli.
# Stateless; exits with main()'s status.
import sys

from vramledger.cli import main

sys.exit(main())
