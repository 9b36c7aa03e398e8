import sys

from benchmarks.serve.run import main

sys.exit(main())
