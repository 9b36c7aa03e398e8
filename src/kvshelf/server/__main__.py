"""``python -m kvshelf.server [flags]``: the same as ``kvshelf server [flags]``."""

import sys

from kvshelf.server.cli import main

sys.exit(main(sys.argv[1:]))
