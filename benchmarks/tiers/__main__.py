"""``python -m benchmarks.tiers``: see :mod:`benchmarks.tiers.run`."""

import sys

from benchmarks.tiers.run import main

sys.exit(main())
