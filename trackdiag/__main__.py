import sys

from trackdiag.cli import main

sys.exit(main())
