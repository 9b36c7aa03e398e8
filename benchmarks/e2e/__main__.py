"""``python -m benchmarks.e2e`` (``make bench-e2e``): see `benchmarks.e2e.cli`."""

import sys

from benchmarks.e2e.cli import main

sys.exit(main())
