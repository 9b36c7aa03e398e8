"""``python -m benchmarks.replay`` (``make bench-lazy``): see `benchmarks.replay.run`."""

import sys

from benchmarks.replay.run import main

sys.exit(main())
