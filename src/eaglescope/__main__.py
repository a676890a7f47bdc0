"""`python -m eaglescope`: the `eaglescope` command."""

import sys

from eaglescope.cli import main

sys.exit(main())
