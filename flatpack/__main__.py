import sys

from flatpack.cli import main

sys.exit(main())
