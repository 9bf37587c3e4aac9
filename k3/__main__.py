"""`python -m k3 ...`: the same as the `k3` command."""

import sys

from k3.cli import main

sys.exit(main())
