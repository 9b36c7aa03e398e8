import sys

from kvshelf.bench.serve.run import main

sys.exit(main())
