"""`python -m arvdm.experiments pareto|report`: experiment grids (arvdm.experiments.cli)."""

import sys

from arvdm.runtime import setup_environment

setup_environment()  # before torch loads (the CLI's imports load it): OpenMP reads it once

from arvdm.experiments.cli import main  # noqa: E402 - after setup_environment, on purpose

sys.exit(main())
