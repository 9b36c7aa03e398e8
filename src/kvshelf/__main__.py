import sys

from kvshelf.cli import main

sys.exit(main())
