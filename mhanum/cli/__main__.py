"""``python -m mhanum.cli``: the ``mhanum`` console script."""

import sys

from mhanum.cli import main

sys.exit(main())
