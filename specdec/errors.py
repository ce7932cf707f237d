"""Typed domain errors. Services map each type to one status code in one place."""

from __future__ import annotations


class SpecdecError(Exception):
    """Base class of every error the core raises on purpose."""


class InvalidArgumentError(SpecdecError, ValueError):
    """A request field is out of range; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ModelNotFoundError(SpecdecError, LookupError):
    """No model could be found under the given name, path or alias."""


class IncompatibleDraftError(SpecdecError, ValueError):
    """The draft model cannot propose tokens for this target (e.g. different vocabulary)."""


class CapacityError(SpecdecError, RuntimeError):
    """A fixed capacity (sequence slots, context length) would be exceeded."""


class CancelledByCallerError(SpecdecError):
    """The caller cancelled the work before it was answered (mapped to CANCELLED)."""
