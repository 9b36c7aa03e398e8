"""``python -m kvshelf.bench.chaos`` (``make bench-chaos``): see `kvshelf.bench.chaos.cli`."""

import sys

from kvshelf.bench.chaos.cli import main

sys.exit(main())
