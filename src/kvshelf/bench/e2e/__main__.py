"""``python -m kvshelf.bench.e2e`` (``make bench-e2e``): see `kvshelf.bench.e2e.cli`."""

import sys

from kvshelf.bench.e2e.cli import main

sys.exit(main())
