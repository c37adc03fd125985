"""User-facing errors.

Every error a user can cause (a missing file, a malformed line, a bad option) is raised as a
:class:`RecspecError` whose message names the input and says what to do; the command line
prints that one line and exits with status 2 instead of a traceback.
"""

from __future__ import annotations


class RecspecError(Exception):
    """An error caused by the user's input or environment, with a one-line actionable message."""
