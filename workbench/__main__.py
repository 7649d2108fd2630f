"""`python -m workbench ...` works like the `workbench` command."""

import sys

from workbench.cli import main

sys.exit(main())
