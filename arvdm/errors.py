"""One error family for everything a user can get wrong, and the tuple every CLI catches.

    from arvdm.errors import ArvdmError, USER_ERRORS
    try:
        ...
    except USER_ERRORS as e:          # one line on stderr, exit status 2, no traceback
        print(f"prog: error: {e}", file=sys.stderr)

Every user-facing error of ``arvdm`` derives from `ArvdmError` (a ValueError). The lower packages may not
import arvdm (dependencies point ``arvdm -> memory -> kernels`` and ``arvdm -> data``), so each has its own
base: ``data.errors.DataError`` (episodes, data sets, generators, environments) and
``memory.RetentionError`` (the memory package's one user error). ``kernels`` has none: its ValueErrors are a
caller's bug (shapes, dtypes), found before by config validation. `USER_ERRORS` holds the three bases plus
OSError (a path the user gave that is missing, unreadable or unwritable).
"""

from __future__ import annotations

from data.errors import DataError
from memory.retention import RetentionError


class ArvdmError(ValueError):
    """Base of arvdm's user-facing errors: bad config, flag, schedule, checkpoint, grid or run folder."""


class ConfigError(ArvdmError):
    """A configuration value is unknown, of the wrong type, or out of range."""


class SamplingError(ArvdmError):
    """A sampling setting (a sample.py flag) is out of range, or a rollout cannot be run as asked."""


USER_ERRORS: tuple[type[BaseException], ...] = (ArvdmError, DataError, RetentionError, OSError)

__all__ = ["USER_ERRORS", "ArvdmError", "ConfigError", "DataError", "RetentionError", "SamplingError"]
