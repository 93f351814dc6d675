"""``python -m edged`` runs the daemon."""

import sys

from edged.cli import main

sys.exit(main())
