"""``python -m edged.edgectl``: the same as the ``edgectl`` console script."""

import sys

from edged.edgectl import main

sys.exit(main())
