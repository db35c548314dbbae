"""Errors of the batching layer that a user can fix (one line each, see `sparsebalance_ft.errors`)."""
from __future__ import annotations

from ..errors import UserError


class BatchingError(UserError):
    """A batching setting or input a user can fix: unknown policy, bad world size, empty data."""


class DocumentTooLongError(BatchingError):
    """A document has more tokens than one micro-batch may hold; raised when the sampler is built."""
