"""``python -m ternary_rs`` is the ``ternary-rs`` command."""

import sys

from .cli import main

sys.exit(main())
