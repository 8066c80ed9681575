"""``python -m oneblock``."""

import sys

from oneblock.cli.main import main

sys.exit(main())
