"""`python -m workbench ...`: the `workbench` command without the installed console script."""

from .cli import main

main()
