"""``python -m serving``: see :mod:`serving.cli`."""

import sys

from serving.cli import main

sys.exit(main())
