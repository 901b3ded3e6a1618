"""`python -m workbench ...`: the `workbench` command without the installed console script."""

import sys

from .cli import main

sys.exit(main())
