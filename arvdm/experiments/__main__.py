"""`python -m arvdm.experiments run|report`: experiment grids (arvdm.experiments.cli)."""

import sys

from arvdm.experiments.cli import main

sys.exit(main())
