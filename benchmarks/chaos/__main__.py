"""``python -m benchmarks.chaos`` (``make bench-chaos``): see `benchmarks.chaos.cli`."""

import sys

from benchmarks.chaos.cli import main

sys.exit(main())
