"""``python -m kvshelf.server [flags]``: the same as ``kvshelf server [flags]``."""

import sys

from kvshelf.cli.server import main

sys.exit(main(sys.argv[1:]))
