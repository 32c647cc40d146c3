"""`python -m kiln.distributed launch|store|fr ...`: the distributed CLI on its own."""

import sys

from kiln.distributed.commands import main

sys.exit(main())
