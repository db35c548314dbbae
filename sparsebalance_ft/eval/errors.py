"""User-fixable evaluation errors (printed as one line, exit status 2 by the CLI)."""
from __future__ import annotations

from ..errors import UserError


class EvalError(UserError):
    """Base class of evaluation problems a user can fix."""


class EvalDataError(EvalError):
    """A missing, unreadable or malformed evaluation file; the message names the file (and line)."""


class EvalOptionError(EvalError):
    """An evaluation option that cannot work (unknown task, impossible length, bad checkpoint)."""
