"""``python -m fp4gemv`` runs the command line."""

import sys

from fp4gemv.cli import main

sys.exit(main())
