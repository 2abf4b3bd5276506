"""``python -m specserve`` runs the command line."""

import sys

from specserve.cli import main

sys.exit(main())
