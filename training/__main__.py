"""``python -m training``: see :mod:`training.cli`."""

import sys

from training.cli import main

sys.exit(main())
