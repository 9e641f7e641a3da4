"""`python -m arvdm.hybrid calibrate|report`: lazy ratios and the hybrid-attention report (arvdm.hybrid.report)."""

import sys

from arvdm.hybrid.report import main

sys.exit(main())
