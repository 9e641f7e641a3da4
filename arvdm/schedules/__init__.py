"""Meta-ARVDM scheduling matrices (arXiv 2503.10704): the schedule object, its presets, files and plots.

    from arvdm.schedules import get_schedule
    schedule = get_schedule("fifo", window=4, num_levels=1000, steps=16)   # or chunked / pyramid / a file

arvdm/schedules/matrix.py: ARSchedule and its conditions; presets.py: the presets and the lookup by name;
files.py: schedule files; plots.py: pictures and the ``python -m arvdm.schedules`` CLI.
"""

from arvdm.schedules.files import load_schedule
from arvdm.schedules.matrix import ARSchedule, ScheduleError, Transition
from arvdm.schedules.presets import PRESETS, chunked, fifo, from_level_fn, from_matrix, get_schedule, pyramid

__all__ = ["PRESETS", "ARSchedule", "ScheduleError", "Transition", "chunked", "fifo", "from_level_fn", "from_matrix",
           "get_schedule", "load_schedule", "pyramid"]
