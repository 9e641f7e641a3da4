"""`python -m arvdm.schedules`: draw and check scheduling matrices (arvdm.schedules.plots)."""

import sys

from arvdm.schedules.plots import main

sys.exit(main())
