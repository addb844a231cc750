"""``python -m hasten.commands.config`` (and ``python -m accelerate.commands.config``): run ``hasten config``."""

import sys

from . import main

sys.exit(main())
