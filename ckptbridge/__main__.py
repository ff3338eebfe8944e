import sys

from ckptbridge.cli import main

sys.exit(main())
