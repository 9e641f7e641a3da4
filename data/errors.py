"""The data package's error base (data imports nothing from arvdm; arvdm.errors.USER_ERRORS includes it)."""

from __future__ import annotations


class DataError(ValueError):
    """Base of the data package's user-facing errors: a bad episode file, data folder, generator or env."""
