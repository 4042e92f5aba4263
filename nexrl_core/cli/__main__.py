"""``python -m nexrl_core.cli``: the ``nexrl`` command without its console script."""

import sys

from .commands import main

sys.exit(main())
