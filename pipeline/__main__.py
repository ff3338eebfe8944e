"""``python -m pipeline``: see :mod:`pipeline.run`."""

import sys

from pipeline.run import main

sys.exit(main())
