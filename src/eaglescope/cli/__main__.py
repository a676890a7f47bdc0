"""`python -m eaglescope.cli` (how torchrun starts each rank: `torchrun ... -m eaglescope.cli train ...`)."""

import sys

from eaglescope.cli import main

sys.exit(main())
