"""``python -m kvshelf.bench.tiers``: see :mod:`kvshelf.bench.tiers.run`."""

import sys

from kvshelf.bench.tiers.run import main

sys.exit(main())
