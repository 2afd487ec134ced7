"""User-facing errors: one line that names the field and the fix.

The CLI prints `StratagemError` as a single line and exits non-zero; anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

__all__ = ["StratagemError"]


class StratagemError(ValueError):
    """A mistake in user input (scenario, plan, storage URL, ...), worded as `field (value): fix`."""
