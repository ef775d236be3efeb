"""The pagedkv exception hierarchy.

Every misuse of the manager raises a :class:`PagedKVError` subclass and leaves the
manager exactly as it was. The classes also derive from the matching built-in
exception, so ``except KeyError`` / ``except ValueError`` keep working.
"""

from __future__ import annotations

__all__ = [
    "CannotFitError",
    "DuplicateRequestError",
    "InvalidArgumentError",
    "InvalidConfigError",
    "InvariantViolationError",
    "PagedKVError",
    "StaleComputedBlocksError",
    "UnknownRequestError",
]


class PagedKVError(Exception):
    """Base class of every error pagedkv raises on purpose."""


class UnknownRequestError(PagedKVError, KeyError):
    """The request id was never added, or has been removed."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class DuplicateRequestError(PagedKVError, ValueError):
    """``add_request`` with an id that is already known."""


class InvalidArgumentError(PagedKVError, ValueError):
    """A count, token id, block id or option is out of range or inconsistent."""


class StaleComputedBlocksError(PagedKVError, ValueError):
    """A ``get_computed_blocks`` result whose blocks were evicted or reused since,
    or that was looked up for another request or manager. Look the request up
    again."""


class CannotFitError(PagedKVError, ValueError):
    """The request needs more blocks than the whole pool has: it can never be
    scheduled with this configuration."""


class InvalidConfigError(PagedKVError, ValueError):
    """A configuration that cannot be built."""


class InvariantViolationError(PagedKVError, AssertionError):
    """``check_invariants`` found the manager's state inconsistent (a bug)."""
